"""How good the demo family is: held-out loss, and how often the minions' greedy
choice is the target's (which is what makes speculative decoding pay).

Models are evaluated as shipped (weights rounded to bf16) but computed in fp32, so
the figures do not wobble with bf16 rounding of activations.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel

from demo_family.training import iterate_windows
from minions_local.backends.hf import cache_kwargs

CHAIN_DEPTH = 8  # draft tokens per pass in the chain simulations below


def as_shipped(model: PreTrainedModel) -> PreTrainedModel:
    """An fp32 copy whose weights went through bf16, like the saved files.

    Parameters only: ``Module.to(bfloat16)`` would also round the rotary
    ``inv_freq`` buffer, which is not saved (a reload recomputes it in fp32), and
    that rounding moves logits by ~0.1 at position 500."""
    shipped = copy.deepcopy(model)
    with torch.no_grad():
        for param in shipped.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    shipped.eval()
    return shipped


@torch.no_grad()
def mean_loss(model: PreTrainedModel, windows: list[torch.Tensor]) -> float:
    total, count = 0.0, 0
    for window in windows:
        logits = model(input_ids=window[None, :-1]).logits[0]
        total += float(F.cross_entropy(logits, window[1:], reduction="sum"))
        count += window.numel() - 1
    return total / max(count, 1)


@torch.no_grad()
def greedy_choices(model: PreTrainedModel, windows: list[torch.Tensor], k: int = 4) -> list[torch.Tensor]:
    """Top-k next-token ids at every position of every window, [len, k] each."""
    return [model(input_ids=w[None]).logits[0].topk(k, dim=-1).indices for w in windows]


@torch.no_grad()
def greedy_continuations(model: PreTrainedModel, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """The model's greedy continuation of each prompt (no early stop), [B, P + new]."""
    cache = DynamicCache()
    logits = model(input_ids=prompts, **cache_kwargs(model, cache), use_cache=True).logits[:, -1]
    out = [prompts]
    for _ in range(new_tokens):
        token = logits.argmax(-1, keepdim=True)
        out.append(token)
        logits = model(input_ids=token, **cache_kwargs(model, cache), use_cache=True).logits[:, -1]
    return torch.cat(out, dim=1)


def leading_run(agree: torch.Tensor, start: int, depth: int) -> int:
    run = 0
    while run < depth and start + run < agree.numel() and bool(agree[start + run]):
        run += 1
    return run


def tokens_per_pass(agree_by_branch: list[torch.Tensor], depth: int = CHAIN_DEPTH) -> float:
    """Simulated greedy speculative decoding along one sequence.

    ``agree_by_branch[m][i]``: draft model m's greedy token for position i equals the
    target's. Each pass drafts one chain of ``depth`` tokens per model (a tree of
    chains sharing the root); the target accepts the longest agreeing chain and adds
    its own next token. Exact for greedy decoding when the sequence is the target's
    own greedy output.
    """
    n = agree_by_branch[0].numel()
    position, passes = 0, 0
    while position < n:
        accepted = max(leading_run(agree, position, depth) for agree in agree_by_branch)
        position += accepted + 1
        passes += 1
    return n / max(passes, 1)


def mean_run(agree: torch.Tensor, depth: int = CHAIN_DEPTH) -> float:
    """Expected accepted draft length if a pass could start at any position."""
    return sum(leading_run(agree, i, depth) for i in range(agree.numel())) / max(agree.numel(), 1)


@dataclass
class AgreementReport:
    top1: float  # minion argmax == target argmax
    top4: float  # target argmax within the minion's top 4 (room for trees)
    mean_run: float  # expected accepted length of a greedy chain (depth 8)
    chain_tokens_per_pass: float  # simulated, depth-8 chain, incl. the target's own token


def agreement(target_top: list[torch.Tensor], minion_top: list[torch.Tensor], skip: int = 0) -> AgreementReport:
    """Compare greedy choices window by window, ignoring the first ``skip`` positions."""
    agrees = [(m[skip:, 0] == t[skip:, 0]) for t, m in zip(target_top, minion_top)]
    covers = [(m[skip:] == t[skip:, :1]).any(-1) for t, m in zip(target_top, minion_top)]
    flat = torch.cat(agrees).float()
    return AgreementReport(
        top1=float(flat.mean()),
        top4=float(torch.cat(covers).float().mean()),
        mean_run=_weighted([mean_run(a) for a in agrees], agrees),
        chain_tokens_per_pass=_weighted([tokens_per_pass([a]) for a in agrees], agrees),
    )


def tree_of_chains_tokens_per_pass(
    target_top: list[torch.Tensor], minions_top: list[list[torch.Tensor]], skip: int = 0
) -> float:
    """Simulated tokens per target pass when every minion contributes its chain."""
    per_window = []
    for w, t in enumerate(target_top):
        branches = [m[w][skip:, 0] == t[skip:, 0] for m in minions_top]
        per_window.append(tokens_per_pass(branches))
    return _weighted(per_window, [t[skip:] for t in target_top])


def _weighted(values: list[float], seqs: list[torch.Tensor]) -> float:
    weights = [s.shape[0] for s in seqs]
    return sum(v * w for v, w in zip(values, weights)) / max(sum(weights), 1)


def per_file_windows(tokenizer, docs, window: int, limit: int) -> list[torch.Tensor]:
    """One window from the start of each file (BOS first), files too short skipped."""
    windows = []
    for doc in docs:
        ids = [tokenizer.eos_token_id] + tokenizer.backend_tokenizer.encode(doc.text).ids
        if len(ids) >= window:
            windows.append(torch.tensor(ids[:window], dtype=torch.long))
        if len(windows) >= limit:
            break
    return windows


def evaluate(spec, tokenizer, models, held_out_tokens, third_party_docs,
             log: Callable[[str], None] = print) -> tuple[dict, dict, list[torch.Tensor]]:
    """The family's figures (losses, agreement, simulated tokens per pass), the models
    as shipped, and the third-party windows they were measured on."""
    shipped = {name: as_shipped(m) for name, m in models.items()}
    held_windows = list(iterate_windows(held_out_tokens, spec.eval_window + 1, spec.eval_max_windows))
    code_windows = per_file_windows(tokenizer, third_party_docs, spec.eval_window, spec.eval_max_windows)
    log(f"eval: {len(held_windows)} held-out windows, {len(code_windows)} third-party windows")
    figures: dict = {"models": {}}
    choices = {name: greedy_choices(m, code_windows) for name, m in shipped.items()}
    prompts = torch.stack([w[: spec.greedy_prompt_len] for w in code_windows[: spec.greedy_prompts]])
    continuations = list(greedy_continuations(shipped["target"], prompts, spec.greedy_new_tokens))
    on_continuations = {name: greedy_choices(m, continuations) for name, m in shipped.items()}
    skip = spec.greedy_prompt_len - 1  # positions that predict generated tokens
    for name, model in shipped.items():
        fig = {"params": sum(p.numel() for p in model.parameters())}
        fig["held_out_loss"] = mean_loss(model, held_windows)
        if name != "target":
            fig["third_party"] = vars(agreement(choices["target"], choices[name]))
            fig["greedy"] = vars(agreement(on_continuations["target"], on_continuations[name], skip=skip))
        figures["models"][name] = fig
    minion_names = [n for n in shipped if n != "target"]
    figures["tree_of_chains_tokens_per_pass"] = tree_of_chains_tokens_per_pass(
        on_continuations["target"], [on_continuations[n] for n in minion_names], skip=skip
    )
    figures["tree_of_chains_tokens_per_pass_real_code"] = tree_of_chains_tokens_per_pass(
        choices["target"], [choices[n] for n in minion_names]
    )
    figures["third_party_files"] = len(code_windows)
    return figures, shipped, code_windows


def print_table(figures: dict, log: Callable[[str], None] = print) -> None:
    log(f"{'model':<18} {'params':>10} {'held-out':>9} {'top1':>6} {'top4':>6} {'run':>5} {'greedy top1':>11} {'tok/pass':>8}")
    for name, fig in figures["models"].items():
        tp, gr = fig.get("third_party"), fig.get("greedy")
        cols = [f"{name:<18}", f"{fig['params']:>10,}", f"{fig['held_out_loss']:>9.3f}"]
        if tp:
            cols += [f"{tp['top1']:>6.3f}", f"{tp['top4']:>6.3f}", f"{tp['mean_run']:>5.2f}"]
            cols += [f"{gr['top1']:>11.3f}", f"{gr['chain_tokens_per_pass']:>8.2f}"]
        log(" ".join(cols))
    log(f"tree of all minions' chains: {figures['tree_of_chains_tokens_per_pass']:.2f} tokens/pass (greedy), "
        f"{figures['tree_of_chains_tokens_per_pass_real_code']:.2f} along real code")
