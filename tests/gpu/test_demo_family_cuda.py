"""The demo family on CUDA: speculation replies as the target alone, and samples its law.

Run by `pytest -m gpu` on a GPU (scripts/gpu_check.py's tests step). Without CUDA they
are skipped, unless MINIONS_GPU_TEST_DEVICE=cpu: the check's rehearsal runs the same
tests on the CPU, so CI proves their code before a GPU ever runs it.

bf16 throughout, the dtype a GPU runs: on CUDA the target's tree rows are not
row-invariant (that is built for the CPU only), so a greedy reply may part from the
target alone's where its best two tokens are within rounding of each other. Each
parting is measured (scripts/gpucheck/parting.py) and written to $MINIONS_GPU_RECORD;
a near-tie passes, anything else fails. Switching to float32 would only hide them.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from gpucheck.chat import streamed_tier
from gpucheck.parting import judge
from transformers import AutoModelForCausalLM

from minions_local import Engine
from minions_local.core.sampling import SamplingParams, processed_probs
from minions_local.models.demo import DEMO_DIR
from tests.helpers.stats import chi2_pvalue, first_two_tokens

DEVICE = os.environ.get("MINIONS_GPU_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "")
QUICK = os.environ.get("MINIONS_GPU_CHECK_QUICK") == "1"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not DEVICE, reason="needs CUDA (MINIONS_GPU_TEST_DEVICE=cpu rehearses on the CPU)")]

TARGET = DEMO_DIR / "target"
MINION = DEMO_DIR / "minion-qwen2-xs"  # the one minion that travels to the GPU machine (gpucheck/travel.py)
PROMPTS = ("def fibonacci(n):", "import os\n\n\ndef walk(top):\n", "class Stack:\n    def __init__(self):",
           "<|endoftext|>### User:\nHow do I read a file line by line?\n\n### Assistant:\n")
MAX_NEW = 24 if QUICK else 64
SAMPLES = 150 if QUICK else 1200
GREEDY_PROMPTS = PROMPTS[::3] if QUICK else PROMPTS  # the rehearsal: a code and a chat prompt


def record(entry: dict) -> None:
    """One JSON line for gpu_check.py's result (nothing without $MINIONS_GPU_RECORD)."""
    path = os.environ.get("MINIONS_GPU_RECORD")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"device": DEVICE, **entry}) + "\n")


@pytest.fixture(scope="module")
def reference():
    """The target itself, resident, in bf16 on the device: the logits at a parting,
    and the law a sample must follow. Loaded on first use."""
    loaded = []

    def get():
        if not loaded:
            loaded.append(AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.bfloat16).to(DEVICE).eval())
        return loaded[0]

    return get


@pytest.mark.parametrize("placement", ["resident", "streamed"])
def test_greedy_replies_are_the_target_alones(placement, reference, tmp_path):
    """Resident, and streamed every pass: from pinned RAM on CUDA (from disk in the
    CPU rehearsal, where 'ram' is resident)."""
    tier = "device" if placement == "resident" else streamed_tier(DEVICE)
    options = {"target_tier": tier, "stream_options": {"cache_dir": str(tmp_path)}}
    spec = Engine.from_pretrained(TARGET, [MINION], device=DEVICE, dtype="bfloat16", budget=16, max_depth=8,
                                  **options)
    alone = Engine.from_pretrained(TARGET, [], device=DEVICE, dtype="bfloat16", **options)
    stop = min(spec.eos_ids) if spec.eos_ids else None
    partings, accepted = [], []
    for text in GREEDY_PROMPTS:
        prompt = spec.tokenizer.encode(text)
        ours = spec.generate(prompt, max_new_tokens=MAX_NEW)
        theirs = alone.generate(prompt, max_new_tokens=MAX_NEW)
        accepted += [s.accepted for s in ours.steps]
        parting = judge(reference(), prompt, ours.token_ids, theirs.token_ids, stop) \
            if ours.token_ids != theirs.token_ids else None
        record({"test": "greedy", "tier": tier, "prompt": text, "tokens": len(theirs.token_ids),
                "passes": len(ours.steps), "parting": parting.as_json() if parting else None})
        if parting:
            partings.append(parting)
    # The minion's drafts must really be taken, or identity would prove nothing.
    assert max(accepted) >= 2, f"no step accepted 2 drafted tokens: {accepted}"
    bad = [p.as_json() for p in partings if not p.near_tie]
    assert not bad, f"replies parted from the target alone's where no near-tie explains it: {bad}"


def clear_top_k(model, prompt: list[int]) -> tuple[int, float]:
    """The top_k (3-8) whose cut is clearest, at the root and after each token it
    admits: a k-th and (k+1)-th logit within rounding of each other could put a token
    in the engine's support and not in the law's, or the other way round."""
    device = next(model.parameters()).device
    with torch.no_grad():
        root = model(torch.tensor([prompt], device=device)).logits[0, -1].float()
        firsts = torch.topk(root, 8).indices
        ctx = torch.tensor([prompt + [int(x)] for x in firsts], device=device)
        after = model(ctx).logits[:, -1].float()
    best = (0, -1.0)
    for k in range(3, 9):
        rows = torch.cat([root[None], after[:k]])
        ranked = torch.sort(rows, dim=-1, descending=True).values
        gap = float((ranked[:, k - 1] - ranked[:, k]).min())
        if gap > best[1]:
            best = (k, gap)
    return best


def test_sampled_replies_follow_the_targets_law(reference, monkeypatch, tmp_path):
    """The first two sampled tokens (both from one pass when a draft is taken) follow
    the target's own distribution: chi-square, as the CPU tests check it."""
    import minions_local.engine.reply as reply

    # Unseeded requests draw their drafts from here: repeatable, as the CPU test makes it.
    stream = iter(range(10**6))
    monkeypatch.setattr(reply.random, "getrandbits", lambda bits: next(stream))
    engine = Engine.from_pretrained(TARGET, [MINION], device=DEVICE, dtype="bfloat16", budget=8, max_depth=3,
                                    selection="all", target_tier=streamed_tier(DEVICE),
                                    stream_options={"cache_dir": str(tmp_path)})
    prompt = engine.tokenizer.encode("def fibonacci(n):\n    ")
    model = reference()
    k, gap = clear_top_k(model, prompt)
    params = SamplingParams(temperature=1.0, top_k=k)
    with torch.no_grad():
        p1 = processed_probs(model(torch.tensor([prompt], device=model.device)).logits[0, -1], params).cpu()
        support = [int(x) for x in torch.nonzero(p1).flatten()]
        ctx = torch.tensor([prompt + [x] for x in support], device=model.device)
        p2 = processed_probs(model(ctx).logits[:, -1], params).cpu()
    expected = {(x1, int(x2)): float(p1[x1] * p2[i, x2]) for i, x1 in enumerate(support)
                for x2 in torch.nonzero(p2[i]).flatten()}
    seen, drafted = first_two_tokens(engine, prompt, SAMPLES, temperature=1.0, top_k=k)
    outside = sorted(set(seen) - set(expected))
    pvalue = chi2_pvalue(seen, expected, SAMPLES) if not outside else 0.0
    record({"test": "sampling", "top_k": k, "cut_gap": round(gap, 4), "samples": SAMPLES, "drafted": drafted,
            "pvalue": round(pvalue, 5), "outside_support": outside[:5]})
    assert not outside, f"sampled pairs the target's top-{k} law excludes (cut gap {gap:.3f}): {outside[:5]}"
    assert drafted > SAMPLES // 10, "drafts should often serve both tokens in one pass"
    assert pvalue > 0.001
