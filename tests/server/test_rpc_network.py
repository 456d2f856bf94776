"""The RPC client's network side without a model: the handshake names a server that is
down, silent or of another version; a relay stands in for a server that goes silent
mid-request, within its timeout; minions-rpc-server keeps to loopback unless told."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from minions_local.backends import llama_rpc
from minions_local.backends.llama_rpc import CMD_HELLO, CONN_CAPS, RemoteError, handshake

pytest.importorskip("llama_cpp")


class FakeServer:
    """A listener on loopback that answers HELLO with `version` and then stays silent."""

    def __init__(self, version: tuple[int, int, int] | None) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.endpoint = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.version = version
        self.held: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)
            if self.version is None:
                continue  # accepts, never answers
            head = llama_rpc.recv_exact(conn, 9)
            llama_rpc.recv_exact(conn, struct.unpack_from("<Q", head, 1)[0])
            if head[0] == CMD_HELLO:
                answer = bytes(self.version) + bytes(1 + CONN_CAPS)
                conn.sendall(struct.pack("<Q", len(answer)) + answer)

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


def test_a_server_that_is_down_silent_or_foreign_is_named():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{sock.getsockname()[1]}"
    with pytest.raises(RemoteError, match=f"Nothing listens at {closed}.*minions-rpc-server"):
        handshake(closed, 1.0)
    silent, foreign = FakeServer(None), FakeServer((6, 1, 0))
    try:
        start = time.monotonic()
        with pytest.raises(RemoteError, match=f"{silent.endpoint} accepted the connection but did not answer"):
            handshake(silent.endpoint, 0.5)
        assert time.monotonic() - start < 5
        with pytest.raises(RemoteError, match=f"{foreign.endpoint} speaks another version.*protocol 6.1.0"):
            handshake(foreign.endpoint, 1.0)
    finally:
        silent.close()
        foreign.close()
    with pytest.raises(RemoteError, match="IPv6"):
        handshake("::1:50052", 1.0)


def test_a_relay_stands_in_for_a_server_gone_silent():
    """ggml's client would wait forever (or abort the process): the relay answers in the
    server's place after its timeout, and says the server is lost."""
    from minions_local.backends.rpc_relay import GET_ALIGNMENT, Relay

    server = FakeServer((7, 0, 0))
    relay = Relay(server.endpoint, (7, 0, 0), timeout=0.5)
    try:
        with socket.create_connection(relay.address.split(":"), timeout=10) as client:
            client.sendall(bytes([CMD_HELLO]) + struct.pack("<Q", CONN_CAPS) + bytes(CONN_CAPS))
            size = struct.unpack("<Q", llama_rpc.recv_exact(client, 8))[0]
            assert llama_rpc.recv_exact(client, size)[:3] == bytes((7, 0, 0)) and relay.lost is None
            start = time.monotonic()
            client.sendall(bytes([GET_ALIGNMENT]) + struct.pack("<Q", 4) + bytes(4))  # the fake never answers
            size = struct.unpack("<Q", llama_rpc.recv_exact(client, 8))[0]
            assert struct.unpack("<Q", llama_rpc.recv_exact(client, size))[0] == 32  # a power of two, as ggml asserts
            assert 0.4 < time.monotonic() - start < 5
        assert relay.lost == "no answer for 0.5 s"
    finally:
        relay.lose("test over")
        server.close()


@pytest.mark.parametrize("host", ["0.0.0.0", ""])
def test_the_server_refuses_every_interface_without_allow_network(host, capsys):
    from minions_local.server import rpc_cli

    assert rpc_cli.main(["--host", host, "--port", "50999"]) == 2
    err = capsys.readouterr().err
    assert "without --allow-network" in err and "no authentication" in err
    assert rpc_cli.main(["--host", "::1"]) == 2
    assert "IPv6" in capsys.readouterr().err
    args = rpc_cli.build_parser().parse_args([])
    assert args.host == "127.0.0.1" and not args.allow_network and not args.no_cache  # loopback, tensor cache on


def test_the_server_says_its_versions(capsys):
    from minions_local.server import rpc_cli

    assert rpc_cli.main(["--version"]) == 0
    assert "RPC protocol 7.0.0" in capsys.readouterr().out


def test_the_server_drops_a_client_that_vanishes_without_closing():
    """ggml's server serves one client at a time with no timeout, so a client whose machine
    vanished would hold it for good: every connection it accepts must carry TCP keepalive
    (inherited from the listening socket rpc_cli arms). /proc/net/tcp shows the timer the
    kernel runs on the server's side of a fresh, idle connection: 2 is keepalive."""
    from tests.helpers.rpc_servers import start_servers

    (server,) = start_servers(1)
    try:
        port = int(server.endpoint.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as client:
            mine = client.getsockname()[1]
            time.sleep(0.2)
            rows = [line.split() for line in open("/proc/net/tcp").read().splitlines()[1:]]
            ours = [r for r in rows if int(r[1].split(":")[1], 16) == port and int(r[2].split(":")[1], 16) == mine]
            assert ours, "the server's side of the connection is not in /proc/net/tcp"
            timer, when = ours[0][5].split(":")
            assert timer == "02", f"no keepalive timer on the accepted connection (timer {timer})"
            assert int(when, 16) > 0  # jiffies until the first probe
    finally:
        server.kill()
