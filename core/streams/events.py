"""A job's events, as its worker writes them and ``GET /v1/jobs/{id}/events`` streams them.

Each event is one entry of the job's events stream (``core.streams.protocol.events_key``):

- ``status``: the job changed state (``running`` when a worker starts it);
- ``token``: a generation produced its token number ``index`` (0-based), with
  ``text``, the text it makes visible (possibly "": half a character, or what
  could be the start of a stop string, is held back until it is whole), and,
  when the job asked for them, the token's ``logprob`` (its own text, its log
  probability and the likeliest tokens at its place with theirs);
- ``done``: the job ended, with its terminal ``status`` and, for a
  generation, its ``finish_reason``. Nothing follows it.

The entry's id in Redis is the event's id, so a client reading again from
the last id it saw gets every later event exactly once, in order. The
stream expires ``ttl_s`` after the job's last event (a setting,
``FERRY_EVENTS_TTL_S``); a client that comes back later reads the job's
row instead. Malformed entries raise :class:`ProtocolError`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import redis
from redis.exceptions import NoScriptError

from core.streams.protocol import ProtocolError
from core.streams.target import is_cluster

EventKind = Literal["status", "token", "done"]
KINDS = ("status", "token", "done")


@dataclass(frozen=True)
class JobEvent:
    """One event; ``data`` is what the Server-Sent Event carries as JSON."""

    kind: EventKind
    status: str | None = None
    index: int | None = None
    token: int | None = None
    text: str | None = None
    finish_reason: str | None = None
    logprob: dict[str, Any] | None = None

    @classmethod
    def running(cls) -> JobEvent:
        return cls("status", status="running")

    @classmethod
    def token_event(
        cls, index: int, token: int, text: str, logprob: dict[str, Any] | None = None
    ) -> JobEvent:
        return cls("token", index=index, token=token, text=text, logprob=logprob)

    @classmethod
    def done(cls, status: str, finish_reason: str | None = None) -> JobEvent:
        return cls("done", status=status, finish_reason=finish_reason)

    def encode(self) -> dict[str, str]:
        fields: dict[str, str] = {"k": self.kind}
        if self.status is not None:
            fields["s"] = self.status
        if self.index is not None:
            fields["i"] = str(self.index)
        if self.token is not None:
            fields["tok"] = str(self.token)
        if self.text is not None:
            fields["txt"] = self.text
        if self.finish_reason is not None:
            fields["fr"] = self.finish_reason
        if self.logprob is not None:
            fields["lp"] = _encoded(self.logprob)
        return fields

    @classmethod
    def decode(cls, fields: Mapping[bytes | str, bytes | str]) -> JobEvent:
        try:
            f = {_text(k): _text(v) for k, v in fields.items()}
            kind = f["k"]
            if kind not in KINDS:
                raise ProtocolError(f"unknown event kind {kind!r}")
            return cls(
                kind=kind,  # type: ignore[arg-type]
                status=f.get("s"),
                index=int(f["i"]) if "i" in f else None,
                token=int(f["tok"]) if "tok" in f else None,
                text=f.get("txt"),
                finish_reason=f.get("fr"),
                logprob=_logprob(f["lp"]) if "lp" in f else None,
            )
        except ProtocolError:
            raise
        except (KeyError, ValueError, TypeError, UnicodeDecodeError) as exc:
            raise ProtocolError(f"malformed job event: {exc!r}") from exc

    @property
    def data(self) -> dict[str, Any]:
        if self.kind == "token":
            data = {"index": self.index, "token": self.token, "text": self.text}
            return data if self.logprob is None else data | {"logprob": self.logprob}
        out: dict[str, Any] = {"status": self.status}
        if self.finish_reason is not None:
            out["finish_reason"] = self.finish_reason
        return out


def _encoded(logprob: dict[str, Any]) -> str:
    return json.dumps(logprob, ensure_ascii=False, separators=(",", ":"))


def _logprob(encoded: str) -> dict[str, Any]:
    found = json.loads(encoded)
    if not isinstance(found, dict) or not isinstance(found.get("logprob"), int | float):
        raise ValueError(f"not a token's logprob: {encoded[:80]!r}")
    return found


# A token event is appended only where it comes next: right after the job's token before
# it (the first, after none) and never after the job's end. A worker cut off from Redis
# mid-step can have its writes arrive once the link is back (TCP sends them again, even
# after the client gave up on them), when another worker has taken the job over and
# streamed on, or finished it: the token would be in the stream twice, or after the end.
# newest(key): the index of the stream's last token (-1: none yet), nil once it ended.
_NEWEST = """
local function newest(key)
  local top, count = '+', 1
  repeat
    local page = redis.call('XREVRANGE', key, top, '-', 'COUNT', count)
    for _, entry in ipairs(page) do
      local f = entry[2]
      local kind = f[2]
      if f[1] ~= 'k' then
        kind = nil
        for i = 1, #f, 2 do
          if f[i] == 'k' then kind = f[i + 1] end
        end
      end
      if kind == 'done' then return nil end
      if kind == 'token' then
        for i = 1, #f, 2 do
          if f[i] == 'i' then return tonumber(f[i + 1]) end
        end
      end
    end
    if #page < count then return -1 end
    top = '(' .. page[#page][1]
    count = 4
  until false
end
"""
# KEYS: the events stream; ARGV: the token's index, then the event's fields.
_APPEND_TOKEN = (
    _NEWEST
    + """
if newest(KEYS[1]) ~= tonumber(ARGV[1]) - 1 then return 0 end
redis.call('XADD', KEYS[1], '*', unpack(ARGV, 2))
return 1
"""
)


def _steps_script(logprobs: bool) -> str:
    """A step's tokens in one call. KEYS: the events streams; ARGV: for each, the token's
    index, the token, its text and, with ``logprobs``, its logprob ("": its job asked for
    none). For each, 1 if appended, else 0. A step of jobs that asked for no logprobs
    sends the script without, an argument fewer a token, each token one XADD as before."""
    add = "redis.call('XADD', KEYS[n], '*', 'k', 'token', 'i', index, 'tok', token, 'txt', text"
    stride, append = "3", add + ")"
    if logprobs:
        stride = "4"
        append = f"""if ARGV[at + 4] == '' then {add}) else {add}, 'lp', ARGV[at + 4]) end"""
    return _NEWEST + (
        """
local appended = {}
for n = 1, #KEYS do
  local at = STRIDE * (n - 1)
  local index, token, text = ARGV[at + 1], ARGV[at + 2], ARGV[at + 3]
  if newest(KEYS[n]) == tonumber(index) - 1 then
    APPEND
    appended[n] = 1
  else
    appended[n] = 0
  end
end
return appended
""".replace("STRIDE", stride).replace("APPEND", append)
    )


_APPEND_TOKENS = _steps_script(logprobs=False)
_APPEND_TOKENS_LOGPROBS = _steps_script(logprobs=True)
_SCRIPTS = {
    hashlib.sha1(script.encode()).hexdigest(): script
    for script in (_APPEND_TOKEN, _APPEND_TOKENS, _APPEND_TOKENS_LOGPROBS)
}
_APPEND_TOKEN_SHA, _APPEND_TOKENS_SHA, _APPEND_TOKENS_LOGPROBS_SHA = _SCRIPTS


def append_token(target: redis.Redis | redis.client.Pipeline, key: str, event: JobEvent) -> Any:
    """Append a token's ``event`` to the events stream ``key`` where it comes next (1), else
    nothing (0); on a pipeline, queued (run it with :func:`run_appends`).

    Sent by the script's SHA (a step writes a token for every sequence: the script's
    text each time would cost Redis its parse and the step its bytes), but whole to a
    Cluster, whose nodes may not know it."""
    assert event.kind == "token" and event.index is not None
    fields = [part for pair in event.encode().items() for part in pair]
    return _call(target, _APPEND_TOKEN_SHA, [key], [event.index, *fields])


def append_tokens(
    target: redis.Redis | redis.client.Pipeline, tokens: Sequence[tuple[str, JobEvent]]
) -> Any:
    """Append each ``(key, event)`` token as :func:`append_token` does, a step's in one
    script call (a list of 1 and 0); on a pipeline, queued. To a Cluster, one call each
    (the keys of one call must share a slot)."""
    if not tokens:
        return []
    if is_cluster(target):
        return [append_token(target, key, event) for key, event in tokens]
    keys, args = [], []
    logprobs = any(event.logprob is not None for _, event in tokens)
    for key, event in tokens:
        assert event.kind == "token" and event.index is not None
        keys.append(key)
        args += [event.index, event.token, event.text or ""]
        if logprobs:
            args.append("" if event.logprob is None else _encoded(event.logprob))
    return _call(
        target, _APPEND_TOKENS_LOGPROBS_SHA if logprobs else _APPEND_TOKENS_SHA, keys, args
    )


def _call(
    target: redis.Redis | redis.client.Pipeline, sha: str, keys: list[str], args: list[Any]
) -> Any:
    if is_cluster(target):
        return target.execute_command("EVAL", _SCRIPTS[sha], len(keys), *keys, *args)
    if isinstance(target, redis.client.Pipeline):
        return target.execute_command("EVALSHA", sha, len(keys), *keys, *args)
    try:
        return target.execute_command("EVALSHA", sha, len(keys), *keys, *args)
    except NoScriptError:
        return target.execute_command("EVAL", _SCRIPTS[sha], len(keys), *keys, *args)


def run_appends(client: redis.Redis, pipe: redis.client.Pipeline) -> list[Any]:
    """Run a pipeline of ``client``'s holding :func:`append_token` or :func:`append_tokens`
    calls; those Redis did not know the script for (it restarted, failed over or was
    flushed) are sent again whole, in order. Raises the first error, as ``pipe.execute()``
    does."""
    if is_cluster(pipe):
        return list(pipe.execute())
    queued = [args for args, _options in pipe.command_stack]
    results = list(pipe.execute(raise_on_error=False))
    for i, result in enumerate(results):
        if isinstance(result, NoScriptError):
            _, sha, *rest = queued[i]
            results[i] = client.execute_command("EVAL", _SCRIPTS[sha], *rest)
    for result in results:
        if isinstance(result, Exception):
            raise result
    return results


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
