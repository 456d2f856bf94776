"""Where a target's layers go when they are split over this machine and RPC servers
(`[target] rpc`): contiguous runs of layers, this machine's first, then each server's in
the order given; the output head stays on this machine.

That is the only layout llama.cpp's layer split makes (llama_model_base::load_tensors):
the first `n_layer + 1 - n_gpu_layers` layers on the CPU, the rest (the head counted as
one more) over the devices by the cumulative fractions of `tensor_split`. The run sizes
here are chosen first, by largest remainder of the shares, and `tensor_split` is written
so that llama.cpp lands on exactly them: each server's layer count, the last one's plus
one for the head (a layer goes to the first device whose cumulative fraction exceeds
its own index over the offloaded count).

The head is then moved back to this machine by a tensor override (llama_remote.py): left
with the last server, every pass would send back a row of logits per tree node (40 rows
of a 128k vocabulary are 20 MB, 0.16 s on gigabit Ethernet), where the hidden states the
head reads are 1/30 of that. The final norm stays with the last server (a few KB).

Pure arithmetic on the model's layer sizes: `--plan` uses it with no model loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

HERE = "this machine"


@dataclass(frozen=True)
class Placement:
    """The layers each place holds: `places[0]` is this machine, then the servers."""

    places: tuple[str, ...]
    layers: tuple[int, ...]
    """Decoder layers per place, in order (contiguous runs)."""
    layer_bytes: tuple[int, ...]
    """Bytes of those layers per place."""
    head_bytes: int
    """The output head and final norm: this machine holds them (the module says why)."""
    input_bytes: int = 0
    """The token embeddings: llama.cpp keeps the input layer on this machine."""

    @property
    def n_layers(self) -> int:
        return sum(self.layers)

    @property
    def used_servers(self) -> list[int]:
        """Indices (into places) of the servers that hold layers."""
        return [i for i in range(1, len(self.places)) if self.layers[i]]

    head_place = 0
    """Index (into places) of the place holding the head: this machine."""

    @property
    def n_gpu_layers(self) -> int:
        """llama_model_params.n_gpu_layers: the servers' layers and the head (llama.cpp
        counts it as one more offloaded layer; the override then keeps it here)."""
        return self.n_layers - self.layers[0] + 1

    def tensor_split(self) -> list[float]:
        """llama_model_params.tensor_split over the used servers (their device order)."""
        shares = [float(self.layers[i]) for i in self.used_servers]
        shares[-1] += 1.0  # the head's slot in llama.cpp's count (the tensor itself is overridden to here)
        return shares

    def runs(self) -> list[tuple[str, int, int]]:
        """(place, first layer, last layer + 1) per place holding layers."""
        out, start = [], 0
        for place, n in zip(self.places, self.layers):
            if n:
                out.append((place, start, start + n))
            start += n
        return out

    def bytes_at(self, index: int) -> int:
        return (self.layer_bytes[index] + (self.head_bytes if index == self.head_place else 0)
                + (self.input_bytes if index == 0 else 0))

    def describe(self) -> str:
        parts = []
        for i, (place, n) in enumerate(zip(self.places, self.layers)):
            if not n and i != 0:
                continue
            first = sum(self.layers[:i])
            span = "embeddings" if not n else f"layer {first}" if n == 1 else f"layers {first}-{first + n - 1}"
            head = " + the output head" if i == self.head_place else ""
            parts.append(f"{place}: {span}{head} ({self.bytes_at(i) / 1e9:.2f} GB)")
        return "; ".join(parts)


def place_layers(layer_bytes: list[int], head_bytes: int, servers: list[str], shares: list[float], *,
                 input_bytes: int = 0) -> Placement:
    """Layers split in proportion to `shares` (this machine first, then `servers`), by
    count, each place's rounded by largest remainder; at least one server must hold some."""
    if len(shares) != len(servers) + 1:
        raise ValueError(f"the split needs {len(servers) + 1} shares (this machine, then each server), "
                         f"got {len(shares)}")
    if any(s < 0 for s in shares) or not any(s > 0 for s in shares[1:]):
        raise ValueError("the split's shares must be >= 0, and some server's share above 0")
    n, total = len(layer_bytes), sum(shares)
    exact = [n * s / total for s in shares]
    counts = [int(x) for x in exact]
    for i in sorted(range(len(shares)), key=lambda i: (counts[i] - exact[i], i))[:n - sum(counts)]:
        counts[i] += 1
    if not any(counts[1:]):  # a server share too small to round to a layer: the last layer goes to the largest
        best = max(range(1, len(shares)), key=lambda i: shares[i])
        counts[0] -= 1
        counts[best] += 1
    sizes, start = [], 0
    for c in counts:
        sizes.append(sum(layer_bytes[start:start + c]))
        start += c
    return Placement((HERE, *servers), tuple(counts), tuple(sizes), head_bytes, input_bytes)


def add_rpc_arguments(group: Any) -> None:
    """--rpc and --rpc-split on a command line (minions-chat, minions-serve): the profile's
    [target] rpc and rpc_split, checked as a profile's are (planning/fitting.with_rpc)."""
    group.add_argument("--rpc", type=_servers, metavar="HOST:PORT,...",
                       help="split the GGUF target's layers over these minions-rpc-servers too (a model larger "
                            "than this machine); the minions stay here")
    group.add_argument("--rpc-split", type=_shares, metavar="HERE,S1,...",
                       help="this machine's share of the layers, then each server's (e.g. 0,1,1; default: in "
                            "proportion to the memory each has)")


def rpc_overrides(args: Any) -> dict[str, Any]:
    """Engine.from_profile's keywords for what --rpc / --rpc-split gave (nothing otherwise)."""
    out: dict[str, Any] = {}
    if getattr(args, "rpc", None):
        out["rpc"] = args.rpc
    if getattr(args, "rpc_split", None):
        out["rpc_split"] = args.rpc_split
    return out


def _servers(text: str) -> list[str]:
    import argparse

    servers = [s.strip() for s in text.split(",") if s.strip()]
    if not servers:
        raise argparse.ArgumentTypeError("name at least one server, host:port")
    return servers


def _shares(text: str) -> list[float]:
    import argparse

    try:
        return [float(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not numbers separated by commas (e.g. 0,1,1)") from None
