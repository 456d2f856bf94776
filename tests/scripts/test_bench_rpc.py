"""bench_rpc.py's delaying proxy forwards every byte both ways, in order, and passes a
close on (the benchmark's delays stand between ggml's client and the servers)."""

from __future__ import annotations

import socket
import threading


def test_the_delay_proxy_forwards_both_ways_in_order():
    from benchmarks.delay_proxy import DelayProxy

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)

    def echo() -> None:
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    threading.Thread(target=echo, daemon=True).start()
    proxy = DelayProxy(f"127.0.0.1:{server.getsockname()[1]}", 0.002)
    try:
        with socket.create_connection(proxy.endpoint.split(":"), timeout=10) as client:
            for size in (1, 1000, 300_000):
                payload = bytes(i * 7 % 251 for i in range(size))
                client.sendall(payload[:size])
                got = b""
                while len(got) < size:
                    got += client.recv(1 << 20)
                assert got == payload[:size]
            client.shutdown(socket.SHUT_WR)
            assert client.recv(10) == b""  # the server saw the close and closed in turn
    finally:
        proxy.close()
        server.close()
