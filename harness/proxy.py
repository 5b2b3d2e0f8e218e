"""A TCP proxy in front of a service (PostgreSQL), so that it can be made unreachable."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from harness import POLL_S


class TcpProxy:
    """Forwards ``host``:port (127.0.0.1 unless named) to a target; ``cut()`` refuses and
    severs, ``restore()`` heals."""

    def __init__(self, target_host: str, target_port: int, host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.host = host
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._closed = threading.Event()
        self._listener: socket.socket | None = self._listen(0)
        self.port = int(self._listener.getsockname()[1])
        self.connections = 0
        self.severed = 0
        self._thread = threading.Thread(target=self._accept_loop, name="db-proxy", daemon=True)
        self._thread.start()

    def _listen(self, port: int) -> socket.socket:
        listener = socket.create_server((self.host, port), reuse_port=False)
        listener.settimeout(0.1)
        return listener

    def cut(self) -> None:
        """Refuse new connections (the port is closed) and sever every open one."""
        with self._lock:
            if self._listener is not None:
                self._listener.close()
                self._listener = None
            severed = list(self._sockets)
            self._sockets.clear()
        for sock in severed:
            self.severed += 1
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def restore(self) -> None:
        with self._lock:
            if self._listener is None:
                self._listener = self._listen(self.port)

    def close(self) -> None:
        self._closed.set()
        self.cut()
        self._thread.join(timeout=5)

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            listener = self._listener
            if listener is None:
                time.sleep(POLL_S)
                continue
            try:
                client, _ = listener.accept()
            except (TimeoutError, OSError):
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is None:  # cut while connecting
                    client.close()
                    upstream.close()
                    continue
                self._sockets.update((client, upstream))
                self.connections += 1
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._sockets.discard(src)
                self._sockets.discard(dst)
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
