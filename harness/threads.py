"""Work on a thread of this process for the length of a block."""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import ThreadingHTTPServer
from typing import Self


class OnAThread:
    """``run(stop)`` on a daemon thread for a ``with`` block; ``stop`` is set once the block
    ends, and the thread given ``join_s`` to end."""

    def __init__(self, run: Callable[[threading.Event], object], join_s: float = 30.0) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=run, args=(self.stop,), daemon=True)
        self.join_s = join_s

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=self.join_s)


class ServingThread(OnAThread):
    """``server`` answering on a daemon thread for a ``with`` block; shut down, its
    socket closed, once the block ends."""

    def __init__(self, server: ThreadingHTTPServer) -> None:
        self.server = server
        super().__init__(lambda _stop: server.serve_forever())

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        super().__exit__(*exc)
