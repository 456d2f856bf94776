"""One speculative step: budget -> grow -> vote -> verify -> accept -> commit.

The budget comes first because it bounds the growing: how many nodes and how deep
each minion may grow. The vote merges the minions' proposals into the one tree the
target verifies in a single pass.

The decoder knows nothing about text: it moves token ids and returns a stats record
per target pass. With no minions (or a zero budget) the tree is the root only and
a step is exactly one autoregressive target step, through the same code. It speaks
to the models only through the `Target` protocol and the `BaseMinion` interface
(core/minion.py).

Greedy steps take the top-N of the merged tree. Sampled steps let the minions draw
their proposals (each within its own share of the budget, see vote.py) with a draft
generator derived from the request's, and verify the merged tree whole (accept.py).
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Sequence, TypeVar

import torch

from minions_local.core.events import StepRecord, TreeSnapshot
from minions_local.core.minion import BaseMinion
from minions_local.core.protocols import PromptChunk, SlotTree, Target
from minions_local.core.sampling import SamplingParams
from minions_local.core.tree import TokenTree
from minions_local.speculation.accept import accept, check_finite, rank_trials
from minions_local.speculation.ahead import GrowingAhead, ahead_budget, ahead_pays, core_for_minions
from minions_local.speculation.budget import BudgetPolicy, PassRecord, StepBudget, TreeAsk
from minions_local.speculation.growing import Growth, GrowJob, grow_all, new_job
from minions_local.speculation.lanes import Lane, PromptRead, StepRequest
from minions_local.speculation.selection import MinionSelector
from minions_local.speculation.timing import PassTotals, StepClock, timed
from minions_local.speculation.vote import merge_greedy, merge_sampled

T = TypeVar("T")


@dataclass
class StepResult:
    tokens: list[int]
    """Committed by this step: the accepted draft tokens, then the bonus token."""
    record: StepRecord
    tree: TokenTree = field(repr=False)
    path: list[int] = field(repr=False)


@dataclass
class _Plan:
    """One request's grown and voted tree, before the shared pass verifies it."""

    request: StepRequest
    budget: StepBudget
    growth: Growth
    weights: list[float]
    tree: TokenTree
    minions_unread: bool
    """The minions have not read the prompt: the target decodes this step by itself (the
    tokens it commits are the minions' to read later, with the prompt)."""
    t_grow: float


class Decoder:
    """Speculative steps for one target and its minions: the budget policy sizes each
    step's tree, and a minion selector per regime learns who grows and how each votes.

    A step serves one request or several (continuous batching): each request's tree
    is grown on its own slot of every minion, and the target verifies all the trees
    in one pass (Target.verify_batch). One request is a step of one, through the
    same code."""

    def __init__(self, target: Target, minions: list[BaseMinion], policy: BudgetPolicy, *, top_k: int = 8,
                 keep_trees: bool = True, selection: str = "learned", grow_ahead: bool | str = "auto") -> None:
        self.target = target
        self.minions = minions
        self.policy = policy
        self.top_k = top_k
        self.keep_trees = keep_trees
        self.selection = selection
        self.grow_ahead = ahead_pays(target, grow_ahead)
        """Let minions that can go on growing while the target verifies (ahead.py)."""
        self._verify_seconds: float | None = None
        """A running average of the target's pass: when ahead-growing must end, where no
        cost model predicts it."""
        self.lanes: dict[int, Lane] = {0: Lane()}
        """Per slot in use: what the decoder remembers of that request."""
        self.read_seconds_per_token: float | None = None
        """What the minions' prompt reads have cost a token (a running average): the
        price of a deferred read (`prefill_minions(until_a_tree=True)`)."""
        self.selectors: dict[str, MinionSelector] = {}
        """One per regime: which minion pays differs between greedy and sampled decoding
        (the n-gram minion's exact repeats, say, are worth less against sampling)."""

    MINIONS_READ_LATER = 256
    """New prompt tokens from which, with no core to spare, the minions read a prompt
    only after the first token: the target's prefill gives it (one step without a tree),
    and the reply starts that much sooner. A 1500-token prompt on 2 cores: the target
    reads it in 1.5 s, the q3_k_m substitute in 2.7 s. Below this, one tree-less step
    costs more than the wait it saves."""

    def prefill_minions(self, context: list[int], slot: int, *, until_a_tree: bool = False) -> None:
        """The minions' part of `prefill`, once the target's cache holds the prompt (a
        prompt read in shared passes, engine/batch.py): read it now, or, when it is long,
        after the request's first step (which the target then decodes without a tree).

        until_a_tree: read it only when the request first gets a tree. Among many
        requests trees may not pay at all (a compute-bound CPU at 16 requests), and
        then reading 16 prompts into the minions is time lost; the budget policy
        prices the read into the request's trees (cost_policy.plan)."""
        self._minions_use(slot)
        lane = self.lanes.setdefault(slot, Lane())
        unread = lane.unread(context)
        if not unread:  # read beside the target's pass (step_shared's `shadow`), or held already
            lane.prompt = PromptRead.DONE
        elif self.minions and until_a_tree:
            lane.prompt = PromptRead.AT_FIRST_TREE
        elif self.minions and unread >= self.MINIONS_READ_LATER:
            lane.prompt = PromptRead.AFTER_FIRST_STEP
        else:
            self._minions_read([(slot, lane, context)])

    def _minions_read(self, reads: list[tuple[int, Lane, list[int]]], *, beside_target: bool = False) -> float:
        """The minions read each (slot, lane, context)'s unread prompt; the seconds it
        took (0.0: nothing to read). With the target idle, each minion reads them all
        in one `prefill_batch` (llama.cpp, the compact forward: in shared passes on every
        core); beside the target's own prefill each reads them one by one on its own
        threads."""
        if not reads:
            return 0.0
        unread = sum(lane.unread(context) for _, lane, context in reads)
        _, seconds = timed(self._read, reads, beside_target)
        if unread >= self.TIMED_READ:
            per_token, known = seconds / unread, self.read_seconds_per_token
            self.read_seconds_per_token = per_token if known is None else 0.7 * known + 0.3 * per_token
        return seconds

    def _read(self, reads: list[tuple[int, Lane, list[int]]], beside_target: bool) -> None:
        for _, lane, context in reads:
            lane.minions_saw = list(context)
            lane.prompt = PromptRead.DONE
        for m in self.minions:
            if beside_target:
                for slot, _, context in reads:
                    m.use_slot(slot)
                    m.prefill(context)
            else:
                m.prefill_batch([(slot, context) for slot, _, context in reads])

    TIMED_READ = 16
    """Reads shorter than this say little about a read's cost per token (a minion's
    fixed cost per pass dominates them)."""

    CATCH_UP = 2
    """Tokens committed without a tree from which the minions read them before their
    next tree, as a prompt is read (timed and priced as a read: _unread_seconds),
    rather than in the first pass of growing it. A tree's first pass reads the last
    step's bonus token anyway; a backlog beyond that made a tree after a stretch of
    plain decoding look dear to the cost model fitting grow passes, so trees stayed
    rare (8 requests, cpu-demo-disk, AVX-512 EPYC: shared grow passes of 1-node
    trees fitted at 13-21 ms, against 16 ms for all 8 with nothing to catch up)."""

    def _backlog(self, lane: Lane, context: list[int]) -> int:
        """Tokens decoded without a tree that the minions read before their next one
        (0: none, or fewer than CATCH_UP, which the tree's first pass reads)."""
        if lane.prompt is not PromptRead.DONE:
            return 0
        unread = lane.unread(context)
        return unread if unread >= self.CATCH_UP else 0

    def _unread_seconds(self, lane: Lane, context: list[int]) -> float:
        """What reading the context the minions have not seen would cost now."""
        if self.read_seconds_per_token is None:
            return 0.0
        unread = lane.unread(context) if lane.prompt is PromptRead.AT_FIRST_TREE else self._backlog(lane, context)
        return unread * self.read_seconds_per_token

    def use_slot(self, slot: int) -> None:
        """Point the target and every minion at `slot`'s state."""
        self.target.use_slot(slot)
        self._minions_use(slot)

    def _minions_use(self, slot: int) -> None:
        for m in self.minions:
            m.use_slot(slot)

    def expect_requests(self, count: int, tokens: int | None = None) -> None:
        """`count` requests of at most `tokens` tokens each will share steps from now on
        (a batch; tokens None: not known ahead, as a server's): minions that share their
        own passes between requests (GGUF) make room for them together, so that growing
        all their trees costs a pass per tree level."""
        for m in self.minions:
            m.expect_requests(count, tokens)
        self.policy.price_batch_grows({m.name: m.requests_per_pass for m in self.minions if m.grows_batches})

    def release(self, slot: int) -> None:
        """Free everything a finished request held (slot 0, the conversation, is
        emptied rather than freed)."""
        self.target.drop_slot(slot)
        for m in self.minions:
            m.drop_slot(slot)
        if slot:
            self.lanes.pop(slot, None)
        else:
            self.lanes[0] = Lane()

    def selector(self, regime: str) -> MinionSelector:
        """The selector that learns which minions pay in `regime` (budget.REGIMES)."""
        if regime not in self.selectors:
            self.selectors[regime] = MinionSelector.for_mode([m.name for m in self.minions], self.selection)
        return self.selectors[regime]

    def reset(self, slot: int = 0) -> None:
        """Drop `slot`'s caches (after an interrupted step they may be half-written)."""
        self.use_slot(slot)
        self.target.reset()
        self.lanes[slot] = Lane()
        for m in self.minions:
            m.reset()

    def step(self, context: list[int], params: SamplingParams, generator: torch.Generator | None,
             remaining: int, *, reproducible: bool = False, slot: int = 0) -> StepResult:
        """One target pass over a voted tree below context[-1]; `remaining` >= 1 caps
        how many tokens this step may commit.

        reproducible: when sampling, keep the drafts the minions' top tokens, so that
        the committed tokens depend only on `generator` (a seeded request repeats
        exactly, whatever the engine has learned); otherwise the minions draw their
        drafts, which the target accepts far more often."""
        request = StepRequest(context, params, generator, remaining, reproducible, slot)
        return self.step_shared([request])[0]

    def step_shared(self, requests: Sequence[StepRequest], chunks: Sequence[PromptChunk] = (),
                    shadow: Sequence[tuple[int, list[int]]] = ()) -> list[StepResult]:
        """One target pass for several requests (each on its own slot): every request's
        tree is grown and voted in turn, the target verifies them all at once, and each
        is accepted and committed on its own. Each request's tokens are what it would
        get in a step of its own with the same tree (the target's rows do not depend
        on who shares the pass: compact.py forward_parts).

        chunks: newcomers' prompt pieces that ride along in the same pass (their slots'
        target caches grow by them; nothing is decoded for them).
        shadow: (slot, context) of the requests whose first prompt chunk is in this
        pass: when nobody decodes and a core is free, the minions read those prompts
        beside the target's pass, so that a lone prompt's first token waits for the
        target's read only (else prefill_minions reads them after)."""
        if not requests:
            if chunks:
                self._prompt_pass(chunks, shadow)
            return []
        clock = StepClock()
        # Plan: each request's tree budget (the policy's own time counts as growing: it
        # is part of the step), then the reads that must come before growing.
        budgets, t_policy = timed(self._budgets, requests)
        due = self._reads_due(requests, budgets)
        prompts = [read for read in due if read[1].prompt is not PromptRead.DONE]
        backlog = [read for read in due if read[1].prompt is PromptRead.DONE]
        t_read, t_catch_up = self._minions_read(prompts), self._minions_read(backlog)
        # Execute: the minions grow and vote every request's tree, the target verifies
        # them all in one pass, and each request accepts and commits its own.
        jobs = [self._job(r, b) for r, b in zip(requests, budgets)]
        grow_all(self.minions, [job for job, _ in jobs])
        plans = [self._vote_plan(r, b, job, t_own) for r, b, (job, t_own) in zip(requests, budgets, jobs)]
        caught_up = {slot for slot, _, _ in backlog}
        for plan in plans:
            # A backlog read belongs to the tree it was read for: the step's growing
            # (not any minion's own, which the grow model is fitted to).
            plan.t_grow += t_policy / len(plans) + (t_catch_up / len(caught_up) if plan.request.slot in caught_up
                                                    else 0.0)
        streamed_before = self.target.bytes_streamed()
        outcomes, t_verify = timed(self._verify_and_commit, plans, chunks)
        t_step = clock.elapsed() if len(plans) > 1 or chunks else None
        self._verify_seconds = t_verify if self._verify_seconds is None else 0.8 * self._verify_seconds + 0.2 * t_verify
        rows = sum(len(p.tree) for p in plans) + sum(len(c.tokens) for c in chunks)
        totals = PassTotals(t_verify, self.target.bytes_streamed() - streamed_before, rows, len(plans), t_policy,
                            t_read, t_step)
        # Observe: the minions commit each request's tokens, and the selectors and the
        # policy learn from the pass.
        results = [self._commit_to_minions(plan, path, bonus, ahead_nodes, totals)
                   for plan, (path, bonus, ahead_nodes) in zip(plans, outcomes)]
        self.policy.observe_pass(PassRecord(tuple(r.record for r in results), t_verify, rows, t_read, t_step))
        return results

    def _prompt_pass(self, chunks: Sequence[PromptChunk], shadow: Sequence[tuple[int, list[int]]]) -> None:
        """A pass of prompt chunks only; `shadow`'s prompts read by the minions beside
        it on a core of their own, where there is one (step_shared)."""
        reads = [(slot, self.lanes.setdefault(slot, Lane()), context) for slot, context in shadow]
        if not reads or not self.minions or not _spare_core(self.target):
            self.target.verify_batch([], chunks)
            return
        threads = torch.get_num_threads()

        def minions_read() -> None:
            # OpenMP's thread count is per OS thread: a new thread would start at one
            # per core and oversubscribe the CPU (measured: 0.59x instead of 1.35x).
            torch.set_num_threads(threads)
            self._minions_read(reads, beside_target=True)

        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="minion-prefill") as pool:
            minions = pool.submit(minions_read)
            try:
                self.target.verify_batch([], chunks)
            finally:
                wait([minions])  # never leave a thread writing minion caches behind an error
            minions.result()

    def _budgets(self, requests: Sequence[StepRequest]) -> list[StepBudget]:
        """Each request's tree size: the policy's plan for the requests that may grow a
        tree (one row budget split between them where the policy can: cost_policy.py)."""
        chosen: list[StepBudget | None] = [None] * len(requests)
        asking = []
        for i, r in enumerate(requests):
            lane = self.lanes.setdefault(r.slot, Lane())
            if not self.minions or lane.prompt is PromptRead.AFTER_FIRST_STEP:
                chosen[i] = StepBudget(0, 0, 1)
            else:
                asking.append(i)
        # (with nobody asking, as with no minions, the policy is not asked: nothing to learn)
        picked = self.policy.plan([TreeAsk(requests[i].remaining, requests[i].regime,
                                           self._unread_seconds(self.lanes[requests[i].slot], requests[i].context))
                                   for i in asking]) if asking else []
        for i, budget in zip(asking, picked):
            chosen[i] = budget
        return chosen

    def _reads_due(self, requests: Sequence[StepRequest],
                   budgets: list[StepBudget]) -> list[tuple[int, Lane, list[int]]]:
        """The prompts the minions read before this step's growing: deferred past a
        long prompt's first step, or until a batch request's first tree; and the
        tokens committed since their last tree, when there are CATCH_UP of them."""
        due = []
        for r, b in zip(requests, budgets):
            lane = self.lanes.setdefault(r.slot, Lane())
            if lane.prompt is PromptRead.BEFORE_NEXT_STEP or (b.nodes > 0 and (
                    lane.prompt is PromptRead.AT_FIRST_TREE or self._backlog(lane, r.context))):
                due.append((r.slot, lane, r.context))
        return due

    def _job(self, request: StepRequest, budget: StepBudget) -> tuple[GrowJob, float]:
        """One request's growing, ready to run on its slot of every minion (growing.py),
        and the seconds spent making it ready."""
        self._minions_use(request.slot)

        def job() -> GrowJob:
            selector = self.selector(request.regime)
            draws = request.params if request.regime == "sampled" else None
            return new_job(request.context, request.slot, budget, selector, selector.weights(), self.minions,
                           draws=draws, generator=request.generator, top_k=self.top_k,
                           vocab_limit=self.target.vocab_size)
        return timed(job)

    def _vote_plan(self, request: StepRequest, budget: StepBudget, job: GrowJob, t_own: float) -> _Plan:
        """Vote one request's grown proposals into the tree the target verifies; a
        request whose long prompt the minions read after its first step moves on to
        reading it before the next."""
        lane = self.lanes[request.slot]
        minions_unread = lane.prompt is not PromptRead.DONE
        if lane.prompt is PromptRead.AFTER_FIRST_STEP:
            lane.prompt = PromptRead.BEFORE_NEXT_STEP
        tree, t_vote = timed(self._vote, request.context[-1], job.growth, job.weights, budget, sampled=job.sampled)
        t_grow = t_own + sum(job.growth.seconds) + t_vote
        return _Plan(request, budget, job.growth, job.weights, tree, minions_unread, t_grow)

    def _verify_and_commit(self, plans: list[_Plan],
                           chunks: Sequence[PromptChunk] = ()) -> list[tuple[list[int], int, int]]:
        """The target's pass over every plan's tree, then each request's acceptance and
        the target's commit: (accepted path, bonus token, nodes grown ahead) per plan.
        Only a lone request's minions grow ahead (ahead.py): with several, the pass
        is shared and so is the core it would take."""
        own_pass = len(plans) == 1 and not chunks
        ahead = self._grow_ahead(plans[0].growth, plans[0].budget) if own_pass else None
        try:
            with core_for_minions(self.target, ahead is not None):
                all_logits = self.target.verify_batch(
                    [SlotTree(p.request.slot, p.request.context, p.tree) for p in plans], chunks)
            if ahead is not None:
                ahead.close()  # the accept below overlaps the minion pass in flight
            outcomes = []
            for plan, logits in zip(plans, all_logits):
                r = plan.request
                check_finite(logits)
                path, bonus = accept(plan.tree, logits, r.params, r.generator, max_accept=r.remaining - 1)
                self.target.use_slot(r.slot)
                self.target.commit(plan.tree, path)
                outcomes.append([path, bonus, 0])
        finally:
            # Never leave a thread writing a minion's cache behind (an error, Ctrl-C).
            ahead_nodes = ahead.finish() if ahead is not None else 0
        outcomes[0][2] = ahead_nodes
        return [tuple(o) for o in outcomes]

    def _commit_to_minions(self, plan: _Plan, path: list[int], bonus: int, ahead_nodes: int,
                           totals: PassTotals) -> StepResult:
        """Commit one request's tokens to its minions, and let its selector learn from
        its step; its record, for the policy."""
        r, tree, growth, budget = plan.request, plan.tree, plan.growth, plan.budget
        t_verify, requests = totals.t_verify, totals.requests
        tokens = [tree.tokens[i] for i in path[1:]] + [bonus]
        selector = self.selector(r.regime)
        if plan.minions_unread:  # the minions have not read the prompt: nothing to commit, nothing to learn
            contributed = [0] * len(self.minions)
        else:
            self._minions_use(r.slot)
            for m in self.minions:
                m.commit(tokens)
            if growth.run_order:  # (after a step without a tree they still have its tokens to read)
                self.lanes[r.slot].minions_saw = r.context + tokens
            # The pass is shared: each request pays its own growing and its share of it.
            step_seconds = plan.t_grow + t_verify / requests
            contributed = selector.observe(tree, path, growth.proposals, growth.seconds, step_seconds, len(tokens))
        grown = self._of_those_that_ran(growth, growth.allowed)
        record = StepRecord(
            tree_size=tree.draft_size, accepted=len(path) - 1, t_grow=plan.t_grow, t_verify=t_verify,
            bytes_streamed=totals.streamed, depth=tree.depth, new_tokens=len(tokens),
            minion_accepted={m.name: c for m, c in zip(self.minions, contributed)},
            minion_weights=self._of_those_that_ran(growth, plan.weights),
            minion_t_grow=self._of_those_that_ran(growth, growth.seconds),
            predicted_t_verify=budget.predicted_t_verify, minion_nodes=grown,
            minion_shared={self.minions[m].name: batch for m, batch in growth.batch_grows.items()},
            predicted_t_grow=budget.predicted_grow_for(grown), regime=r.regime, t_policy=totals.t_policy,
            rank_trials=rank_trials(tree, path, capped=len(path) - 1 >= r.remaining - 1)
            if self._priced_tree(growth) else [], ahead_nodes=ahead_nodes,
            grow_depth=budget.depth, batch_size=requests, pass_rows=totals.rows, t_read=totals.t_read,
            t_step=totals.t_step,
        )
        return StepResult(tokens, record, tree, path)

    def _priced_tree(self, growth: Growth) -> bool:
        """Whether the tree says how a budget's trees fare: one that only free minions
        (n-gram) grew, because the selector deferred the rest, does not (the policy
        fits acceptance to the trees its budget pays for). At 16 requests on
        cpu-demo-disk a first step of n-gram-only trees, all rejected, held the fitted
        rate at 0.5 where the substitute's trees were accepted at 0.97 at depth 1."""
        if all(m.depth_is_free for m in self.minions):
            return True
        return any(not self.minions[m].depth_is_free for m in growth.run_order)

    def _grow_ahead(self, growth: Growth, budget: StepBudget) -> GrowingAhead | None:
        """Start the minions that grew and can grow ahead on it while the target verifies."""
        ahead = [self.minions[m] for m in growth.run_order if self.minions[m].grows_ahead and growth.proposals[m]]
        if not ahead or not self.grow_ahead:
            return None
        expected = budget.predicted_t_verify or self._verify_seconds
        return GrowingAhead(ahead, ahead_budget(budget.nodes, budget.depth, self.top_k), expected or math.inf)

    def _vote(self, root: int, growth: Growth, weights: list[float], budget: StepBudget, *,
              sampled: bool) -> TokenTree:
        """The tree the target verifies: greedy steps keep the best `budget.nodes` nodes
        of the merged vote; sampled steps keep it whole (each minion grew only its
        share: vote.py says why)."""
        if not growth.run_order:
            return TokenTree.from_root(root)
        if sampled:
            return merge_sampled(root, growth.proposals, weights, self.target.vocab_size, growth.run_order)
        merged = merge_greedy(root, growth.proposals, weights, self.target.vocab_size)
        return merged.select(budget.nodes, budget.free_depth)

    def _of_those_that_ran(self, growth: Growth, values: Sequence[T]) -> dict[str, T]:
        """Per-minion values as {name: value}, for the minions that grew this step."""
        return {m.name: v for m, v, p in zip(self.minions, values, growth.proposals) if p is not None}


def _spare_core(target: Target) -> bool:
    """Whether a second thread of torch work would get a core of its own."""
    return target.device.type == "cpu" and (os.cpu_count() or 1) >= 2 * torch.get_num_threads()


def snapshot(result: StepResult, names: list[str], decode_token) -> TreeSnapshot:
    """A display copy of the verified tree (the TUI's tree view reads this)."""
    tree = result.tree
    return TreeSnapshot(
        tokens=list(tree.tokens), parents=list(tree.parents),
        texts=[decode_token(t) for t in tree.tokens],
        proposers=[[n for m, n in enumerate(names) if mask >> m & 1] for mask in tree.proposers],
        scores=list(tree.scores), accepted_path=list(result.path),
        bonus_text=decode_token(result.tokens[-1]),
    )
