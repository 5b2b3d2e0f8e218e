"""Who was recorded, and how many times: the job ids workers announce on the done channel.

Workers publish an id there only when their conditional terminal UPDATE won,
over pub/sub, which may drop a message: a cross-check only.
``harness.accounting`` counts terminal writes from the database's transition
log and computations from the sim's witness (``harness.witness``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter

import redis

from harness import POLL_S


class DoneListener:
    """Counts the job ids workers publish on the done channel.

    Resubscribes when the connection drops (Redis killed and restarted), so a
    publication after the restart is still counted.
    """

    def __init__(self, channel: str) -> None:
        self.url = ""
        self.channel = channel
        self.counts: Counter[str] = Counter()
        self.subscriptions = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="done-listener", daemon=True)

    def start(self, url: str) -> None:
        self.url = url
        self._thread.start()
        self.wait_subscribed(0)

    def wait_subscribed(self, more_than: int, timeout: float = 20.0) -> None:
        until = time.monotonic() + timeout
        while self.subscriptions <= more_than:
            assert time.monotonic() < until, "the done-channel listener could not subscribe"
            time.sleep(POLL_S)

    def snapshot(self) -> Counter[str]:
        with self._lock:
            return Counter(self.counts)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            client = redis.Redis.from_url(
                self.url, decode_responses=True, socket_connect_timeout=1, socket_timeout=5
            )
            pubsub = client.pubsub()
            try:
                pubsub.subscribe(self.channel)
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=0.2)
                    if message is None:
                        continue
                    if message["type"] == "subscribe":
                        self.subscriptions += 1
                    elif message["type"] == "message":
                        ids = [i for i in str(message["data"]).split(",") if i]
                        with self._lock:
                            self.counts.update(ids)
            except (redis.RedisError, OSError):
                self._stop.wait(0.1)
            finally:
                with contextlib.suppress(Exception):
                    pubsub.close()
                client.close()
