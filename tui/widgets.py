"""The widgets of the chat screen. None of them talks to the engine."""

from __future__ import annotations

import time

from rich.console import RenderableType
from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Label, Markdown, ProgressBar, Sparkline, Static, TextArea
from textual.timer import Timer
from textual.widgets.markdown import MarkdownStream

from minions_local.core.events import LoadProgress, TreeSnapshot
from minions_local.tui.messages import PromptSubmitted
from minions_local.tui.stats import GenerationStats, format_bytes, render_stats
from minions_local.tui.tree_view import render_tree

NEWLINE_KEYS = ("ctrl+j", "shift+enter", "alt+enter", "ctrl+enter")


class PromptInput(TextArea):
    """Multi-line prompt: Enter sends, Ctrl+J adds a line, Up/Down walk the history."""

    def __init__(self, *, history: list[str] | None = None, **kwargs) -> None:
        super().__init__(
            placeholder="Message the target… (Enter sends · Ctrl+J new line · /help)",
            soft_wrap=True,
            show_line_numbers=False,
            highlight_cursor_line=False,
            compact=True,
            **kwargs,
        )
        self.sent_history: list[str] = list(history or [])
        self._browse: int | None = None
        """Index into history while browsing; None while editing a fresh draft."""
        self._draft = ""

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self._enter()
            return
        if event.key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        await super()._on_key(event)

    def _enter(self) -> None:
        row, col = self.cursor_location
        line = self.document.get_line(row)
        if col == len(line) and line.endswith("\\"):
            # A trailing backslash continues the message on a new line, like a shell.
            self.replace("\n", (row, col - 1), (row, col))
            return
        text = self.text
        if not text.strip():
            return
        if not self.sent_history or self.sent_history[-1] != text:
            self.sent_history.append(text)
        self._browse = None
        self.clear()
        self.post_message(PromptSubmitted(text))

    def key_up(self, event: events.Key) -> None:
        if self.cursor_location[0] != 0 or not self.sent_history:
            return
        event.stop()
        event.prevent_default()
        if self._browse is None:
            self._draft = self.text
            self._browse = len(self.sent_history)
        self._browse = max(0, self._browse - 1)
        self._show(self.sent_history[self._browse])

    def key_down(self, event: events.Key) -> None:
        if self._browse is None or self.cursor_location[0] != self.document.line_count - 1:
            return
        event.stop()
        event.prevent_default()
        self._browse += 1
        if self._browse >= len(self.sent_history):
            self._browse = None
            self._show(self._draft)
        else:
            self._show(self.sent_history[self._browse])

    def _show(self, text: str) -> None:
        self.text = text
        self.move_cursor(self.document.end)


class UserMessage(Static):
    """What the user sent, shown as typed (no Markdown surprises).

    `waiting`: typed while the model loads; it shows at once, marked so, and goes to
    the model when it is ready (`mark_sent`)."""

    WAITING = "waiting for the model to load · Esc takes it back"

    def __init__(self, text: str, *, waiting: bool = False) -> None:
        super().__init__(Text(text), classes="message user")
        self.text = text
        self.border_title = "you"
        if waiting:
            self.add_class("waiting")
            self.border_subtitle = self.WAITING

    def mark_sent(self) -> None:
        self.remove_class("waiting")
        self.border_subtitle = None


FENCE = "``````"
"""Raw replies stream inside a code fence long enough not to occur in model text."""


class AssistantMessage(Vertical):
    """A reply: Markdown streamed in fragments, then a footer with its numbers.

    `raw` (not None) shows the text verbatim inside a code block, highlighted as that
    language when it names one: base models write code and prose that Markdown would
    reflow (indentation, `#` comments, `__dunder__` names).
    """

    def __init__(self, text: str = "", *, label: str = "target", raw: str | None = None) -> None:
        super().__init__(classes="message assistant")
        self.border_title = label
        self.raw = raw
        self.text = text
        shown = f"{FENCE}{raw}\n{text}\n{FENCE}" if raw is not None and text else text
        self.body = Markdown(shown)
        self.footer = Label("", classes="reply-footer")
        self._stream: MarkdownStream | None = None

    def compose(self) -> ComposeResult:
        yield self.body
        yield self.footer

    async def write(self, fragment: str) -> None:
        """Append a fragment; `Markdown.get_stream` coalesces fast writes."""
        if self._stream is None:
            self._stream = Markdown.get_stream(self.body)
            if self.raw is not None:
                await self._stream.write(f"{FENCE}{self.raw}\n")
        self.text += fragment
        await self._stream.write(fragment)

    async def finish(self, footer: str) -> None:
        if self._stream is not None:
            if self.raw is not None:
                await self._stream.write(f"\n{FENCE}\n")
            await self._stream.stop()
            self._stream = None
        if not self.text:
            await self.body.update("*(no text)*")
        elif not self.text.strip():
            breaks = self.text.count("\n")
            await self.body.update(f"*(only whitespace: {breaks} line breaks)*")
        self.footer.update(footer)
        self.add_class("finished")


class Note(Static):
    """A message from the app itself: help, the memory plan, stats, command errors."""

    def __init__(self, content: RenderableType, *, title: str = "", kind: str = "info") -> None:
        super().__init__(content, classes=f"note {kind}")
        if title:
            self.border_title = title


class MarkdownNote(Vertical):
    def __init__(self, markdown: str, *, title: str = "", kind: str = "info") -> None:
        super().__init__(classes=f"note {kind}")
        self._markdown = markdown
        if title:
            self.border_title = title

    def compose(self) -> ComposeResult:
        yield Markdown(self._markdown)


class ChatLog(VerticalScroll):
    """The conversation; anchored, so it follows new text until the user scrolls up."""

    can_focus = True


class LoadingPanel(Vertical):
    """One progress bar per (model, tier) while the weights load and are placed."""

    def __init__(self, profile: str) -> None:
        super().__init__(classes="note loading")
        self.border_title = f"loading profile {profile}"
        self._bars: dict[tuple[str, str], tuple[ProgressBar, Label]] = {}

    def compose(self) -> ComposeResult:
        yield Label("Reading weights and placing them in memory…", classes="loading-message")

    def update_progress(self, progress: LoadProgress) -> None:
        key = (progress.model, progress.tier)
        if key not in self._bars:
            name = Label(f"{progress.model} → {progress.tier}", classes="bar-name")
            bar = ProgressBar(total=max(progress.total_bytes, 1), show_eta=False)
            size = Label("", classes="bar-size")
            self.mount(Horizontal(name, bar, size, classes="bar-row"))
            self._bars[key] = (bar, size)
        bar, size = self._bars[key]
        bar.update(total=max(progress.total_bytes, 1), progress=progress.done_bytes)
        note = f"  {progress.message}" if progress.message else ""
        size.update(f"{format_bytes(progress.done_bytes)} / {format_bytes(progress.total_bytes)}{note}")


class StatsPanel(Vertical):
    """Live numbers of the reply being generated (or of the last one)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.border_title = "live stats"
        self.minion_names: list[str] = []
        self.minion_colors: dict[str, str] = {}
        self.memory: dict[str, int] = {}
        self.stats = GenerationStats()

    def compose(self) -> ComposeResult:
        yield Static(id="stats-body")
        yield Label("tokens per pass", classes="spark-title")
        yield Sparkline([], id="stats-spark")

    def on_mount(self) -> None:
        self.show(self.stats, title="No reply yet")

    def show(self, stats: GenerationStats, *, title: str = "This reply") -> None:
        self.stats = stats
        self.query_one("#stats-body", Static).update(
            render_stats(
                stats,
                minion_names=self.minion_names,
                colors=self.minion_colors,
                memory=self.memory,
                title=title,
            )
        )
        self.query_one("#stats-spark", Sparkline).data = [float(n) for n in stats.recent_tokens_per_pass]


class TreePanel(VerticalScroll):
    """The last verified token tree (toggled with Ctrl+T).

    Redrawn at most every `MIN_INTERVAL` seconds: a fast engine verifies dozens of
    trees a second and nobody reads them that fast; the last one is always drawn.
    """

    MIN_INTERVAL = 0.2

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.border_title = "last verified tree"
        self.minion_colors: dict[str, str] = {}
        self.snapshot: TreeSnapshot | None = None
        self.pass_number = 0
        self._drawn_at = -1.0
        self._pending: Timer | None = None

    def compose(self) -> ComposeResult:
        yield Static(id="tree-body")

    def on_mount(self) -> None:
        self.refresh_tree()

    def show(self, tree: TreeSnapshot | None, pass_number: int) -> None:
        self.snapshot, self.pass_number = tree, pass_number
        if not self.display or self._pending is not None:
            return
        wait = self._drawn_at + self.MIN_INTERVAL - time.monotonic()
        if wait <= 0:
            self.refresh_tree()
        else:
            self._pending = self.set_timer(wait, self.refresh_tree)

    def refresh_tree(self) -> None:
        if self._pending is not None:
            self._pending.stop()
            self._pending = None
        self._drawn_at = time.monotonic()
        self.query_one("#tree-body", Static).update(
            render_tree(self.snapshot, self.minion_colors, pass_number=self.pass_number)
        )
