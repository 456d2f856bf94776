"""A TCP proxy on loopback that delays every byte by a fixed time each way: a network
with that latency between the benchmark's client and an RPC server on the same box,
where `tc netem` on `lo` would delay every other program's loopback traffic too.

Each direction of a connection is a reader that stamps what it reads and a writer that
sends it once the stamp is `delay` old, in order: a round trip costs 2 * delay more,
whatever the bandwidth (the proxy adds no rate limit).
"""

from __future__ import annotations

import queue
import socket
import threading
import time


class DelayProxy:
    """127.0.0.1:`port` forwarding to `upstream` ("host:port") with `delay` seconds each way."""

    def __init__(self, upstream: str, delay: float) -> None:
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.delay = delay
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(8)
        self.endpoint = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
                server = socket.create_connection(self.upstream)
            except OSError:
                return
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._open.append(sock)
            self._pipe(client, server)
            self._pipe(server, client)

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        pending: queue.Queue = queue.Queue()

        def read() -> None:
            while True:
                try:
                    data = src.recv(1 << 20)
                except OSError:
                    data = b""
                pending.put((time.monotonic() + self.delay, data))
                if not data:
                    return

        def write() -> None:
            while True:
                due, data = pending.get()
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                try:
                    if not data:
                        dst.shutdown(socket.SHUT_WR)
                        return
                    dst.sendall(data)
                except OSError:
                    return

        threading.Thread(target=read, daemon=True).start()
        threading.Thread(target=write, daemon=True).start()

    def close(self) -> None:
        self._listener.close()
        for sock in self._open:
            try:
                sock.close()
            except OSError:
                pass
