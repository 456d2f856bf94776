"""What the engine reports while it generates.

`Engine.stream()` yields `TokenEvent`s and `StepEvent`s and finishes with one
`DoneEvent`. The TUI, the benchmarks and autotune read only these records, so they
stay plain dataclasses without torch types.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class StepRecord:
    """One target forward pass (one grow -> vote -> verify -> accept cycle)."""

    tree_size: int
    """Draft nodes verified in this pass (the root, the last committed token, is not counted)."""
    accepted: int
    """Draft tokens the target accepted (the bonus token the target adds is not counted)."""
    t_grow: float
    """Seconds the minions spent growing and voting the tree."""
    t_verify: float
    """Seconds of the target pass, streaming included."""
    bytes_streamed: int = 0
    """Target weight bytes moved from RAM/disk into compute memory during this pass."""
    depth: int = 0
    """Depth of the verified tree (0 = root only, i.e. plain autoregressive)."""
    new_tokens: int = 0
    """Tokens committed by this pass: accepted + 1, fewer if a stop condition cut it."""
    minion_accepted: dict[str, int] = field(default_factory=dict)
    """Per minion: how many of the accepted tokens lay on a path that minion proposed."""
    minion_weights: dict[str, float] = field(default_factory=dict)
    """The vote weight each minion had in this step (only the minions that ran)."""
    minion_t_grow: dict[str, float] = field(default_factory=dict)
    """Seconds each minion that ran spent in grow() this step."""
    minion_nodes: dict[str, int] = field(default_factory=dict)
    """Draft nodes each minion that ran was allowed (its share, when sampling)."""
    minion_shared: dict[str, tuple[int, int, int, float]] = field(default_factory=dict)
    """Per minion that grew this request's tree in passes shared with other requests'
    (grow_batch): (requests, draft nodes allowed them all, passes, seconds) of the whole
    shared grow, the same in each of their records; minion_t_grow holds this request's
    equal share of it."""
    predicted_t_verify: float | None = None
    """The cost model's prediction for t_verify, when a cost model chose the budget."""
    predicted_t_grow: float | None = None
    """The cost model's prediction for t_grow, when a cost model chose the budget: for
    the minions that ran (the selector may skip some), each predicted before it grew."""
    regime: str = "greedy"
    """'greedy', 'sampled' (the minions drew their drafts) or 'seeded' (sampling with a
    seed: fixed drafts, reproducible): each accepts a different share of a tree."""
    rank_trials: list[tuple[int, int, int]] = field(default_factory=list)
    """Per node on the accepted path that had children: (their depth, children offered,
    rank by vote score of the child the target took, 0 = none). What acceptance by depth
    and rank is fitted to."""
    t_policy: float = 0.0
    """Seconds the budget policy took to choose this step's tree size."""
    ahead_nodes: int = 0
    """Nodes the minions grew ahead while the target verified (a head start for the
    next step's tree when its bonus token lands on one of them)."""
    grow_depth: int | None = None
    """How deep the step's budget let the minions grow (None: not recorded)."""
    batch_size: int = 1
    """Requests whose trees shared this target pass (continuous batching)."""
    pass_rows: int = 0
    """Rows the target's pass ran: every sharing request's tree, roots included
    (0: not recorded; one request's pass runs tree_size + 1)."""
    t_read: float = 0.0
    """Seconds the minions spent reading a prompt before this step's growing (a shared
    step's whole reads; reading what was decoded without a tree counts as growing)."""
    t_step: float | None = None
    """Wall seconds of the whole step when requests shared it (every request's growing
    and the shared pass): what the step cost this request in time. None: t_grow + t_verify."""

    @property
    def seconds(self) -> float:
        """The step's wall time as this request lived it."""
        return self.t_step if self.t_step is not None else self.t_grow + self.t_verify
    tree: "TreeSnapshot | None" = None
    """The verified tree, for display (kept small: tokens, parents, owners, accepted path)."""

    @property
    def stream_gbps(self) -> float:
        return self.bytes_streamed / self.t_verify / 1e9 if self.t_verify > 0 else 0.0

    @property
    def tokens_per_second(self) -> float:
        total = self.seconds
        return self.new_tokens / total if total > 0 else 0.0


@dataclass(slots=True)
class TreeSnapshot:
    """A verified token tree in display form. Node 0 is the root (last committed token)."""

    tokens: list[int]
    parents: list[int]
    """parents[i] is the index of node i's parent; -1 for the root."""
    texts: list[str]
    """Each node's token as text."""
    proposers: list[list[str]]
    """Names of the minions that proposed each node."""
    scores: list[float]
    """Voted score (estimated acceptance probability of the path) of each node."""
    accepted_path: list[int]
    """Node indices from the root down to the last accepted node."""
    bonus_text: str = ""
    """The token the target added after the accepted path."""


@dataclass(slots=True)
class TokenEvent:
    """New committed tokens and the text they add (text may lag tokens at a UTF-8 boundary)."""

    token_ids: list[int]
    text: str


@dataclass(slots=True)
class StepEvent:
    record: StepRecord


@dataclass(slots=True)
class Generation:
    """The result of one generate() call."""

    token_ids: list[int]
    """New tokens only."""
    text: str
    steps: list[StepRecord]
    finish_reason: str
    """'length', 'stop' (a stop string or EOS), or 'cancelled'."""
    prompt_tokens: int = 0
    prefill_seconds: float = 0.0

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    @property
    def decode_seconds(self) -> float:
        return sum(s.seconds for s in self.steps)

    @property
    def tokens_per_pass(self) -> float:
        return len(self.token_ids) / len(self.steps) if self.steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        t = self.decode_seconds
        return len(self.token_ids) / t if t > 0 else 0.0


@dataclass(slots=True)
class DoneEvent:
    generation: Generation


@dataclass(slots=True)
class NoticeEvent:
    """Something to tell the user that is no part of the reply, before it: the target was
    loaded again after an RPC server holding its layers was lost, and how long that took."""

    text: str


Event = TokenEvent | StepEvent | DoneEvent | NoticeEvent


@dataclass(slots=True)
class LoadProgress:
    """Reported while weights load and are placed (one model, one tier at a time)."""

    model: str
    """'target' or a minion's name."""
    tier: str
    """'device', 'ram' or 'disk': where these bytes are going."""
    done_bytes: int
    total_bytes: int
    message: str = ""
