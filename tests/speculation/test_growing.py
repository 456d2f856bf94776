"""Growing a shared step's trees in rounds (speculation/growing.py): a minion with
grow_batch grows every request that asks for it at once, the others one request at a
time, and each request's proposals are what a step of its own would get."""

from __future__ import annotations

from minions_local.core.protocols import PromptChunk
from minions_local.core.sampling import SamplingParams
from minions_local.speculation.decode import Decoder
from minions_local.speculation.lanes import StepRequest
from tests.speculation.test_speculation_units import ChainMinion, ChainPolicy, ChainTarget


class BatchChainMinion(ChainMinion):
    """A ChainMinion that also grows several slots' trees in one call (as llama.cpp
    does), and records the slots of each call."""

    grows_batches = True

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


def test_a_shared_grow_is_recorded_whole_and_fitted_as_one_sample():
    """Every record of a shared grow holds the whole of it (requests, nodes, passes,
    seconds), and the cost model fits it once, as passes of all its requests' rows,
    not once per request at an equal share of the time."""
    from minions_local.speculation.budget import StepBudget
    from minions_local.speculation.cost_policy import grow_samples

    batch = BatchChainMinion("model")
    batch.requests_per_pass = 2  # two requests a pass: 3 requests take two passes a level
    decoder = Decoder(ChainTarget(), [batch], ChainPolicy(), selection="all")
    results = decoder.step_shared(_requests(3))
    shared = {r.record.minion_shared["model"] for r in results}
    assert len(shared) == 1
    requests, nodes, passes, seconds = shared.pop()
    assert (requests, nodes, passes) == (3, 24, 2 * 2)  # ChainPolicy: 8 nodes, 2 levels each
    assert abs(sum(r.record.minion_t_grow["model"] for r in results) - seconds) < 1e-9
    samples = grow_samples([(r.record, StepBudget(8, 2, 4)) for r in results])
    assert samples == {"model": [(6, seconds / 4)]}


def test_a_minion_that_grows_one_request_at_a_time_records_no_shared_grow():
    plain = ChainMinion("model")
    decoder = Decoder(ChainTarget(), [plain], ChainPolicy(), selection="all")
    assert all(not r.record.minion_shared for r in decoder.step_shared(_requests(2)))


def test_the_decoder_tells_the_policy_which_minions_share_passes():
    class Listening(ChainPolicy):
        groups = None

        def price_batch_grows(self, groups):
            self.groups = groups

    batch, plain = BatchChainMinion("model"), ChainMinion("ngram", free=True)
    batch.requests_per_pass = 8
    policy = Listening()
    Decoder(ChainTarget(), [batch, plain], policy).expect_requests(4)
    assert policy.groups == {"model": 8}


class ScriptedPolicy(ChainPolicy):
    """Trees of the given sizes, step after step (0: plain decoding)."""

    def __init__(self, sizes):
        self.sizes = list(sizes)

    def choose(self, remaining, regime="greedy"):
        from minions_local.speculation.budget import StepBudget

        nodes = self.sizes.pop(0)
        return StepBudget(nodes=nodes, depth=2 if nodes else 0, width=max(1, nodes // 2), depth_cap=2)


class ReadingMinion(ChainMinion):
    def __init__(self, name, **kw):
        super().__init__(name, **kw)
        self.reads = []

    def prefill(self, context):
        self.reads.append(len(context))


def test_tokens_decoded_without_trees_are_read_before_the_next_tree_not_in_its_growing():
    """After plain steps the minions have a backlog: from CATCH_UP tokens on it is read
    as a prompt is (timed as a read), so that the tree's grow time is a grow's."""
    minion = ReadingMinion("model")
    decoder = Decoder(ChainTarget(), [minion], ScriptedPolicy([2, 0, 2, 0, 0, 0, 2]), selection="all")
    context = [1, 2, 3]
    decoder.step_shared([], [PromptChunk(0, context[:-1])], shadow=[(0, context)])
    decoder.prefill_minions(context, 0)  # a lone prompt's read, on a box with no core to spare
    assert minion.reads == [3]
    minion.reads, lengths = [], []
    for _ in range(7):
        result = decoder.step(context, SamplingParams(0.0), None, 100)
        lengths.append(len(context))
        context = context + result.tokens
    # one plain step leaves one token behind, which the next tree's grow reads itself;
    # three leave three, read before that tree
    assert decoder.CATCH_UP == 2
    assert minion.reads == [lengths[6]]


def test_trees_only_free_minions_grew_teach_the_policy_nothing_about_acceptance():
    """When the selector defers the priced minion, the n-gram minion's tree alone is
    verified: its trials would drag the fitted rate of the budget's trees down."""
    from minions_local.speculation.growing import Growth

    def grown_by(decoder, minions):
        growth = Growth.empty(len(decoder.minions))
        growth.run_order = minions
        return decoder._priced_tree(growth)

    decoder = Decoder(ChainTarget(), [ChainMinion("ngram", free=True), ChainMinion("model")], ChainPolicy(),
                      selection="all")
    assert decoder.step([1, 2, 3], SamplingParams(0.0), None, 100).record.rank_trials  # both grew
    assert not grown_by(decoder, [0]) and grown_by(decoder, [0, 1]) and grown_by(decoder, [1])
    only_free = Decoder(ChainTarget(), [ChainMinion("ngram", free=True)], ChainPolicy(), selection="all")
    assert grown_by(only_free, [0])  # an n-gram-only engine still learns from its trees
