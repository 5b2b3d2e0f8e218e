"""Work on a thread of this process for the length of a block."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def on_a_thread(run: Callable[[threading.Event], object]) -> Iterator[None]:
    """``run(stop)`` on a daemon thread for the block; ``stop`` is set once the block ends,
    and the thread given 30 s to end."""
    stop = threading.Event()
    thread = threading.Thread(target=run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=30)
