"""ggml's RPC backend, reached through ggml's own backend registry: a target's layers on
other machines' `rpc-server`s (llama_remote.py), and the server itself
(`minions-rpc-server`, server/rpc_cli.py).

llama-cpp-python 0.3.36 binds none of it (no `rpc_servers` argument; it marks
`llama_model_params.devices` unused), so this is a small ctypes binding of its own:
`ggml_backend_reg_by_name("RPC")` and, through `ggml_backend_reg_get_proc_address`, the
two functions the RPC backend exports (ggml-rpc.h of the vendored llama.cpp):

    ggml_backend_reg_t ggml_backend_rpc_add_server(const char * endpoint);
    void ggml_backend_rpc_start_server(const char * endpoint, const char * cache_dir,
                                       size_t n_threads, size_t n_devices, ggml_backend_dev_t * devices);

ggml's client ends the process (GGML_ABORT) on any connection it cannot make or keep, and
waits on a socket without a timeout. So it is never pointed at a server directly: every
server is first asked here, with timeouts, whether it answers and speaks this protocol
(`handshake`), and then reached through a relay of our own (rpc_relay.py).

The protocol (ggml-rpc.cpp): a request is | command (1 byte) | size (8 bytes, little
endian) | payload |; commands that answer send | size (8 bytes) | payload |. HELLO (14) is
the first command of every connection; its answer carries the server's protocol version.
"""

from __future__ import annotations

import ctypes
import ipaddress
import socket
import statistics
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minions_local.core.errors import MinionsError, ModelLoadError

PROTOCOLS = {"0.3.36": (7, 0, 0)}
"""The RPC protocol (RPC_PROTO_*_VERSION in ggml-rpc.h) of each llama-cpp-python release
whose vendored llama.cpp this binding was checked against: commands, message layouts and
answers below are that version's."""
CMD_GET_DEVICE_MEMORY, CMD_HELLO, CMD_DEVICE_COUNT = 11, 14, 15
CONN_CAPS = 24
"""RPC_CONN_CAPS_SIZE: transport capabilities in HELLO (zero: plain TCP, no RDMA upgrade)."""
HELLO_ANSWER = 4 + CONN_CAPS
DEFAULT_PORT = 50052
DEFAULT_TIMEOUT = 120.0
"""Seconds a server may stay silent while it owes an answer. The longest honest silence is a
server computing its layers of a 512-row pass (tens of seconds for half a 70B on a few
cores); a dead process is seen at once (the connection closes), a dead machine after this."""
GGML_BACKEND_DEVICE_TYPE_CPU, GGML_BACKEND_DEVICE_TYPE_GPU = 0, 1


class RemoteError(MinionsError):
    """An RPC server cannot be used: down, silent, foreign, or lost mid-reply."""


class RemoteLost(RemoteError):
    """A server holding some of the target's layers stopped answering: the model loaded over
    it is unusable (its buffers there are gone) and is reloaded over the servers left."""


@dataclass(frozen=True)
class ServerInfo:
    """What the handshake learned of one server."""

    endpoint: str
    version: tuple[int, int, int]
    devices: int
    rtt: float
    """Median seconds of a request answered at once (DEVICE_COUNT), connection made."""
    free_memory: int = 0
    """Bytes its devices report free (a CPU device: its machine's RAM)."""


def protocol() -> tuple[int, int, int]:
    """This client's RPC protocol version; a llama-cpp-python this binding does not know is refused."""
    from minions_local.backends.llama_context import import_llama_cpp

    llama_cpp = import_llama_cpp()  # (its kernel switches are set before llama.cpp loads)
    version = PROTOCOLS.get(llama_cpp.__version__)
    if version is None:
        raise RemoteError(f"llama-cpp-python {llama_cpp.__version__} is not a version whose RPC protocol "
                          f"minions-local was checked against ({', '.join(PROTOCOLS)}): install that one "
                          f"(bash scripts/build_llama_cpp_wheel.sh) to split a model over machines.")
    return version


def version_text(version: tuple[int, int, int]) -> str:
    return ".".join(map(str, version))


def parse_endpoint(text: str) -> tuple[str, int]:
    """'host:port' (the port defaults to 50052) as ggml's client reads it: IPv6 addresses
    are refused, since ggml splits an endpoint at its first ':'."""
    host, _, port = text.strip().partition(":")
    if not host or ":" in port:
        raise RemoteError(f"An RPC server is written host:port (e.g. 192.168.1.20:{DEFAULT_PORT}); got {text!r}. "
                          f"IPv6 addresses cannot be used: ggml's client splits an endpoint at its first ':'.")
    try:
        number = int(port) if port else DEFAULT_PORT
    except ValueError:
        raise RemoteError(f"The port of the RPC server {text!r} is not a number.") from None
    if not 0 < number < 65536:
        raise RemoteError(f"The port of the RPC server {text!r} must lie in 1..65535.")
    return host, number


def endpoint_text(text: str) -> str:
    host, port = parse_endpoint(text)
    return f"{host}:{port}"


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def handshake(endpoint: str, timeout: float = 10.0, *, probes: int = 5) -> ServerInfo:
    """Connect, say HELLO and time a few requests, all within `timeout` per wait; a
    RemoteError names the server and what to do when it is down, silent or foreign."""
    host, port = parse_endpoint(endpoint)
    ours = protocol()
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except ConnectionRefusedError:
        raise RemoteError(f"Nothing listens at {endpoint} (connection refused): start the server there "
                          f"(minions-rpc-server --port {port}, on that machine), or leave it out of --rpc.") from None
    except TimeoutError:
        raise RemoteError(f"The RPC server {endpoint} did not accept a connection within {timeout:.0f} s: is the "
                          f"machine up and the port open?") from None
    except OSError as err:
        raise RemoteError(f"Cannot reach the RPC server {endpoint}: {err.strerror or err}.") from None
    with sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.sendall(bytes([CMD_HELLO]) + struct.pack("<Q", CONN_CAPS) + bytes(CONN_CAPS))
            size = struct.unpack("<Q", recv_exact(sock, 8))[0]
            if size != HELLO_ANSWER:
                raise RemoteError(_foreign(endpoint, ours, f"a HELLO answer of {size} bytes"))
            answer = recv_exact(sock, size)
            version = (answer[0], answer[1], answer[2])
            if version[0] != ours[0] or version[1] > ours[1]:
                raise RemoteError(_foreign(endpoint, ours, f"protocol {version_text(version)}"))
            times, devices = [], 0
            for _ in range(probes):
                start = time.perf_counter()
                sock.sendall(bytes([CMD_DEVICE_COUNT]) + struct.pack("<Q", 0))
                if struct.unpack("<Q", recv_exact(sock, 8))[0] != 4:
                    raise RemoteError(_foreign(endpoint, ours, "a DEVICE_COUNT answer of another size"))
                devices = struct.unpack("<I", recv_exact(sock, 4))[0]
                times.append(time.perf_counter() - start)
            free = 0
            for device in range(devices):
                sock.sendall(bytes([CMD_GET_DEVICE_MEMORY]) + struct.pack("<QI", 4, device))
                if struct.unpack("<Q", recv_exact(sock, 8))[0] != 16:
                    raise RemoteError(_foreign(endpoint, ours, "a GET_DEVICE_MEMORY answer of another size"))
                free += struct.unpack("<QQ", recv_exact(sock, 16))[0]
        except TimeoutError:
            raise RemoteError(f"The RPC server {endpoint} accepted the connection but did not answer within "
                              f"{timeout:.0f} s. An rpc-server serves one client at a time: is another program "
                              f"using it?") from None
        except ConnectionError:
            raise RemoteError(_foreign(endpoint, ours, "a closed connection at the handshake")) from None
    if devices == 0:
        raise RemoteError(f"The RPC server {endpoint} offers no device to compute on.")
    return ServerInfo(endpoint, version, devices, statistics.median(times), free)


def _foreign(endpoint: str, ours: tuple[int, int, int], what: str) -> str:
    import llama_cpp

    return (f"The RPC server {endpoint} speaks another version of the protocol ({what}; this client speaks "
            f"{version_text(ours)}, llama-cpp-python {llama_cpp.__version__}). Run the same version on both "
            f"machines: minions-rpc-server from this install, or rpc-server built from llama-cpp-python "
            f"{llama_cpp.__version__}'s llama.cpp (scripts/build_llama_cpp_tools.sh).")


def recv_exact(sock: socket.socket, size: int) -> bytes:
    """`size` bytes, or ConnectionError when the peer closes first."""
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the connection closed")
        got += n
    return bytes(buf)


# --- ggml's registry -------------------------------------------------------------------


class _Ggml:
    """The registry functions of libggml / libggml-base (loaded by llama_cpp already)."""

    def __init__(self) -> None:
        from minions_local.backends.llama_context import import_llama_cpp

        lib = Path(import_llama_cpp().__file__).parent / "lib"
        ggml, base = ctypes.CDLL(str(lib / "libggml.so")), ctypes.CDLL(str(lib / "libggml-base.so"))
        p, size = ctypes.c_void_p, ctypes.c_size_t
        self.reg_by_name = _fn(ggml, "ggml_backend_reg_by_name", p, [ctypes.c_char_p])
        self.dev_by_type = _fn(ggml, "ggml_backend_dev_by_type", p, [ctypes.c_int])
        self.dev_count = _fn(ggml, "ggml_backend_dev_count", size, [])
        self.dev_get = _fn(ggml, "ggml_backend_dev_get", p, [size])
        self.proc_address = _fn(base, "ggml_backend_reg_get_proc_address", p, [p, ctypes.c_char_p])
        self.reg_dev_count = _fn(base, "ggml_backend_reg_dev_count", size, [p])
        self.reg_dev_get = _fn(base, "ggml_backend_reg_dev_get", p, [p, size])
        self.dev_name = _fn(base, "ggml_backend_dev_name", ctypes.c_char_p, [p])
        self.dev_type = _fn(base, "ggml_backend_dev_type", ctypes.c_int, [p])
        self.dev_memory = _fn(base, "ggml_backend_dev_memory", None, [p, ctypes.POINTER(size), ctypes.POINTER(size)])
        self.dev_buffer_type = _fn(base, "ggml_backend_dev_buffer_type", p, [p])
        reg = self.reg_by_name(b"RPC")
        if not reg:
            raise ModelLoadError("This llama-cpp-python was built without ggml's RPC backend, which splitting a "
                                 "model over machines needs: rebuild it with bash scripts/build_llama_cpp_wheel.sh "
                                 "(PYTHON=.venv/bin/python), which now builds it in.")
        add = self.proc_address(reg, b"ggml_backend_rpc_add_server")
        start = self.proc_address(reg, b"ggml_backend_rpc_start_server")
        self.add_server = ctypes.CFUNCTYPE(p, ctypes.c_char_p)(add)
        self.start_server = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, size, size,
                                             ctypes.POINTER(p))(start)

    def cpu_buffer_type(self) -> int:
        """This machine's CPU buffer type (llama.cpp compares it by address to
        ggml_backend_cpu_buffer_type(): a tensor overridden to it is placed as the CPU's
        weights are, with repacking as the model's use_extra_bufts says)."""
        return self.dev_buffer_type(self.dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU))


def _fn(lib: Any, name: str, restype: Any, argtypes: list[Any]) -> Any:
    fn = getattr(lib, name)
    fn.restype, fn.argtypes = restype, argtypes
    return fn


_ggml: _Ggml | None = None


def ggml() -> _Ggml:
    global _ggml
    if _ggml is None:
        _ggml = _Ggml()
    return _ggml


def server_devices(endpoint: str) -> list[int]:
    """The devices a server offers, registered with ggml (`endpoint` must answer: a relay's)."""
    g = ggml()
    reg = g.add_server(endpoint.encode())
    if not reg:
        raise RemoteError(f"The RPC server behind {endpoint} offers no device.")
    return [g.reg_dev_get(reg, i) for i in range(g.reg_dev_count(reg))]


def device_memory(device: int) -> tuple[int, int]:
    """(free, total) bytes a device reports; a CPU device reports its machine's RAM as both."""
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    ggml().dev_memory(device, ctypes.byref(free), ctypes.byref(total))
    return free.value, total.value


def local_compute_devices() -> list[int]:
    """What this machine's server computes on, as rpc-server picks: its GPUs, else the CPU."""
    g = ggml()
    devices = [g.dev_get(i) for i in range(g.dev_count())]
    gpus = [d for d in devices if g.dev_type(d) == GGML_BACKEND_DEVICE_TYPE_GPU
            and not g.dev_name(d).decode().startswith("RPC")]
    return gpus or [g.dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU)]


def device_names(devices: list[int]) -> list[str]:
    return [ggml().dev_name(d).decode() for d in devices]


def start_server(endpoint: str, cache_dir: str | None, threads: int, devices: list[int]) -> None:
    """ggml's server loop on `endpoint` (returns only if it cannot listen)."""
    array = (ctypes.c_void_p * len(devices))(*devices)
    ggml().start_server(endpoint.encode(), cache_dir.encode() if cache_dir else None, threads, len(devices), array)
