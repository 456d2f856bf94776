"""Growing a shared step's trees in rounds (speculation/growing.py): a minion with
grow_batch grows every request that asks for it at once, the others one request at a
time, and each request's proposals are what a step of its own would get."""

from __future__ import annotations

from minions_local.core.sampling import SamplingParams
from minions_local.speculation.decode import Decoder
from minions_local.speculation.lanes import StepRequest
from tests.speculation.test_speculation_units import ChainMinion, ChainPolicy, ChainTarget


class BatchChainMinion(ChainMinion):
    """A ChainMinion that also grows several slots' trees in one call (as llama.cpp
    does), and records the slots of each call."""

    def __init__(self, name, **kw):
        super().__init__(name, **kw)
        self.slot, self.calls = 0, []

    def use_slot(self, slot):
        self.slot = slot

    def grow_batch(self, requests):
        self.calls.append([slot for slot, _, _ in requests])
        return [ChainMinion.grow(self, context, budget) for _, context, budget in requests]


def _requests(n):
    return [StepRequest([1, 2, 3 + i], SamplingParams(0.0), None, 100, slot=i + 1) for i in range(n)]


def test_a_minion_with_grow_batch_grows_every_request_of_a_round_at_once():
    batch, plain = BatchChainMinion("model"), ChainMinion("ngram", free=True)
    decoder = Decoder(ChainTarget(), [batch, plain], ChainPolicy(), selection="all")
    results = decoder.step_shared(_requests(3))
    assert batch.calls == [[1, 2, 3]]  # one call for the three requests' trees
    assert plain.seen == [8, 8, 8]  # one grow per request
    alone = Decoder(ChainTarget(), [BatchChainMinion("model"), ChainMinion("ngram", free=True)], ChainPolicy(),
                    selection="all").step([1, 2, 3], SamplingParams(0.0), None, 100)
    for r in results:
        assert r.tokens == alone.tokens and r.record.tree_size == alone.record.tree_size
        assert set(r.record.minion_t_grow) == {"model", "ngram"}
    # each request is charged its share of the shared grow, not the whole of it
    shares = [r.record.minion_t_grow["model"] for r in results]
    assert max(shares) == min(shares)


def test_a_lone_request_grows_through_grow_and_a_benched_minion_through_grow_batch():
    """One request asks grow(); when the first minions of a round proposed nothing, the
    cheapest benched minion grows every such request in one later round."""
    silent, batch = ChainMinion("ngram", silent=True), BatchChainMinion("model")
    decoder = Decoder(ChainTarget(), [silent, batch], ChainPolicy(), selection="learned")
    selector = decoder.selector("greedy")
    selector.seconds_per_token = 0.001
    bench = selector.stats[1]
    bench.cost, bench.marginal, bench.skipped, bench.backoff = 1.0, 0.0, 0, 32
    selector.stats[0].cost = 0.0
    decoder.step([1, 2, 3], SamplingParams(0.0), None, 100)
    assert batch.calls == [] and batch.seen == [2]  # alone: grow(), no batch call
    results = decoder.step_shared(_requests(2))
    assert silent.seen == [2, 2, 2] and batch.calls == [[1, 2]]
    assert all(r.record.accepted == 2 for r in results)
