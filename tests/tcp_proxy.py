"""A TCP forwarder a test can cut and restore: one process's link to a server (e.g. etcd) goes
down while the server stays up for everyone else (a network partition)."""

from __future__ import annotations

import socket
import threading


class TcpProxy:
    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._listener = self._listen(0)
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"127.0.0.1:{self.port}"
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._accepting = threading.Thread(target=self._accept, args=(self._listener,), daemon=True)
        self._accepting.start()

    def cut(self) -> None:
        """Close every forwarded connection and refuse new ones."""
        _close(self._listener)  # shutdown() wakes the thread blocked in accept()
        with self._lock:
            for conn in self._conns:
                _close(conn)
            self._conns.clear()

    def restore(self) -> None:
        self._listener = self._listen(self.port)
        threading.Thread(target=self._accept, args=(self._listener,), daemon=True).start()

    close = cut

    @staticmethod
    def _listen(port: int) -> socket.socket:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen(64)
        return s

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # cut
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                _close(client)
                continue
            with self._lock:
                self._conns += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(src, dst), daemon=True).start()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    _close(src)
    _close(dst)


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()
