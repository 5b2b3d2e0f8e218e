"""Text from generated tokens, as it grows, and the stop strings that end it.

A byte-level tokenizer may split one character over several tokens, so the
text of the tokens so far can end in half a character: that part is held
back until it is whole. Text that could be the start of a stop string is
held back too, so a client never sees part of a stop string it asked to
end on (as OpenAI's streams behave).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# What a decoder gives for bytes that do not (yet) make a whole character.
_INCOMPLETE = "\ufffd"


class Detokenizer:
    """One sequence's text: ``push`` each token, get the text that may be shown now."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.text = ""  # the whole characters so far (cut at the stop string once found)
        self.shown = 0  # how much of ``text`` has been handed out
        self.stopped = False
        # vLLM's incremental decoding: the text of ids[prefix:] less that of
        # ids[prefix:read] is what the newest tokens add, whatever the decoder
        # does at the start of a piece (a dropped leading space, say).
        self._prefix = 0
        self._read = 0

    def push(self, token: int) -> str:
        """Add one token; return the new text that can be shown (maybe "")."""
        if self.stopped:
            return ""
        self.ids.append(token)
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) > len(before) and not after.endswith(_INCOMPLETE):
            self.text += after[len(before) :]
            self._prefix = self._read
            self._read = len(self.ids)
        return self._release()

    def finish(self) -> str:
        """The rest of the text once the sequence has ended (what was held back)."""
        if not self.stopped:
            full = self._decode(self.ids)
            if full.startswith(self.text[: self.shown]):
                self.text = full
            self._find_stop()
        out = self.text[self.shown :]
        self.shown = len(self.text)
        return out

    def _release(self) -> str:
        if self._find_stop():
            out = self.text[self.shown :]
            self.shown = len(self.text)
            return out
        safe = len(self.text)
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(self.text)), 0, -1):
                if self.text.endswith(stop[:k]):
                    safe = min(safe, len(self.text) - k)
                    break
        safe = max(safe, self.shown)
        out = self.text[self.shown : safe]
        self.shown = safe
        return out

    def _find_stop(self) -> bool:
        """Cut ``text`` at the first stop string in it; True when one is found."""
        if not self.stop:
            return False
        longest = max(len(s) for s in self.stop)
        since = max(0, self.shown - longest + 1)
        found = [i for i in (self.text.find(s, since) for s in self.stop) if i >= 0]
        if not found:
            return False
        self.text = self.text[: min(found)]
        self.stopped = True
        return True

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))
