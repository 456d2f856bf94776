"""Running statistics of a reply, computed from the engine's `StepRecord`s only.

Every number here comes from the records (never from the wall clock), so the same
records always show the same figures.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from rich.console import Group
from rich.table import Table
from rich.text import Text

from minions_local.core.events import StepRecord

RECENT = 48
"""How many recent passes the tokens-per-pass sparkline keeps."""


@dataclass
class GenerationStats:
    """Sums over the target passes of one reply (or of a whole session)."""

    passes: int = 0
    new_tokens: int = 0
    accepted: int = 0
    draft_nodes: int = 0
    t_grow: float = 0.0
    t_verify: float = 0.0
    bytes_streamed: int = 0
    last_tree_size: int = 0
    last_depth: int = 0
    minion_accepted: dict[str, int] = field(default_factory=dict)
    minion_weights: dict[str, float] = field(default_factory=dict)
    recent_tokens_per_pass: list[int] = field(default_factory=list)
    predicted_passes: int = 0
    """Passes that carried the cost model's predictions (the sums below)."""
    predicted_t_verify: float = 0.0
    predicted_t_grow: float = 0.0

    def add(self, record: StepRecord) -> None:
        self.passes += 1
        self.new_tokens += record.new_tokens
        self.accepted += record.accepted
        self.draft_nodes += record.tree_size
        self.t_grow += record.t_grow
        self.t_verify += record.t_verify
        self.bytes_streamed += record.bytes_streamed
        self.last_tree_size = record.tree_size
        self.last_depth = record.depth
        for name, count in record.minion_accepted.items():
            self.minion_accepted[name] = self.minion_accepted.get(name, 0) + count
        if record.minion_weights:
            self.minion_weights = dict(record.minion_weights)
        self.recent_tokens_per_pass.append(record.new_tokens)
        del self.recent_tokens_per_pass[:-RECENT]
        if record.predicted_t_verify is not None:
            self.predicted_passes += 1
            self.predicted_t_verify += record.predicted_t_verify
            self.predicted_t_grow += record.predicted_t_grow or 0.0

    def merge(self, other: GenerationStats) -> None:
        """Add another reply's totals (for session-wide numbers)."""
        self.passes += other.passes
        self.new_tokens += other.new_tokens
        self.accepted += other.accepted
        self.draft_nodes += other.draft_nodes
        self.t_grow += other.t_grow
        self.t_verify += other.t_verify
        self.bytes_streamed += other.bytes_streamed
        self.last_tree_size = other.last_tree_size or self.last_tree_size
        self.last_depth = other.last_depth or self.last_depth
        for name, count in other.minion_accepted.items():
            self.minion_accepted[name] = self.minion_accepted.get(name, 0) + count
        self.minion_weights = dict(other.minion_weights) or self.minion_weights
        self.recent_tokens_per_pass = (
            self.recent_tokens_per_pass + other.recent_tokens_per_pass
        )[-RECENT:]
        self.predicted_passes += other.predicted_passes
        self.predicted_t_verify += other.predicted_t_verify
        self.predicted_t_grow += other.predicted_t_grow

    def copy(self) -> GenerationStats:
        """A snapshot safe to hand to another thread."""
        return replace(
            self,
            minion_accepted=dict(self.minion_accepted),
            minion_weights=dict(self.minion_weights),
            recent_tokens_per_pass=list(self.recent_tokens_per_pass),
        )

    @property
    def seconds(self) -> float:
        return self.t_grow + self.t_verify

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_pass(self) -> float:
        return self.new_tokens / self.passes if self.passes else 0.0

    @property
    def mean_tree_size(self) -> float:
        return self.draft_nodes / self.passes if self.passes else 0.0

    @property
    def stream_gbps(self) -> float:
        return self.bytes_streamed / self.t_verify / 1e9 if self.t_verify > 0 else 0.0

    def minion_shares(self, names: list[str]) -> dict[str, float]:
        """Each minion's share of the accepted draft tokens (paths may be shared, so
        shares can add up to more than 1)."""
        total = self.accepted
        every = list(names) + [n for n in self.minion_accepted if n not in names]
        return {n: (self.minion_accepted.get(n, 0) / total if total else 0.0) for n in every}


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def share_bar(share: float, width: int = 10, color: str = "") -> Text:
    filled = round(max(0.0, min(1.0, share)) * width)
    return Text("█" * filled, style=color) + Text("░" * (width - filled), style="dim")


def render_stats(
    stats: GenerationStats,
    *,
    minion_names: list[str],
    colors: dict[str, str],
    memory: dict[str, int],
    title: str = "This reply",
) -> Group:
    """The live stats panel: speed, tree, streaming, minion shares, memory per tier."""
    speed = Table.grid(padding=(0, 1))
    speed.add_column(style="dim", no_wrap=True, min_width=10)
    speed.add_column(justify="right", no_wrap=True, style="bold", min_width=7)
    speed.add_column(style="dim", no_wrap=True)
    speed.add_row("speed", f"{stats.tokens_per_second:.1f}", "tok/s")
    speed.add_row("per pass", f"{stats.tokens_per_pass:.2f}", "tokens")
    speed.add_row("tree size", str(stats.last_tree_size), f"nodes, depth {stats.last_depth}")
    speed.add_row("mean tree", f"{stats.mean_tree_size:.1f}", "nodes")
    speed.add_row("stream", f"{stats.stream_gbps:.2f}", "GB/s")
    for label, measured, predicted in (
        ("verify", stats.t_verify, stats.predicted_t_verify),
        ("grow", stats.t_grow, stats.predicted_t_grow),
    ):
        model = f" (model {1000 * predicted / stats.predicted_passes:.1f})" if stats.predicted_passes else ""
        speed.add_row(label, f"{1000 * measured / max(stats.passes, 1):.1f}", f"ms/pass{model}")
    speed.add_row("passes", str(stats.passes), "")
    speed.add_row("tokens", str(stats.new_tokens), "")

    shares = Table.grid(padding=(0, 1))
    shares.add_column(no_wrap=True, max_width=18, overflow="ellipsis")
    shares.add_column(no_wrap=True)
    shares.add_column(justify="right", no_wrap=True)
    shares.add_column(justify="right", no_wrap=True, style="dim")
    for name, share in stats.minion_shares(minion_names).items():
        color = colors.get(name, "white")
        weight = stats.minion_weights.get(name)
        shares.add_row(
            Text("● ", style=color) + Text(name, style=color),
            share_bar(share, 8, color),
            f"{share:4.0%}",
            "" if weight is None else f"w{weight:.2f}",
        )

    tiers = Table.grid(padding=(0, 1))
    tiers.add_column(style="dim", no_wrap=True, min_width=10)
    tiers.add_column(justify="right", no_wrap=True, min_width=9)
    for tier, size in memory.items():
        tiers.add_row(tier, format_bytes(size))

    def heading(text: str) -> Text:
        return Text(text, style="bold underline")

    if stats.passes == 0:
        waiting = Text("Speed, tree size, streaming and each minion's share appear here while a reply streams.",
                       style="dim italic")
        parts = [heading(title), waiting]
    else:
        parts = [heading(title), speed, Text(""), heading("Accepted tokens by minion (vote weight)"), shares]
    if memory:
        parts += [Text(""), heading("Memory per tier"), tiers]
    return Group(*parts)
