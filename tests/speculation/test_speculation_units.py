"""Trees, voting, masks, positions, acceptance and cache edits, without real models."""

import math
import os

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from minions_local.core.minion import BaseMinion
from minions_local.core.protocols import CandidateTree, PromptChunk
from minions_local.backends.hf import CachedModel
from minions_local.core.sampling import SamplingParams
from minions_local.speculation.accept import accept
from minions_local.speculation.budget import AdaptiveDepth, BudgetPolicy, FixedBudget
from minions_local.core.tree import TokenTree
from minions_local.speculation.selection import MinionSelector, contributions, marginal_tokens
from minions_local.speculation.vote import merge_greedy
from minions_local.core.events import StepRecord


def proposal(*nodes):
    """nodes: (token, parent, prob)."""
    t = CandidateTree()
    for token, parent, p in nodes:
        t.add(token, parent, math.log(p))
    return t


def test_merge_votes_by_token_path():
    a = proposal((5, -1, 0.8), (6, 0, 0.6), (7, -1, 0.1))
    b = proposal((5, -1, 0.5), (9, 0, 0.4))
    tree = merge_greedy(1, [a, b], [3.0, 1.0])
    five = tree.child(0, 5)
    assert tree.parents[five] == 0 and tree.proposers[five] == 0b11
    assert math.isclose(tree.scores[five], 0.75 * 0.8 + 0.25 * 0.5)
    six, nine = tree.child(five, 6), tree.child(five, 9)
    assert math.isclose(tree.scores[six], 0.75 * 0.6) and tree.proposers[six] == 0b01
    assert math.isclose(tree.scores[nine], 0.25 * 0.4) and tree.proposers[nine] == 0b10
    assert tree.depths[six] == 2


def test_merge_skips_absent_minions_and_out_of_vocab_subtrees():
    a = proposal((50, -1, 0.9), (3, 0, 0.8), (4, -1, 0.5))
    tree = merge_greedy(1, [None, a], [1.0, 1.0], vocab_limit=40)
    assert tree.tokens == [1, 4] and math.isclose(tree.scores[1], 0.5)


def test_select_is_connected_best_first_and_depth_limited():
    tree = TokenTree.from_root(0)
    a = tree.add(0, 1, 0.9)
    b = tree.add(a, 2, 0.8)
    tree.add(b, 3, 0.7)
    tree.add(0, 4, 0.5)
    tree.add(a, 5, 0.05)
    sub = tree.select(max_nodes=3, max_depth=8)
    assert sub.tokens == [0, 1, 2, 3] and sub.parents == [-1, 0, 1, 2]
    sub = tree.select(max_nodes=3, max_depth=2)
    assert sub.tokens == [0, 1, 2, 4]
    for i, p in enumerate(sub.parents[1:], 1):
        assert p < i


def test_masks_and_positions():
    tree = TokenTree.from_root(10)
    a = tree.add(0, 11)
    tree.add(0, 12)
    tree.add(a, 13)
    anc = tree.ancestor_matrix()
    assert anc.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    assert tree.position_ids(7).tolist() == [[7, 8, 8, 9]]
    mask = tree.attention_mask(3, torch.float32)
    assert mask.shape == (1, 1, 4, 7)
    visible = (mask[0, 0] == 0).int().tolist()
    assert visible[3] == [1, 1, 1, 1, 1, 0, 1] and visible[2] == [1, 1, 1, 1, 0, 1, 0]


def test_greedy_accept_walks_argmax_and_caps():
    tree = TokenTree.from_root(0)
    a = tree.add(0, 1)
    b = tree.add(a, 2)
    tree.add(0, 3)
    logits = torch.full((4, 5), -5.0)
    logits[0, 1] = logits[a, 2] = logits[b, 4] = 5.0
    assert accept(tree, logits, SamplingParams()) == ([0, a, b], 4)
    assert accept(tree, logits, SamplingParams(), max_accept=1) == ([0, a], 2)
    logits[0, 1], logits[0, 0] = -5.0, 5.0  # target disagrees at the root
    assert accept(tree, logits, SamplingParams()) == ([0], 0)


def test_contributions_and_marginal_tokens():
    tree = TokenTree.from_root(0)
    a = tree.add(0, 1, proposers=0b11)
    b = tree.add(a, 2, proposers=0b01)
    c = tree.add(b, 3, proposers=0b11)
    assert contributions(tree, [0, a, b, c], 2) == [3, 2]
    # Without minion 0 the path stops before b (nobody else proposed it).
    assert marginal_tokens(tree, [0, a, b, c], 0) == 2
    assert marginal_tokens(tree, [0, a, b, c], 1) == 0


def test_budgets():
    assert FixedBudget(32, 8).choose(100).width == 4
    assert FixedBudget(32, 8).choose(1).nodes == 0  # one token left: nothing to draft
    policy = AdaptiveDepth(nodes=16, depth=4)
    policy.observe(StepRecord(tree_size=16, accepted=4, t_grow=0, t_verify=0, depth=4))
    assert policy.depth == 6
    policy.observe(StepRecord(tree_size=16, accepted=1, t_grow=0, t_verify=0, depth=6))
    assert policy.depth == 5


def test_backends_declare_what_the_decode_step_calls(families):
    """The decode step calls every protocol member without looking first: each backend
    declares them all (a minion with nothing to read ahead has a no-op prefill)."""
    from minions_local.backends.hf_minion import HFMinion
    from minions_local.backends.hf_target import HFTarget
    from minions_local.backends.ngram import NGramMinion
    from minions_local.core.protocols import Minion, Target

    model = AutoModelForCausalLM.from_pretrained(families["llama"]["close"]).eval()
    assert isinstance(HFTarget(model), Target)
    hf, ngram = HFMinion(model, "close"), NGramMinion()
    assert isinstance(hf, Minion) and isinstance(ngram, Minion)
    assert not hf.depth_is_free and ngram.depth_is_free
    ngram.prefill([1, 2, 3])  # nothing to read ahead, and nothing breaks


def test_cache_keep_entries_matches_fresh_run(families):
    """Keeping the prefix + an accepted path equals running that sequence from scratch."""
    model = AutoModelForCausalLM.from_pretrained(families["llama"]["target"]).eval()
    cm = CachedModel(model)
    prefix = [5, 6, 7, 8]
    cm.extend(prefix[:-1])
    tree = TokenTree.from_root(prefix[-1])
    a = tree.add(0, 20)
    tree.add(0, 21)
    b = tree.add(a, 22)
    tree.add(a, 23)
    logits = cm.forward(tree.tokens, tree.ancestor_matrix(), tree.depths, 3)
    cm.keep_entries([0, 1, 2, 3, 3 + a, 3 + b])
    nxt = cm.forward([30], np.ones((1, 1), dtype=bool), [0], 6)[0]
    with torch.no_grad():
        ref = model(torch.tensor([prefix + [20, 22, 30]])).logits[0]
    assert torch.allclose(logits[b], ref[-2], atol=1e-4)
    assert torch.allclose(nxt, ref[-1], atol=1e-4)


def test_a_lone_prompt_pass_lets_the_minions_read_on_a_spare_core_and_never_leaves_a_thread_behind(monkeypatch):
    """Minions read a prompt in a worker while the target's pass reads its first chunk;
    an error in either waits for both."""
    import threading
    import time

    import torch

    from minions_local.speculation import decode

    class Target:
        device = torch.device("cpu")

        def __init__(self, fail):
            self.fail = fail

        def verify_batch(self, trees, chunks=()):
            if self.fail:
                raise KeyboardInterrupt  # Ctrl-C while the target reads the prompt
            return []

        def use_slot(self, slot):
            pass

    class SlowMinion(BaseMinion):
        name = "slow"

        def __init__(self):
            self.done, self.thread = False, None

        def prefill(self, context):
            time.sleep(0.05)
            self.thread, self.done = threading.current_thread(), True

    monkeypatch.setattr(decode, "_spare_core", lambda target: True)
    for fail in (False, True):
        minion = SlowMinion()
        decoder = decode.Decoder(Target(fail), [minion], FixedBudget(4, 2))
        prompt_pass = lambda: decoder.step_shared([], [PromptChunk(0, [1, 2])], shadow=[(0, [1, 2, 3])])  # noqa: E731
        if fail:
            with pytest.raises(KeyboardInterrupt):
                prompt_pass()
        else:
            prompt_pass()
        assert minion.done  # the worker finished before prefill returned or raised
        assert minion.thread is not threading.main_thread()


class ChainPolicy(BudgetPolicy):
    """Every step: 8 nodes, 2 levels for model minions, 8 for free-depth ones."""

    def choose(self, remaining, regime="greedy"):
        from minions_local.speculation.budget import StepBudget

        return StepBudget(nodes=8, depth=2, width=4, depth_cap=8)

    def observe(self, record):
        pass


class ChainMinion(BaseMinion):
    """Proposes the chain 10, 11, 12, ... as deep as allowed (or nothing when silent)."""

    vocab_size = 50
    grows_ahead = False

    def __init__(self, name, free=False, silent=False):
        self.name, self.depth_is_free, self.silent, self.seen = name, free, silent, []

    def prefill(self, context):
        pass

    def grow(self, context, budget):
        self.seen.append(budget.max_depth)
        tree = CandidateTree()
        parent = -1
        for i in range(0 if self.silent else budget.max_depth):
            parent = tree.add(10 + i, parent, -0.01 * (i + 1))
        return tree

    def grow_ahead(self, budget, window):
        return 0

    def commit(self, accepted):
        pass

    def reset(self):
        pass


class ChainTarget:
    """Follows the chain 10, 11, 12, ... whatever the tree."""

    vocab_size = 50

    def __init__(self):
        import torch

        self.device = torch.device("cpu")

    def prefill(self, context):
        pass

    def reset(self):
        pass

    def forget_beyond(self, context):
        pass

    def bytes_streamed(self):
        return 0

    def verify(self, context, tree):
        import torch

        logits = torch.zeros(len(tree), 50)
        for i in range(len(tree)):
            logits[i, 10 + tree.depths[i]] = 1.0
        return logits

    def commit(self, tree, path):
        pass

    shares_passes = False

    def verify_batch(self, trees, chunks=()):
        return [self.verify(t.context, t.tree) for t in trees]

    def missing_prompt(self, context):
        return []

    def use_slot(self, slot):
        pass

    def drop_slot(self, slot):
        pass


def test_a_minion_whose_depth_is_free_grows_to_the_steps_depth_cap():
    """The depth budget bounds the model minions' passes; the n-gram minion pays
    nothing per level and follows a long repeat as far as the step allows."""
    from minions_local.core import protocols
    from minions_local.core.protocols import Minion
    from minions_local.speculation.decode import Decoder

    model, ngram = ChainMinion("model"), ChainMinion("ngram", free=True)
    assert isinstance(model, Minion) and isinstance(ChainTarget(), protocols.Target)
    decoder = Decoder(ChainTarget(), [model, ngram], ChainPolicy(), selection="all")
    result = decoder.step([1, 2, 3], SamplingParams(0.0), None, 100)
    assert model.seen == [2] and ngram.seen == [8]
    assert result.record.accepted == 8  # the deep chain survived the vote's selection


def test_a_benched_minion_grows_when_nobody_else_proposed_anything():
    """An empty tree spends a whole target pass on one token: when the minions that
    ran proposed nothing, the cheapest benched one grows after all."""
    from minions_local.speculation.decode import Decoder

    silent, model = ChainMinion("ngram", silent=True), ChainMinion("model")
    decoder = Decoder(ChainTarget(), [silent, model], ChainPolicy(), selection="learned")
    selector = decoder.selector("greedy")
    selector.seconds_per_token = 0.001  # the model minion costs far more than it adds
    bench = selector.stats[1]
    bench.cost, bench.marginal, bench.skipped, bench.backoff = 1.0, 0.0, 0, 32
    selector.stats[0].cost = 0.0
    assert selector.choose() == [True, False]
    result = decoder.step([1, 2, 3], SamplingParams(0.0), None, 100)
    assert silent.seen == [2] and model.seen == [2]
    assert result.record.accepted == 2 and result.record.minion_accepted == {"ngram": 0, "model": 2}


class AheadMinion(ChainMinion):
    """A chain minion that grows ahead on the decoder's worker thread (or fails there)."""

    grows_ahead = True

    def __init__(self, name, fail=False):
        super().__init__(name)
        self.fail, self.ahead, self.committed = fail, [], []

    def grow_ahead(self, budget, window):
        import threading

        self.ahead.append((threading.current_thread().name, budget.max_nodes, budget.max_depth, budget.width))
        if self.fail:
            raise RuntimeError("llama_decode failed")
        return 3

    def commit(self, accepted):
        self.committed.append(list(accepted))


def test_minions_grow_ahead_on_a_worker_while_the_target_verifies_and_its_errors_surface():
    import torch

    from minions_local.speculation.ahead import AHEAD_WIDTH
    from minions_local.speculation.decode import Decoder

    minion = AheadMinion("model")
    target = ChainTarget()
    threads = torch.get_num_threads()
    seen_threads = []
    verify = target.verify
    target.verify = lambda context, tree: (seen_threads.append(torch.get_num_threads()), verify(context, tree))[1]
    decoder = Decoder(target, [minion], ChainPolicy(), selection="all", grow_ahead=True)
    result = decoder.step([1, 2, 3], SamplingParams(0.0), None, 100)
    assert minion.ahead == [("minions-ahead", 2 * 8 + 16, 2 * 2 + 2, AHEAD_WIDTH)]
    assert result.record.ahead_nodes == 3 and minion.committed == [result.tokens]
    assert torch.get_num_threads() == threads  # given back after the pass
    if threads > 1 and (os.cpu_count() or 1) <= threads:
        assert seen_threads == [threads - 1]  # a core left to the minion while the target verified

    failing = AheadMinion("model", fail=True)
    decoder = Decoder(ChainTarget(), [failing], ChainPolicy(), selection="all", grow_ahead=True)
    with pytest.raises(RuntimeError, match="llama_decode failed"):
        decoder.step([1, 2, 3], SamplingParams(0.0), None, 100)
    assert failing.committed == []  # nothing committed past a failed step

    off = AheadMinion("model")
    Decoder(ChainTarget(), [off], ChainPolicy(), selection="all", grow_ahead=False).step(
        [1, 2, 3], SamplingParams(0.0), None, 100)
    assert off.ahead == []


def test_an_ahead_window_closes_at_its_deadline_or_when_done():
    import math
    import time

    from minions_local.core.protocols import AheadWindow

    window = AheadWindow(time.perf_counter() + 10.0)
    assert window.allows(1.0) and not window.allows(20.0)
    window.done.set()
    assert not window.allows(0.0)
    assert AheadWindow().allows(1e9) and AheadWindow().deadline == math.inf


def test_a_decoder_without_minions_steps_under_the_cost_model_policy():
    """No minions, no tree to ask for: every step is a plain target step, a lone one or
    several in a pass, and the policy still learns the passes' times."""
    from minions_local.speculation.cost import CostModel, GrowTime, VerifyTime
    from minions_local.speculation.cost_policy import CostModelBudget
    from minions_local.speculation.decode import Decoder
    from minions_local.speculation.lanes import StepRequest

    policy = CostModelBudget(CostModel(VerifyTime(flat=0.03, base=0.01, slope=0.001), (GrowTime("m", 0.01, 0.001),)))
    decoder = Decoder(ChainTarget(), [], policy)
    assert decoder.step([1, 2, 3], SamplingParams(0.0), None, 100).tokens == [10]
    results = decoder.step_shared([StepRequest([1, 2, 3 + i], SamplingParams(0.0), None, 100, slot=i + 1)
                                   for i in range(2)])
    assert [r.tokens for r in results] == [[10], [10]] and len(policy._passes) == 2
