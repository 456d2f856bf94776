"""Which part of a verified tree the target accepts.

Greedy: follow the target's argmax down the tree; the first argmax that is not a
child is the bonus token. This is token-identical to the target decoding alone.

Sampling: multi-draft recursive rejection sampling (SpecInfer's multi-step
speculative sampling). At a node the verifier walks the node's ordered draft
entries (x_i, q_i) with p_1 = the target's processed distribution there:

    accept x_i with probability min(1, p_i(x_i) / q_i(x_i))  -> descend into x_i;
    otherwise p_{i+1} = normalize(max(p_i - q_i, 0)) and try the next entry;
    when every entry is rejected, the bonus token is drawn from p_{k+1}.

A deterministic entry has q_i = delta(x_i): it is accepted with probability p_i(x_i)
and rejecting it removes x_i. With deterministic entries only, this is SpecExec's
rule (draw from the target, descend if the draw is a child) in another order.

Why it is exact: if x_i ~ q_i, one round outputs x with probability
min(p_i(x), q_i(x)) and rejects with probability r = sum_x max(p_i(x) - q_i(x), 0), so
P(output x) = min(p_i, q_i)(x) + r * P(later rounds output x). By induction the
later rounds output p_{i+1} = max(p_i - q_i, 0) / r, and the sum is p_i(x). What
this needs is that each sampled x_i follows q_i given everything earlier in the
order and given that it is in the tree:

- a minion draws a node's children without replacement, so its i-th draw has
  q_i = its distribution q with its earlier draws there removed and renormalized
  (computed here from the node's earlier entries with the same draft);
- which draws are kept depends only on ranks and depths (base.rank_log_score,
  vote.source_shares), never on the drawn tokens or their probabilities;
- minions draw independently; entries follow the order the minions ran in, and
  deterministic entries come last (they may be chosen in view of the draws);
- the tree is fixed before the target's randomness is used.

Each committed token is then a draw from the target's distribution given the
tokens before it; the tree only decides how many of those draws one pass serves.
"""

from __future__ import annotations

import torch

from minions_local.core.errors import ModelOutputError
from minions_local.core.sampling import SamplingParams, processed_probs
from minions_local.core.tree import TokenTree


def accept(
    tree: TokenTree,
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    max_accept: int | None = None,
) -> tuple[list[int], int]:
    """Walk the tree with the target's verdicts.

    logits: [T, V], row i is the target's next-token logits after node i.
    Returns (accepted path as node indices starting at the root, bonus token).
    `max_accept` caps the draft nodes taken (the bonus token is still the target's
    own choice after the last one), so a length limit never costs exactness.
    """
    path = [0]
    node = 0
    while True:
        row = logits[node]
        capped = max_accept is not None and len(path) - 1 >= max_accept
        if params.greedy:
            token = int(torch.argmax(row))
            child = None if capped else tree.children[node].get(token)
        elif capped or not tree.has_drawn_entries(node):
            # Fixed drafts only: draw from the target and descend if the draw is a child
            # (SpecExec's rule). One draw per committed token, whatever the tree: a
            # seeded run's output cannot depend on what the minions proposed.
            token = int(torch.multinomial(processed_probs(row, params).cpu(), 1, generator=generator))
            child = None if capped else tree.children[node].get(token)
        else:
            child, token = verify_node(tree, node, processed_probs(row, params), generator)
        if child is None:
            return path, token
        path.append(child)
        node = child


RESIDUAL_EPS = 1e-6
"""Below this rejection mass p_i and q_i agree up to rounding: in exact arithmetic a
rejection has probability r (~0), and its residual would be rounding noise."""


def verify_node(tree: TokenTree, node: int, target_probs: torch.Tensor,
                generator: torch.Generator | None) -> tuple[int | None, int]:
    """Recursive rejection sampling over `node`'s draft entries.

    Returns (the accepted child, its token) or (None, the bonus token from the
    final residual).
    """
    p = target_probs.double()
    drawn_before: dict[int, list[int]] = {}  # draft -> its tokens already walked here
    for token, draft in tree.draft_entries(node):
        if draft < 0:
            q = None
        else:
            q = draft_distribution(tree.drafts[draft], drawn_before.setdefault(draft, []), p.shape[-1])
            drawn_before[draft].append(token)
        residual = _rejection_residual(p, q, token)
        mass = float(residual.sum())
        q_token = 1.0 if q is None else float(q[token])
        # u < p/q, written without the division (q_token > 0 for any drawn token).
        if mass <= RESIDUAL_EPS or _uniform(generator) * q_token < float(p[token]):
            return tree.children[node][token], token
        p = residual / mass
    # Draws run on the CPU, where a request's generator lives (engine/reply.py), whatever
    # device computed the logits: a seeded request repeats on any device.
    return None, int(torch.multinomial(p.cpu(), 1, generator=generator))


def _uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator, dtype=torch.float64))


def draft_distribution(q: torch.Tensor, drawn: list[int], vocab: int) -> torch.Tensor:
    """What a without-replacement draw followed: q without the earlier draws, renormalized
    (padded or cut to the target's vocabulary)."""
    q = q.double()
    if q.shape[-1] < vocab:
        q = torch.nn.functional.pad(q, (0, vocab - q.shape[-1]))
    q = q[:vocab].clone()
    if drawn:
        q[drawn] = 0.0
    return q / q.sum()


def _rejection_residual(p: torch.Tensor, q: torch.Tensor | None, token: int) -> torch.Tensor:
    """max(p - q, 0), unnormalized: its sum is the probability of rejecting."""
    if q is None:
        residual = p.clone()
        residual[token] = 0.0
        return residual
    return (p - q).clamp_(min=0.0)


def rank_trials(tree: TokenTree, path: list[int], capped: bool = False) -> list[tuple[int, int, int]]:
    """What each node on the accepted path offered the target: (depth of its children,
    children, rank by vote score of the one it took, 0 = none). `capped`: the walk
    stopped at a length limit, so the last node's outcome says nothing of its children."""
    trials = []
    for i, node in enumerate(path):
        children = sorted(tree.children[node].values(), key=lambda c: -tree.scores[c])
        if not children or (capped and i == len(path) - 1):
            break
        taken = path[i + 1] if i + 1 < len(path) else None
        trials.append((i + 1, len(children), children.index(taken) + 1 if taken is not None else 0))
    return trials


def check_finite(logits: torch.Tensor) -> None:
    """NaN or infinite logits choose a token as if they were scores (argmax takes a NaN
    as the largest), so a broken model would end its reply "normally", often at once.
    One sum finds either anywhere (float32 cannot overflow on real logits)."""
    if not torch.isfinite(logits.sum(dtype=torch.float32)):
        bad = "NaN" if torch.isnan(logits).any() else "infinite"
        raise ModelOutputError(
            f"The target model computed {bad} logits, so no next token can be chosen; the reply stops here. "
            "Its weights may be damaged (restore the model files), or its activations overflow the dtype it "
            "runs in (float16 does on some models: try dtype = \"float32\" or \"bfloat16\" in the profile).")
