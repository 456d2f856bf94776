"""`--plan` for a target split over RPC servers (`[target] rpc`, `--rpc`): where its layers
would go, each server's measured round trip, and the tokens/s predicted with the network
counted in. No weights are loaded; each server is asked the handshake's few questions.

A pass over a split pays one round trip per server holding layers: the client sends a
server its inputs and graph without waiting (ggml's RPC client queues them), then waits
for the activations (from the last server, the hidden states the head reads here)
before the next server can start.
A tree pays those round trips once for all its tokens; a token alone pays them each time.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from minions_local.speculation.cost import CostModel

HANDSHAKE_TIMEOUT = 3.0


def split_report(profile, model: CostModel, acceptance: Sequence[float], spec) -> list[str]:
    from minions_local.backends.llama_remote import plan_split
    from minions_local.backends.llama_rpc import RemoteError, handshake

    tgt = profile.target
    rtts: dict[str, float] = {}
    free: dict[str, float] = {}
    out = [f"Split over {len(tgt.rpc)} RPC server{'s' * (len(tgt.rpc) > 1)} (llama.cpp's RPC backend):"]
    for server in tgt.rpc:
        try:
            info = handshake(server, HANDSHAKE_TIMEOUT)
        except RemoteError as err:
            out.append(f"  {server}: not reachable now ({err})")
            continue
        rtts[server], free[server] = info.rtt, float(info.free_memory)
        out.append(f"  {server}: protocol {'.'.join(map(str, info.version))}, {info.free_memory / 1e9:.1f} GB free, "
                   f"round trip {info.rtt * 1e3:.2f} ms")
    if tgt.rpc_split is not None:
        shares, basis = list(tgt.rpc_split), "rpc_split"
    else:
        here = float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))  # what ggml's CPU device reports
        shares = [here] + [free.get(s, here) for s in tgt.rpc]
        basis = "memory" + ("; an unreachable server counted as this machine's" if len(free) < len(tgt.rpc) else "")
    placed = plan_split(Path(tgt.path), list(tgt.rpc), shares)
    out.append(f"  layers ({basis}): {placed.describe()}")
    used = [placed.places[i] for i in placed.used_servers]
    network = sum(rtts.get(s, 0.0) for s in used)
    unknown = [s for s in used if s not in rtts]
    out.append(f"  network per pass: {len(used)} round trip{'s' * (len(used) > 1)}, {network * 1e3:.2f} ms measured"
               + (f" ({', '.join(unknown)} not measured)" if unknown else ""))
    alone = 1 / (model.t_verify(0) + network)
    out.append(f"  target alone over the split: {alone:.2f} tok/s (compute as on this machine, plus the network)")
    out.append(f"  {'accept':>6} {'nodes':>6} {'tok/pass':>8} {'tok/s':>6} {'speedup':>7}")
    for a in acceptance:
        c = model.best_budget(a, min_nodes=spec.min_budget, max_nodes=spec.max_budget, max_depth=spec.max_depth,
                              top_k=spec.top_k)
        rate = c.tokens_per_step / (c.tokens_per_step / c.tokens_per_second + network)
        out.append(f"  {a:>6.2f} {c.nodes:>6} {c.tokens_per_step:>8.1f} {rate:>6.2f} {rate / alone:>6.1f}x")
    return out
