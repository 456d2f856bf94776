"""Requests driven through one minion phase by phase: alone, or several interleaved on
slots the way a batched step runs them (every request grows, then every request grows
ahead, then every request commits), so a state one request left behind is what the
next request's phase would trip over."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from minions_local.core.protocols import AheadWindow, CandidateTree, GrowBudget

Tree = tuple[list[int], list[int], list[float]]
"""A grown tree as tokens, parents and path log-probabilities."""


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    steps: int
    budget: GrowBudget
    ahead: GrowBudget | None = None
    """Grow ahead between grow and commit (minions that can)."""


def accepted_tokens(tree: CandidateTree, step: int, prompt: list[int]) -> list[int]:
    """What a target might accept: on even steps the tree's best path to depth 3, its
    last token standing for the bonus (which may land on a node grown ahead); on odd
    steps one draft and a bonus token off the tree."""
    path, node = [], -1
    while len(path) < 3:
        children = [n for n in range(len(tree)) if tree.parents[n] == node]
        if not children:
            break
        node = children[0]  # best first: the first child is the most probable
        path.append(tree.tokens[node])
    if step % 2 == 0 and path:
        return path
    bonus = prompt[step % len(prompt)]
    return path[:1] + [bonus]


def phases(minion, request: Request, trees: list[Tree]) -> Iterator[None]:
    """One request's steps, yielding after each phase; appends every grown tree."""
    context = list(request.prompt)
    for step in range(request.steps):
        tree = minion.grow(context, request.budget)
        trees.append((list(tree.tokens), list(tree.parents), list(tree.logprobs)))
        yield
        if request.ahead is not None:
            minion.grow_ahead(request.ahead, AheadWindow())
            yield
        accepted = accepted_tokens(tree, step, request.prompt)
        minion.commit(accepted)
        context += accepted
        yield


def alone(make_minion: Callable[[], object], request: Request) -> list[Tree]:
    """The trees of `request` served by a minion of its own."""
    trees: list[Tree] = []
    for _ in phases(make_minion(), request, trees):
        pass
    return trees


def interleaved(minion, requests: dict[int, Request]) -> dict[int, list[Tree]]:
    """The trees of each request, served together by one minion, one slot each
    (the dict's keys), taking turns phase by phase."""
    trees: dict[int, list[Tree]] = {slot: [] for slot in requests}
    running = {slot: phases(minion, request, trees[slot]) for slot, request in requests.items()}
    finished = object()
    while running:
        for slot in list(running):
            minion.use_slot(slot)
            if next(running[slot], finished) is finished:
                del running[slot]
    return trees


def batched(minion, requests: dict[int, Request]) -> dict[int, list[Tree]]:
    """The trees of each request as a batched step grows them: every step's grows in
    one grow_batch (the shorter requests leaving early), then each request grows
    ahead and commits on its slot."""
    contexts = {slot: list(r.prompt) for slot, r in requests.items()}
    trees: dict[int, list[Tree]] = {slot: [] for slot in requests}
    for step in range(max(r.steps for r in requests.values())):
        slots = [slot for slot, r in requests.items() if step < r.steps]
        grown = minion.grow_batch([(slot, contexts[slot], requests[slot].budget) for slot in slots])
        for slot, tree in zip(slots, grown):
            trees[slot].append((list(tree.tokens), list(tree.parents), list(tree.logprobs)))
            minion.use_slot(slot)
            if requests[slot].ahead is not None:
                minion.grow_ahead(requests[slot].ahead, AheadWindow())
        for slot, tree in zip(slots, grown):
            minion.use_slot(slot)
            accepted = accepted_tokens(tree, step, requests[slot].prompt)
            minion.commit(accepted)
            contexts[slot] += accepted
    return trees
