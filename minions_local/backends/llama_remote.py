"""A llama.cpp target whose layers are split over this machine and RPC servers: the same
target (llama_target.py: trees as one llama_decode, the exact settings, the cell rule),
loaded with ggml's RPC devices in `llama_model_params.devices` and a `tensor_split`
that puts contiguous runs of layers on each (profile/split.py).

Exactness holds as on one machine: every server computes its layers with ggml's CPU
kernels under the same switches (server/rpc_cli.py), and the load check
(llama_load.rows_differ) runs through the split; a pass just sends each run's boundary
activations over the network (a few round trips per server and pass, which a tree pays
once for all its tokens).

Faults. Every server is reached through a relay with timeouts (rpc_relay.py), so a
server that dies or goes silent never ends or hangs the process. After every
llama_decode the relays are checked: a lost one turns the pass into `RemoteLost` (the
reply in flight ends with it; the engine keeps the conversation, and the batch drops
the requests of that pass). The model loaded over the lost server is then never used
again: the next use of the target (the next request) frees it and loads the file again
over the servers that still answer a handshake, and says how long that took
(`notices`), or raises a RemoteError saying why it cannot.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from minions_local.backends.llama_rpc import (DEFAULT_TIMEOUT, GGML_BACKEND_DEVICE_TYPE_CPU, RemoteError, RemoteLost,
                                              device_memory, endpoint_text, ggml, handshake, protocol, server_devices)
from minions_local.backends.llama_target import LlamaTarget
from minions_local.backends.rpc_relay import Relay, relay_for
from minions_local.core.errors import ModelLoadError
from minions_local.profile.split import HERE, Placement, place_layers

log = logging.getLogger(__name__)
HANDSHAKE_TIMEOUT = 10.0
"""Seconds a server may take to accept and answer the handshake (it answers at once)."""


HEAD_TENSORS = rb"^(output|token_embd)\.weight$"
"""The tensors the output head multiplies by (llama.cpp's names), kept on this machine."""


class _BuftOverride(ctypes.Structure):
    """llama.h's llama_model_tensor_buft_override: tensors whose name matches `pattern`
    go to buffer type `buft`; an array of them ends with a null pattern."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


class RemoteLlamaTarget(LlamaTarget):
    """LlamaTarget over this machine and RPC `servers` ("host:port").

    Keyword arguments (the rest are LlamaTarget's):
        shares: this machine's share of the layers, then each server's (any scale); None:
            in proportion to the memory each reports (what llama.cpp's default split does;
            a CPU reports its RAM).
        timeout: seconds a server may stay silent while it owes an answer (rpc_relay.py).
        check_rows: the load check run over each new split (llama_load: cached per split),
            '' when its rows are exact.
    """

    new_shapes_cost_more = True
    """A pass of a row count not seen before asks each server allocation sizes (ggml's RPC
    client caches them): the cost model's calibration times each size's second pass."""

    def __init__(self, path: str | os.PathLike[str], *, servers: Sequence[str], shares: Sequence[float] | None = None,
                 timeout: float = DEFAULT_TIMEOUT, check_rows: Callable[[LlamaTarget], str] | None = None,
                 **options: Any) -> None:
        self.servers = [endpoint_text(s) for s in servers]
        if not self.servers:
            raise ValueError("a split target needs at least one RPC server")
        if shares is not None and len(shares) != len(self.servers) + 1:
            raise ModelLoadError(f"The split names {len(shares)} shares for {len(self.servers)} RPC servers: give "
                                 f"one for this machine, then one per server ({len(self.servers) + 1}).")
        self.shares = dict(zip([HERE, *self.servers], shares)) if shares is not None else None
        self.timeout = timeout
        self._check_rows = check_rows
        self._options = options
        self.lost: RemoteLost | None = None
        """Why the loaded model may not be used again (a server holding its layers was lost)."""
        self.notices: list[str] = []
        """What the user should be told outside a reply: each reload and how long it took."""
        self.relays: list[Relay] = []
        self.placement: Placement | None = None
        self.rtt: dict[str, float] = {}
        """Each server's handshake round trip (seconds)."""
        self._vocab_model = None
        self._load(Path(path).expanduser(), self.servers)

    def _load(self, path: Path, servers: list[str]) -> None:
        """Connect to `servers` (a RemoteError names one that does not answer), place the
        layers and load the file over them."""
        infos = [handshake(s, HANDSHAKE_TIMEOUT) for s in servers]
        self.rtt = {i.endpoint: i.rtt for i in infos}
        self.relays = [relay_for(s, protocol(), self.timeout) for s in servers]
        devices = [server_devices(r.address) for r in self.relays]
        self.placement = self._place(path, servers, devices)
        used = self.placement.used_servers
        self._devices = [d for i in used for d in devices[i - 1]]
        self._device_split = _per_device(self.placement, [devices[i - 1] for i in used])
        try:
            LlamaTarget.__init__(self, path, **self._options)
        except ModelLoadError:
            self._check("loading")
            raise
        self._check("loading")
        self.calls.after_call = self._after_call
        if self._check_rows is not None:
            verdict = self._check_rows(self)
            if verdict:
                self.close()
                raise ModelLoadError(
                    f"Split over {', '.join(servers)}, llama.cpp does not give {path.name}'s tree rows the bits of "
                    f"1-token passes ({verdict}), so trees would change its replies. Start every server with "
                    f"minions-rpc-server from this install (it sets ggml's GGML_CPU_TILED_MM switches; an "
                    f"rpc-server binary needs GGML_CPU_TILED_MM=1 GGML_CPU_TILED_MM_FORCE=1 in its environment).")

    def _place(self, path: Path, servers: list[str], devices: list[list[int]]) -> Placement:
        if self.shares is not None:
            shares = [self.shares[HERE]] + [self.shares[s] for s in servers]
        else:
            here = device_memory(ggml().dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU))[0]
            shares = [float(here)] + [float(sum(device_memory(d)[0] for d in devs) or here) for devs in devices]
        return plan_split(path, servers, shares)

    def _model_params(self, n_gpu_layers: int) -> Any:
        mparams = super()._model_params(n_gpu_layers)
        self._device_array = (ctypes.c_void_p * (len(self._devices) + 1))(*self._devices, None)
        slots = int(self.lib.llama_max_devices())
        if len(self._device_split) > slots:
            raise RemoteError(f"llama.cpp splits a model over at most {slots} devices; these servers offer "
                              f"{len(self._device_split)}.")
        self._split_array = (ctypes.c_float * slots)(*self._device_split)
        mparams.devices = ctypes.cast(self._device_array, ctypes.c_void_p).value
        mparams.tensor_split = self._split_array
        mparams.n_gpu_layers = self.placement.n_gpu_layers
        # The head on this machine (profile/split.py says why): the output weight, or the
        # token embeddings where they double as it (llama.cpp then loads a second copy of
        # them for the output layer, under the same name, which this pattern keeps here).
        self._head_here = (_BuftOverride * 2)(_BuftOverride(HEAD_TENSORS, ggml().cpu_buffer_type()),
                                              _BuftOverride(None, None))
        mparams.tensor_buft_overrides = ctypes.cast(self._head_here, ctypes.c_void_p).value
        return mparams

    # --- faults ------------------------------------------------------------------------

    def _check(self, doing: str) -> None:
        """RemoteLost when a server was lost during a pass (the model is then never used
        again); while loading, a RemoteError naming the server."""
        gone = [r for r in self.relays if r.lost is not None]
        if not gone:
            return
        left = [r.endpoint for r in self.relays if r.lost is None]
        names = ", ".join(f"{r.endpoint} ({r.lost})" for r in gone)
        if doing == "loading":
            self.close()
            raise RemoteError(f"The RPC server {names} was lost while the model loaded over it: start it again, or "
                              f"leave it out of --rpc.")
        self.lost = RemoteLost(
            f"The RPC server {names} was lost during a pass: this reply ends here. The conversation is kept; the "
            f"next request reloads the model over this machine{' and ' + ', '.join(left) if left else ''}, or says "
            f"why it cannot.")
        raise self.lost

    def _after_call(self) -> None:
        """After each llama_decode (RowCalls.after_call): a pass that ran while a server was
        lost computed on its relay's stand-in answers, so it ends in RemoteLost. llama_decode
        returns with the servers' answers still queued (ggml's RPC client is asynchronous;
        the logits are fetched when first read): wait for them first, or a loss during this
        pass would be seen only after its stand-in logits were used."""
        self.lib.llama_synchronize(self.ctx)
        self._check("a pass")

    def _settle(self) -> None:
        if self.lost is not None:
            self.recover()
        super()._settle()

    def recover(self) -> str | None:
        """After a loss: free the model and load it again over the servers that answer; the
        notice says over which and how long it took (None when nothing was lost). A
        RemoteError says why it cannot; the target stays unusable until a call succeeds."""
        if self.lost is None:
            return None
        start = time.perf_counter()
        gone = [r.endpoint for r in self.relays if r.lost is not None]
        self.close()
        for state in [*self.parked_states(), self.__dict__]:  # every slot's cells were in the freed context
            state.update(self.fresh_slot_state())
        self._pending = {}
        reachable, why = [], []
        for server in self.servers:
            try:
                handshake(server, HANDSHAKE_TIMEOUT)
                reachable.append(server)
            except RemoteError as err:
                why.append(str(err))
        if not reachable:
            raise RemoteError(f"Cannot reload {self.path.name}: no RPC server answers. {' '.join(why)} Start them "
                              f"again, then send the request again.")
        lost, self.lost = self.lost, None  # (the load check's passes must not recover again)
        try:
            self._load(self.path, reachable)
        except BaseException:
            self.lost = lost  # still unusable: the next request tries again
            raise
        seconds = time.perf_counter() - start
        missing = [s for s in self.servers if s not in reachable]
        notice = (f"Reloaded {self.path.name} over this machine and {', '.join(reachable)} in {seconds:.1f} s, after "
                  f"losing {', '.join(gone)}{' (still unreachable: ' + ', '.join(missing) + ')' if missing else ''}: "
                  f"{self.placement.describe()}.")
        self.notices.append(notice)
        log.warning(notice)
        return notice

    def release_slot_state(self, state: dict) -> None:
        if self.ctx:  # (after a failed reload there is no context to free cells in)
            super().release_slot_state(state)

    def reset(self) -> None:
        if self.lost is not None:  # nothing to free in a context that is gone; the next use reloads
            self.cached = []
            return
        super().reset()

    def vocabulary_model(self) -> Any:
        """The file's vocabulary alone (llama.cpp's `vocab_only`: no weights, nothing on a
        server), for the tokenizer: a reload frees the target's own model, so a tokenizer on
        it would read freed memory. Loaded once; it lives as long as the process."""
        if self._vocab_model is None:
            params = self.lib.llama_model_default_params()
            params.vocab_only = True
            self._vocab_model = self.lib.llama_model_load_from_file(str(self.path).encode(), params)
            if not self._vocab_model:
                raise ModelLoadError(f"llama.cpp could not read the vocabulary of {self.path}.")
        return self._vocab_model

    def network_counters(self) -> tuple[int, int, int]:
        """Round trips, bytes sent and received over every server since the process began."""
        counts = [r.counters() for r in self.relays]
        return tuple(sum(c[i] for c in counts) for i in range(3))  # type: ignore[return-value]

    def describe_split(self) -> str:
        return self.placement.describe() if self.placement is not None else ""


def plan_split(path: Path, servers: list[str], shares: list[float]) -> Placement:
    """Where the layers of the GGUF at `path` go over this machine and `servers` for these
    shares (this machine's first); read from the file's header alone (`--plan` uses it)."""
    from minions_local.models.gguf_file import read_model

    model = read_model(path)
    tensors = model.tensors
    layers = int(model.arch_value("block_count"))
    sizes = [0] * layers
    for name, t in tensors.items():
        if name.startswith("blk.") and int(name.split(".")[1]) < layers:
            sizes[int(name.split(".")[1])] += t.nbytes or 0
    embed = tensors["token_embd.weight"].nbytes or 0
    head = (tensors["output.weight"].nbytes if "output.weight" in tensors else embed) or 0
    head += sum(t.nbytes or 0 for n, t in tensors.items() if n.startswith("output_norm"))
    try:
        return place_layers(sizes, head, servers, shares, input_bytes=embed)
    except ValueError as err:
        raise RemoteError(f"Cannot split {path.name} over this machine and {', '.join(servers)}: {err}.") from None


def _per_device(placement: Placement, devices: list[list[int]]) -> list[float]:
    """tensor_split per device: each used server's layers (the last one's plus the head)
    over its devices in proportion to their memory (one device: all of them)."""
    split = []
    for share, devs in zip(placement.tensor_split(), devices):
        memory = [float(device_memory(d)[0]) or 1.0 for d in devs]
        split += [share * m / sum(memory) for m in memory]
    return split
