"""An end-to-end speculative chat on the demo family, the product's shape at toy scale.

The target streams from pinned RAM every pass (target_tier='ram': its layers live in
pinned host memory on CUDA; the CPU rehearsal streams from disk) and the minion sits
in VRAM. Each turn is answered twice, greedily: by the speculative engine and by the
target alone (our autoregressive, also streamed), and the two replies must be the
same; a parting is measured (parting.py), not hidden. The demo target is 42 MB: a
pass is microseconds of GPU work behind a few hundred kernel launches, so its tok/s
measures launches and Python, not streaming; the curve step measures what a 70B's
passes cost.
"""

from __future__ import annotations

import tempfile
import time

import torch
from transformers import AutoModelForCausalLM

from gpucheck.parting import judge
from minions_local import Engine
from minions_local.models.demo import DEMO_DIR
from minions_local.offload.binding import layer_store

MINION = "minion-qwen2-xs"
"""The one minion that travels: the smallest (3.3 MB) and the family's best chain
(5.58 tokens a pass on the target's own continuations: MODEL_CARD.md)."""
QUESTIONS = ("Write a Python function that reverses a linked list, and explain it.",
             "Now write a class for a stack with push and pop.")
NOTE = ("The demo target is 42 MB: its tok/s is mostly kernel launches and Python, not streaming; "
        "this step checks the plumbing (pinned RAM -> GPU target, minion in VRAM, greedy identity). "
        "The curve step measures a 70B's passes.")
DTYPE = "bfloat16"


def streamed_tier(device: str) -> str:
    """The tier that streams the target into compute on `device`: pinned RAM on CUDA.
    On a CPU 'ram' means resident (RAM is its device memory), so the rehearsal streams
    from disk: the same layer store and hooks, read from packs instead of RAM."""
    return "ram" if device.startswith("cuda") else "disk"


def load(device: str, minions: list, cache_dir: str) -> Engine:
    return Engine.from_pretrained(DEMO_DIR / "target", minions, device=device, dtype=DTYPE,
                                  target_tier=streamed_tier(device), stream_options={"cache_dir": cache_dir})


def placement(engine: Engine) -> dict:
    """Where the target's streamed layers and the minions' weights actually live."""
    store = layer_store(engine.decoder.target.model)
    out: dict = {"target_streams_from": sorted({s.tier for s in store.sources}) if store else []}
    ram = [s for s in store.sources if s.tier == "ram"] if store else []
    if ram:
        out["target_pinned"] = all(s.data.is_pinned() for s in ram)
    out["minion_devices"] = sorted({str(next(m.model.parameters()).device) for m in engine.decoder.minions
                                    if hasattr(m, "model")})
    return out


def run_chat(device: str, quick: bool, deadline: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="gpu-check-packs-") as cache_dir:
        return _chat(device, quick, deadline, cache_dir)


def _chat(device: str, quick: bool, deadline: float, cache_dir: str) -> dict:
    max_new = 16 if quick else 128
    spec = load(device, [DEMO_DIR / MINION], cache_dir)
    alone = load(device, [], cache_dir)
    for engine in (spec, alone):  # warm: kernels, allocator, the first pinned copies
        engine.generate("def f(x):", max_new_tokens=8)
        engine.reset()
    result: dict = {"minion": MINION, "dtype": DTYPE, "tier": streamed_tier(device), "max_new_tokens": max_new,
                    "note": NOTE, **placement(spec), "turns": []}
    reference = None
    messages: list[dict] = []
    totals = {"tokens": 0, "passes": 0, "seconds": 0.0, "alone_tokens": 0, "alone_seconds": 0.0}
    for question in QUESTIONS:
        if result["turns"] and time.monotonic() + 2 * result["turns"][-1]["seconds_both"] > deadline:
            result["left_out"] = f"{len(QUESTIONS) - len(result['turns'])} turn(s): no time left"
            break
        messages.append({"role": "user", "content": question})
        t0 = time.perf_counter()
        ours = spec.chat(messages, max_new_tokens=max_new)
        t1 = time.perf_counter()
        theirs = alone.chat(messages, max_new_tokens=max_new)
        t2 = time.perf_counter()
        turn = {"tokens": len(ours.token_ids), "passes": len(ours.steps),
                "tokens_per_pass": round(len(ours.token_ids) / max(1, len(ours.steps)), 2),
                "tok_s": round(len(ours.token_ids) / (t1 - t0), 1),
                "autoregressive_tok_s": round(len(theirs.token_ids) / (t2 - t1), 1),
                "identical": ours.token_ids == theirs.token_ids, "seconds_both": round(t2 - t0, 2),
                "reply": ours.text[:200]}
        if not turn["identical"]:
            if reference is None:  # the target itself, resident, for the logits at the parting
                reference = AutoModelForCausalLM.from_pretrained(DEMO_DIR / "target", dtype=torch.bfloat16)
                reference = reference.to(device).eval()
            stop = min(spec.eos_ids) if spec.eos_ids else None
            # Engine._chat_ids is how chat() renders the conversation: the same prompt ids.
            parting = judge(reference, spec._chat_ids(messages), ours.token_ids, theirs.token_ids, stop)
            turn["parting"] = parting.as_json() if parting else None
        result["turns"].append(turn)
        totals["tokens"] += len(ours.token_ids)
        totals["passes"] += len(ours.steps)
        totals["seconds"] += t1 - t0
        totals["alone_tokens"] += len(theirs.token_ids)
        totals["alone_seconds"] += t2 - t1
        messages.append({"role": "assistant", "content": ours.text})
    turns = result["turns"]
    result["identical"] = all(t["identical"] for t in turns)
    result["near_ties_only"] = all(t["identical"] or (t.get("parting") or {}).get("near_tie") for t in turns)
    result["tokens_per_pass"] = round(totals["tokens"] / max(1, totals["passes"]), 2)
    result["tok_s"] = round(totals["tokens"] / max(1e-9, totals["seconds"]), 1)
    result["autoregressive_tok_s"] = round(totals["alone_tokens"] / max(1e-9, totals["alone_seconds"]), 1)
    result["speedup"] = round(result["tok_s"] / max(1e-9, result["autoregressive_tok_s"]), 2)
    return result
