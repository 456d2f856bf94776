"""The best-first frontier shared by the HF and GGUF minions, without a model."""

from __future__ import annotations

import math
import random

from minions_local.backends.frontier import Frontier
from minions_local.core.protocols import CandidateTree, GrowBudget


def test_takes_best_path_probability_first_and_ties_in_offer_order():
    tree = CandidateTree()
    frontier = Frontier(tree, GrowBudget(max_nodes=10, max_depth=3, width=2))
    frontier.offer(-1, [(5, math.log(0.6)), (6, math.log(0.2)), (7, math.log(0.2))])
    assert frontier.take() == [0, 1]
    assert tree.tokens == [5, 6]  # 6 and 7 tie: the one offered first goes first
    frontier.offer(0, [(8, math.log(0.5))])  # path 0.6 * 0.5 = 0.3 beats 0.2
    assert frontier.take() == [2, 3]
    assert tree.tokens[2:] == [8, 7] and tree.parents[2:] == [0, -1]
    assert tree.logprobs[2] == math.log(0.6) + math.log(0.5)
    assert frontier.depths == [1, 1, 2, 1]


def test_ranked_children_are_ordered_by_rank_not_probability():
    tree = CandidateTree()
    frontier = Frontier(tree, GrowBudget(max_nodes=10, max_depth=3, width=1), ranked=True)
    frontier.offer(-1, [(1, math.log(0.1)), (2, math.log(0.9))])  # draw order: 1 first
    assert frontier.take() == [0] and tree.tokens == [1]
    # The first draw below node 0 scores 0.8 * 0.8 = 0.64 > the second draw at the root, 0.4.
    frontier.offer(0, [(3, math.log(0.01))])
    assert frontier.take() == [1] and tree.tokens[1] == 3
    assert tree.logprobs[1] == math.log(0.1) + math.log(0.01)  # the vote stays the path probability


def test_room_and_depth_limits():
    tree = CandidateTree()
    frontier = Frontier(tree, GrowBudget(max_nodes=3, max_depth=1, width=2))
    frontier.offer(-1, [(t, -float(t)) for t in range(5)])
    assert frontier.take() == [0, 1]
    assert frontier.can_take()
    assert frontier.take() == [2]  # the width would allow 2, the tree has room for 1
    assert frontier.tree_full and not frontier.can_take()
    assert not frontier.may_expand(0)  # depth 1 is the limit


def test_a_tree_fills_in_full_width_batches():
    """32 nodes at width 8 take four passes, as the cost model's grow shape assumes."""
    tree = CandidateTree()
    frontier = Frontier(tree, GrowBudget(max_nodes=32, max_depth=8, width=8))
    frontier.offer(-1, [(t, -0.1 * t) for t in range(40)])
    sizes = []
    while frontier.can_take():
        sizes.append(len(frontier.take()))
    assert sizes == [8, 8, 8, 8]


def test_only_nodes_whose_children_could_join_are_worth_running():
    """Room for 2 more nodes and two waiting candidates at or above a node: its children
    (never above it) cannot join, so a minion pass over it would be wasted."""
    tree = CandidateTree()
    frontier = Frontier(tree, GrowBudget(max_nodes=4, max_depth=4, width=2))
    frontier.offer(-1, [(1, math.log(0.5)), (2, math.log(0.3)), (3, math.log(0.1)), (4, math.log(0.1))])
    batch = frontier.take()  # 1 and 2; 3 and 4 wait at 0.1
    assert frontier.worth_running(batch) == batch  # both beat 0.1
    frontier.offer(batch[0], [(5, math.log(0.9))])  # 0.45 waits now too
    assert frontier.take() == [2, 3]  # 0.45, then 0.1 (token 3, offered first)
    assert frontier.worth_running([2, 3]) == []  # room is full
    tree = CandidateTree()
    frontier = Frontier(tree, GrowBudget(max_nodes=3, max_depth=4, width=1))
    frontier.offer(-1, [(1, math.log(0.2)), (2, math.log(0.2)), (3, math.log(0.2))])
    assert frontier.take() == [0]
    assert frontier.worth_running([0]) == []  # two waiting ties at 0.2 fill the room first


def _toy_children(path: tuple[int, ...], k: int = 3) -> list[tuple[int, float]]:
    """A deterministic stand-in for a minion: k children per path, log-probabilities
    that depend on the whole path (no ties)."""
    rng = random.Random(hash(path))
    weights = [rng.random() + 0.01 for _ in range(k)]
    total = sum(weights)
    return sorted(((rng.randrange(1000), math.log(w / total)) for w in weights), key=lambda c: -c[1])


def _grow(frontier: Frontier, prefix: tuple[int, ...] = ()) -> None:
    tree = frontier.tree

    def path(node: int) -> tuple[int, ...]:
        out = []
        while node >= 0:
            out.append(tree.tokens[node])
            node = tree.parents[node]
        return prefix + tuple(reversed(out))

    while frontier.can_take():
        for node in frontier.take():
            if frontier.may_expand(node):
                frontier.offer(node, _toy_children(path(node)))


def _paths(tree: CandidateTree) -> dict[tuple[int, ...], float]:
    out = {}
    for n in range(len(tree)):
        p, node = [], n
        while node >= 0:
            p.append(tree.tokens[node])
            node = tree.parents[node]
        out[tuple(reversed(p))] = tree.logprobs[n]
    return out


def test_a_rerooted_frontier_grows_on_as_a_tree_grown_from_that_node():
    """What commit() carries over when the bonus token lands on a node grown ahead: the
    subtree below it, candidates included, grows on into exactly the tree a fresh grow
    from that node would make (paths and log-probabilities relative to the new root)."""
    tree = CandidateTree()
    frontier = Frontier(tree, GrowBudget(max_nodes=40, max_depth=6, width=4))
    frontier.offer(-1, _toy_children(()))
    _grow(frontier)
    node = max(range(len(tree)), key=lambda n: (frontier.depths[n] == 2, tree.logprobs[n]))  # a likely depth-2 node
    prefix = (tree.tokens[tree.parents[node]], tree.tokens[node])
    carried, inside = frontier.reroot(node)
    assert inside[node] == -1 and all(carried.tree.parents[i] < i for i in range(len(carried.tree)))
    assert len(carried.tree) == sum(1 for n in inside if n != node) > 0
    budget = GrowBudget(max_nodes=25, max_depth=4, width=4)
    carried.budget = budget
    _grow(carried, prefix)
    fresh = Frontier(CandidateTree(), budget)
    fresh.offer(-1, _toy_children(prefix))
    _grow(fresh, prefix)
    got, want = _paths(carried.tree), _paths(fresh.tree)
    assert got.keys() == want.keys()
    assert all(math.isclose(got[p], want[p], abs_tol=1e-12) for p in want)
