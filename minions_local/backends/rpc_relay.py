"""A relay between ggml's RPC client and one remote server, so that a server that dies or
goes silent ends a reply with an error instead of the process.

ggml's client (ggml-rpc.cpp) aborts the whole process when a server's connection fails
(`RPC_STATUS_ASSERT` -> GGML_ABORT) and waits on its socket without a timeout. So the
client is given a local endpoint of ours instead of the server's: this relay forwards
each request and its answer, message by message, with a timeout on every wait for the
server. When the server closes the connection, errs, or stays silent for `timeout`
seconds, the relay marks itself `lost` (saying why) and from then on answers the client
itself, with answers of the size the client expects (zeros, or values that keep ggml's
asserts quiet: an alignment, a base address). The pass in flight then completes on
garbage, and the target (llama_remote.py) checks its relays after every llama_decode:
a lost one turns the pass into a RemoteLost error, and the model loaded over it is never
used again.

A relay lives as long as the process: ggml keeps its devices, buffer types and
connections keyed by endpoint string for good, so a local port must always mean the same
server (a reload over a server that came back revives its relay).

It also counts what crosses it (answered requests: round trips; bytes each way), which
the benchmark reports per token.
"""

from __future__ import annotations

import socket
import struct
import threading

from minions_local.backends.llama_rpc import CMD_HELLO, CONN_CAPS, HELLO_ANSWER, parse_endpoint, recv_exact

# Commands (enum rpc_cmd in ggml-rpc.cpp) that answer, and the size of their answer.
ALLOC_BUFFER, GET_ALIGNMENT, GET_MAX_SIZE, BUFFER_GET_BASE = 0, 1, 2, 3
SET_TENSOR_HASH, GET_TENSOR, COPY_TENSOR, GET_DEVICE_MEMORY, GET_ALLOC_SIZE, DEVICE_COUNT = 7, 8, 9, 11, 13, 15
ANSWER_SIZE = {ALLOC_BUFFER: 16, GET_ALIGNMENT: 8, GET_MAX_SIZE: 8, BUFFER_GET_BASE: 8, SET_TENSOR_HASH: 1,
               COPY_TENSOR: 1, GET_DEVICE_MEMORY: 16, GET_ALLOC_SIZE: 8, CMD_HELLO: HELLO_ANSWER, DEVICE_COUNT: 4}
"""GET_TENSOR answers the bytes it asked for (the last 8 bytes of its request)."""
STAND_IN = {
    ALLOC_BUFFER: bytes(16),  # remote_ptr 0: the allocation failed, so a load fails cleanly
    GET_ALIGNMENT: struct.pack("<Q", 32),  # ggml asserts a power of two
    GET_MAX_SIZE: struct.pack("<Q", 1 << 62),
    BUFFER_GET_BASE: struct.pack("<Q", 4096),  # any non-null base: the client only adds offsets to it
    SET_TENSOR_HASH: b"\x01",  # "already there": the client sends nothing more
    DEVICE_COUNT: struct.pack("<I", 0),  # no devices: ggml_backend_rpc_add_server returns NULL
}
"""What a lost relay answers where zeros would trip the client (other answers: zeros)."""
CHUNK = 16 << 20
"""Bytes sent per wait: the timeout bounds a stall, not a large tensor's whole transfer."""


class Relay:
    """A local endpoint (`address`) standing for the RPC server at `endpoint`."""

    def __init__(self, endpoint: str, protocol: tuple[int, int, int], *, timeout: float) -> None:
        self.endpoint = endpoint
        self.host, self.port = parse_endpoint(endpoint)
        self.protocol = protocol
        self.timeout = timeout
        self.lost: str | None = None
        """Why the server is unusable (None: it answers)."""
        self.round_trips = 0
        self.bytes_out = 0
        self.bytes_in = 0
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(8)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, name=f"rpc relay {endpoint}", daemon=True).start()

    def revive(self, timeout: float) -> None:
        """Use the server again (it answered a handshake); connections made from now on reach it."""
        self.timeout = timeout
        self.lost = None

    def lose(self, why: str) -> None:
        """Stop talking to the server (`why` names what happened) and cut what is open to it."""
        with self._lock:
            if self.lost is None:
                self.lost = why
            for sock in list(self._open):
                _shut(sock)

    def counters(self) -> tuple[int, int, int]:
        return self.round_trips, self.bytes_out, self.bytes_in

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), name=f"rpc relay {self.endpoint}",
                             daemon=True).start()

    def _connect(self) -> socket.socket | None:
        if self.lost is not None:
            return None
        try:
            upstream = socket.create_connection((self.host, self.port), timeout=self.timeout)
        except OSError as err:
            self.lose(f"cannot connect ({_reason(err)})")
            return None
        upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        upstream.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        with self._lock:
            self._open.add(upstream)
        return upstream

    def _serve(self, client: socket.socket) -> None:
        """One connection of ggml's client: each request forwarded, each answer returned
        (or stood in for), until the client closes it."""
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        upstream = self._connect()
        try:
            while True:
                try:
                    head = recv_exact(client, 9)
                    payload = recv_exact(client, struct.unpack_from("<Q", head, 1)[0])
                except (ConnectionError, OSError):
                    return  # the client closed it: its model or device is gone
                cmd = head[0]
                if cmd == CMD_HELLO:
                    payload = bytes(CONN_CAPS)  # plain TCP: an RDMA upgrade would bypass this relay
                size = struct.unpack_from("<Q", payload, len(payload) - 8)[0] if cmd == GET_TENSOR \
                    else ANSWER_SIZE.get(cmd)
                answer = None
                if upstream is not None and self.lost is None:
                    try:
                        answer = self._forward(upstream, head[:1] + struct.pack("<Q", len(payload)), payload, cmd,
                                               size)
                    except TimeoutError:
                        self.lose(f"no answer for {self.timeout:g} s")
                    except (ConnectionError, OSError) as err:
                        self.lose(f"the connection broke ({_reason(err)})")
                    except ValueError as err:
                        self.lose(str(err))
                if size is not None:
                    if answer is None:
                        answer = self._stand_in(cmd, size)
                    client.sendall(struct.pack("<Q", len(answer)) + answer)
        except OSError:
            return
        finally:
            with self._lock:
                self._open.discard(upstream)
            for sock in (client, upstream):
                if sock is not None:
                    sock.close()

    def _forward(self, upstream: socket.socket, head: bytes, payload: bytes, cmd: int, size: int | None) -> bytes | None:
        upstream.sendall(head)
        view = memoryview(payload)
        for start in range(0, len(view), CHUNK):
            upstream.sendall(view[start:start + CHUNK])
        self.bytes_out += len(head) + len(payload)
        if size is None:
            return None
        told = struct.unpack("<Q", recv_exact(upstream, 8))[0]
        if told != size:
            raise ValueError(f"a malformed answer ({told} bytes where {size} were due)")
        answer = recv_exact(upstream, size)
        self.round_trips += 1
        self.bytes_in += 8 + size
        if cmd == CMD_HELLO:
            version = tuple(answer[:3])
            if version[0] != self.protocol[0] or version[1] > self.protocol[1]:
                raise ValueError(f"it now speaks protocol {'.'.join(map(str, version))}")
            answer = answer[:4] + bytes(CONN_CAPS)
        return answer

    def _stand_in(self, cmd: int, size: int) -> bytes:
        """The answer a lost relay gives in the server's place (module docstring)."""
        if cmd == CMD_HELLO:
            return bytes(self.protocol) + bytes(1 + CONN_CAPS)
        return STAND_IN.get(cmd, bytes(size))


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _reason(err: OSError) -> str:
    return err.strerror or type(err).__name__


_relays: dict[str, Relay] = {}
_relays_lock = threading.Lock()


def relay_for(endpoint: str, protocol: tuple[int, int, int], timeout: float) -> Relay:
    """This process's relay to `endpoint` (made once; see the module on why it stays)."""
    with _relays_lock:
        relay = _relays.get(endpoint)
        if relay is None:
            relay = _relays[endpoint] = Relay(endpoint, protocol, timeout=timeout)
        else:
            relay.revive(timeout)
        return relay
