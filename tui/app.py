"""`ChatApp`: the Textual chat. Loading and generation run in thread workers that
only post the messages of `messages.py`; every widget is touched on the app thread.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from rich.console import Group
from rich.text import Text
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Footer, Header
from textual.worker import Worker, get_current_worker

from minions_local.core.errors import MinionsError
from minions_local.tui.bridge import (
    DEFAULT_PROFILE,
    DaemonExecutor,
    EngineFactory,
    deferred,
    drive,
    load_engine,
    unexpected,
)
from minions_local.tui.commands import is_command
from minions_local.tui.messages import (
    EngineFailed,
    EngineReady,
    LoadProgressed,
    PromptSubmitted,
    ReplyDelta,
    ReplyFinished,
    StatsUpdated,
)
from minions_local.tui.screens import ErrorScreen
from minions_local.tui.keys import QUIT_WINDOW, KeyActions
from minions_local.tui.slash import SlashCommands
from minions_local.tui.stats import GenerationStats
from minions_local.tui.store import Conversation, ConversationStore
from minions_local.tui.tree_view import minion_colors
from minions_local.tui.widgets import (
    AssistantMessage,
    ChatLog,
    LoadingPanel,
    Note,
    PromptInput,
    StatsPanel,
    TreePanel,
    UserMessage,
)

LOAD_HINT = (
    "Try another profile with /profile NAME, or fix the paths in the profile file. "
    "`minions-chat --plan` shows the memory plan without loading any weights."
)


class LoadCancelled(Exception):
    """Raised inside the engine's progress callback to abandon a load on exit."""


@dataclass
class ChatOptions:
    """What the command line decided."""

    profile: str = DEFAULT_PROFILE
    overrides: dict[str, Any] = field(default_factory=dict)
    temperature: float | None = None
    max_new_tokens: int | None = None
    system: str | None = None
    raw: str | None = None
    """Show replies verbatim (highlighted as this language when not ""); None = Markdown."""
    resume: str | None = None
    """None: a new conversation; "": the latest saved one; else an id, number or title."""
    cursor_blink: bool = True


class ChatApp(SlashCommands, KeyActions, App[None]):
    CSS_PATH = "chat.tcss"
    TITLE = "minions-chat"
    BINDINGS = [
        Binding("escape", "stop", "Stop", priority=True),
        Binding("ctrl+c", "interrupt", "Stop / quit", priority=True, show=False),
        Binding("ctrl+t", "toggle_tree", "Tree"),
        Binding("f2", "toggle_stats", "Stats"),
        Binding("pageup", "scroll_chat(-1)", show=False, priority=True),
        Binding("pagedown", "scroll_chat(1)", show=False, priority=True),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (100, "-wide")]
    """Below 100 columns the stats panel starts hidden (F2 shows it)."""

    def __init__(
        self,
        options: ChatOptions | None = None,
        *,
        engine_factory: EngineFactory = load_engine,
        store: ConversationStore | None = None,
    ) -> None:
        super().__init__()
        self.options = options or ChatOptions()
        self.engine_factory = engine_factory
        self.store = store or ConversationStore()
        self.engine: Any = None
        self.profile = self.options.profile
        self.minion_names: list[str] = []
        self.plan_text = ""
        self.conversation = Conversation(profile=self.profile)
        self.session_stats = GenerationStats()
        self.generating = False
        self._reply: AssistantMessage | None = None
        self._question: UserMessage | None = None
        self._waiting: UserMessage | None = None
        """A question sent while the model loads; it goes to the engine once that is ready."""
        self._generation: Worker | None = None
        self._loading: LoadingPanel | None = None
        self._load_failed = False
        self._last_interrupt = -QUIT_WINDOW

    # ---- layout -------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="main"):
            yield ChatLog(id="chat-log")
            yield TreePanel(id="tree-panel")
            yield StatsPanel(id="stats-panel")
        with Vertical(id="prompt-box"):
            yield PromptInput(id="prompt")
        yield Footer()

    @property
    def chat_log(self) -> ChatLog:
        return self.query_one(ChatLog)

    @property
    def prompt(self) -> PromptInput:
        return self.query_one(PromptInput)

    async def on_mount(self) -> None:
        # Thread workers run on the loop's default executor; make it one that does not
        # hold the process after the user quits (see DaemonExecutor).
        asyncio.get_running_loop().set_default_executor(DaemonExecutor())
        self.prompt.cursor_blink = self.options.cursor_blink
        self.query_one(TreePanel).display = False
        self.chat_log.anchor()
        if self.options.resume is not None:
            await self._resume(self.options.resume)
        self._apply_cli_settings()
        self.prompt.focus()
        await self._start_loading(self.profile, self.options.overrides)

    def _apply_cli_settings(self) -> None:
        if self.options.temperature is not None:
            self.conversation.temperature = self.options.temperature
        if self.options.max_new_tokens is not None:
            self.conversation.max_new_tokens = self.options.max_new_tokens
        if self.options.system is not None:
            self.conversation.system = self.options.system
        self._update_subtitle()

    def _update_subtitle(self) -> None:
        c = self.conversation
        minions = f" · {len(self.minion_names)} minions" if self.minion_names else ""
        self.sub_title = f"{self.profile}{minions} · temp {c.temperature:g} · max {c.max_new_tokens}"

    async def _say(self, widget: Any) -> None:
        await self.chat_log.mount(widget)

    # ---- loading ------------------------------------------------------------------

    async def _start_loading(self, profile: str, overrides: dict[str, Any]) -> None:
        self.engine = None
        self._load_failed = False
        if self._loading is not None:  # a load was already running: it is abandoned
            await self._loading.remove()
        self.profile = profile
        self._update_subtitle()
        self._loading = LoadingPanel(profile)
        await self._say(self._loading)
        self._load(profile, overrides)

    @work(thread=True, exclusive=True, group="load", exit_on_error=False)
    def _load(self, profile: str, overrides: dict[str, Any]) -> None:
        worker = get_current_worker()

        def progress(update: Any) -> None:
            if worker.is_cancelled:
                raise LoadCancelled
            self.post_message(LoadProgressed(update))

        try:
            engine = self.engine_factory(profile, progress=progress, **overrides)
            ready = EngineReady(
                engine,
                getattr(engine, "profile_name", profile),
                list(getattr(engine, "minion_names", [])),
                engine.memory_plan_text(),
                dict(engine.memory_by_tier()),
            )
        except LoadCancelled:
            return
        except MinionsError as err:
            self.post_message(EngineFailed(f"Could not load profile '{profile}'", str(err)))
            return
        except Exception as err:  # a bug or an unexpected library error: no traceback dump
            self.post_message(EngineFailed(f"Could not load profile '{profile}'", unexpected(err, "loading")))
            return
        if not worker.is_cancelled:
            self.post_message(ready)

    def on_load_progressed(self, message: LoadProgressed) -> None:
        if self._loading is not None:
            self._loading.update_progress(message.progress)

    async def on_engine_ready(self, message: EngineReady) -> None:
        if self._loading is not None:
            await self._loading.remove()
            self._loading = None
        self.engine = message.engine
        self.profile = message.profile_name
        self.conversation.profile = self.profile
        self.minion_names = message.minion_names
        self.plan_text = message.plan_text
        colors = minion_colors(self.minion_names)
        stats = self.query_one(StatsPanel)
        stats.minion_names, stats.minion_colors, stats.memory = self.minion_names, colors, message.memory
        stats.show(GenerationStats(), title="No reply yet")
        self.query_one(TreePanel).minion_colors = colors
        self._update_subtitle()
        plan = Group(
            Text(self.plan_text),
            Text(""),
            Text("Ready. Type a message and press Enter; /help lists commands.", style="italic"),
        )
        note = Note(plan, title=f"memory plan · {self.profile}", kind="plan")
        waiting, self._waiting = self._waiting, None
        if waiting is None:
            await self._say(note)
            return
        await self.chat_log.mount(note, before=waiting)  # the plan, then the question that waited for it
        waiting.mark_sent()
        await self._send(waiting.text, question=waiting)

    async def on_engine_failed(self, message: EngineFailed) -> None:
        self._load_failed = True
        self._take_back_waiting()
        if self._loading is not None:
            await self._loading.remove()
            self._loading = None
        await self._say(Note(Text(message.message), title=message.title, kind="error"))
        self.push_screen(
            ErrorScreen(message.title, message.message, hint=LOAD_HINT), self._after_error
        )

    def _after_error(self, choice: str | None) -> None:
        if choice == "quit":
            self.exit()
        else:
            self.prompt.focus()

    # ---- sending and streaming ----------------------------------------------------

    async def on_prompt_submitted(self, message: PromptSubmitted) -> None:
        text = message.text.strip("\n")
        if is_command(text.strip()):
            await self._run_command(text.strip())
            return
        if text.startswith("//"):
            text = text[1:]
        if self.generating:
            self.prompt.text = text
            self.notify("A reply is still streaming: Esc stops it.", severity="warning")
            return
        if self.engine is None:
            if self._load_failed:
                self.prompt.text = text
                self.notify("No model is loaded: /profile NAME loads another profile.", severity="error")
            elif self._waiting is not None:
                self.prompt.text = text
                self.notify("A message already waits for the model to load; this one stays in the box.",
                            severity="warning")
            else:
                await self._hold(text)
            return
        await self._send(text)

    async def _hold(self, text: str) -> None:
        """Show a question typed while the model loads, marked as waiting; `on_engine_ready`
        sends it. The real model loads for ~10 s after the screen is drawn, and a first
        question kept in the box with a passing toast looked like a chat that ignored it."""
        self._waiting = UserMessage(text, waiting=True)
        await self._say(self._waiting)
        self.chat_log.anchor()
        self.refresh_bindings()

    def _take_back_waiting(self) -> None:
        """The waiting question goes back into the box (Esc, or a load that failed)."""
        waiting, self._waiting = self._waiting, None
        if waiting is None:
            return
        waiting.remove()
        if not self.prompt.text:  # never over what is typed; Up still finds it in the history
            self.prompt.text = waiting.text
            self.prompt.move_cursor(self.prompt.document.end)
        self.refresh_bindings()

    async def _send(self, text: str, *, question: UserMessage | None = None) -> None:
        """Send `text`; `question` is its message already on screen (one that waited for the load)."""
        self.conversation.messages.append({"role": "user", "content": text})
        self._reply = AssistantMessage(label=self.profile, raw=self.options.raw)
        if question is None:
            self._question = UserMessage(text)
            await self._say(self._question)
        else:
            self._question = question
        await self._say(self._reply)
        self._reply.footer.update("generating…  Esc stops")
        self.chat_log.anchor()
        self.query_one(StatsPanel).show(GenerationStats())
        self._set_generating(True)
        self._autosave()  # the question is on disk before the reply starts
        c = self.conversation
        self._generation = self._generate(
            self.engine, c.engine_messages(), c.max_new_tokens, c.temperature
        )

    def _set_generating(self, value: bool) -> None:
        self.generating = value
        self.set_class(value, "-generating")
        self.refresh_bindings()

    @work(thread=True, exclusive=True, group="generate", exit_on_error=False)
    def _generate(
        self, engine: Any, messages: list[dict[str, str]], max_new_tokens: int, temperature: float
    ) -> None:
        worker = get_current_worker()
        outcome = drive(
            deferred(
                lambda: engine.stream_chat(messages, max_new_tokens=max_new_tokens, temperature=temperature)
            ),
            on_text=lambda text: self.post_message(ReplyDelta(text)),
            on_step=lambda stats, tree: self.post_message(StatsUpdated(stats, tree)),
            cancelled=lambda: worker.is_cancelled,
            on_notice=lambda text: self.call_from_thread(self.notify, text, title="Model reloaded", timeout=20),
        )
        try:
            memory: dict[str, int] | None = dict(engine.memory_by_tier())
        except Exception:  # the numbers are a nicety; never fail a reply over them
            memory = None
        self.post_message(
            ReplyFinished(outcome.text, outcome.reason, outcome.generation, outcome.stats, outcome.error, memory)
        )

    async def on_reply_delta(self, message: ReplyDelta) -> None:
        if self._reply is not None:
            await self._reply.write(message.text)

    def on_stats_updated(self, message: StatsUpdated) -> None:
        self.query_one(StatsPanel).show(message.stats)
        if message.tree is not None:
            self.query_one(TreePanel).show(message.tree, message.stats.passes)

    async def on_reply_finished(self, message: ReplyFinished) -> None:
        reply, self._reply = self._reply, None
        self._generation = None  # it holds the engine: let /profile free the old one
        self._set_generating(False)
        stats = message.stats or GenerationStats()
        self.session_stats.merge(stats)
        panel = self.query_one(StatsPanel)
        if message.memory is not None:
            panel.memory = message.memory
        panel.show(stats, title="Last reply")
        text = message.text
        if text.strip() or message.reason not in ("cancelled", "error"):
            # Even a blank reply is the model's turn: the next prompt must contain it.
            self.conversation.messages.append({"role": "assistant", "content": text})
        else:
            # Nothing came back: take the question back so it can be edited and resent.
            last = self.conversation.messages.pop()
            if not self.prompt.text:
                self.prompt.text = last["content"]
                self.prompt.move_cursor(self.prompt.document.end)
            for widget in (self._question, reply):
                if widget is not None:
                    await widget.remove()
            reply = None
        if reply is not None:
            await reply.finish(self._footer(message, stats))
        if message.error:
            self.notify(message.error, title="Generation failed", severity="error", timeout=10)
        self._autosave()
        self.prompt.focus()

    def _footer(self, message: ReplyFinished, stats: GenerationStats) -> str:
        generation = message.generation
        tokens = len(generation.token_ids) if generation else stats.new_tokens
        parts = [
            f"{tokens} tokens",
            f"{stats.tokens_per_pass:.2f} tok/pass",
            f"{stats.tokens_per_second:.1f} tok/s",
        ]
        if generation is not None and generation.prompt_tokens:
            parts.append(f"prompt {generation.prompt_tokens} tok in {generation.prefill_seconds:.2f}s")
        if message.reason == "cancelled":
            parts.append("stopped")
        elif message.reason == "length":
            parts.append(f"hit /max {self.conversation.max_new_tokens}")
        elif message.reason == "error":
            parts.append("failed")
        return " · ".join(parts)

    def _autosave(self) -> None:
        if not self.conversation.messages:
            return
        try:
            self.store.save(self.conversation)
        except MinionsError as err:
            self.notify(str(err), title="Not saved", severity="error")

    def _fatal_error(self) -> None:
        """A bug that reached Textual: one readable line, the traceback in the log file.
        Textual's own dump prints every frame's local variables, conversation text among them."""
        error = self._exception
        self.bell()
        message = unexpected(error, "running the chat") if error is not None else "The chat stopped on an error."
        self._exit_renderables.append(Text(f"minions-chat: {message}"))
        self._close_messages_no_wait()

    # ---- keys ---------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "stop":
            # A modal screen keeps its own Esc unless a reply is streaming.
            return self.generating or (self._waiting is not None and len(self.screen_stack) == 1)
        if action == "scroll_chat":
            return len(self.screen_stack) == 1  # modal screens keep their own paging
        return True
