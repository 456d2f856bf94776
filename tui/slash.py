"""The slash commands and conversation switching, as a mixin of `ChatApp`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Group
from rich.text import Text

from minions_local.core.errors import MinionsError
from minions_local.tui.bridge import unexpected
from minions_local.tui.commands import HELP, Command, CommandError, parse_command
from minions_local.tui.screens import ConversationPicker
from minions_local.tui.stats import GenerationStats, render_stats
from minions_local.tui.store import Conversation, ConversationFileError, skipped_note
from minions_local.tui.tree_view import minion_colors
from minions_local.tui.widgets import AssistantMessage, MarkdownNote, Note, StatsPanel, TreePanel, UserMessage

if TYPE_CHECKING:
    from minions_local.tui.app import ChatApp

BUSY = {"new", "load", "profile"}
"""Commands that would pull the conversation or the engine from under a running reply."""


class SlashCommands:
    async def _run_command(self: ChatApp, text: str) -> None:
        try:
            command = parse_command(text)
        except CommandError as err:
            self.notify(str(err), title="Command", severity="warning")
            return
        if command.name in BUSY and self.generating:
            self.notify(f"/{command.name} waits until the reply is done (Esc stops it).", severity="warning")
            return
        try:
            await getattr(self, f"_cmd_{command.name}")(command)
        except MinionsError as err:
            self.notify(str(err), title=f"/{command.name}", severity="error")
        except Exception as err:  # a bug: a message and the log file, never a crash (its dump shows locals)
            self.notify(unexpected(err, f"running /{command.name}"), title=f"/{command.name}", severity="error")

    async def _cmd_help(self: ChatApp, command: Command) -> None:
        await self._say(MarkdownNote(HELP, title="help"))

    async def _cmd_quit(self: ChatApp, command: Command) -> None:
        self.action_quit_now()

    async def _cmd_tree(self: ChatApp, command: Command) -> None:
        self.action_toggle_tree()

    async def _cmd_copy(self: ChatApp, command: Command) -> None:
        replies = [m["content"] for m in self.conversation.messages if m["role"] == "assistant"]
        if not replies:
            self.notify("No reply to copy yet.", severity="warning")
            return
        self.copy_to_clipboard(replies[-1])
        self.notify(f"Copied the last reply ({len(replies[-1])} characters).")

    async def _cmd_raw(self: ChatApp, command: Command) -> None:
        arg = command.arg.strip()
        if arg.lower() in ("off", "markdown", "md"):
            self.options.raw = None
            self.notify("Replies render as Markdown.")
        else:
            self.options.raw = arg
            shown = f"highlighted as {arg}" if arg else "as plain text"
            self.notify(f"Replies show verbatim, {shown}, from the next one (/raw off: Markdown).")

    async def _cmd_temp(self: ChatApp, command: Command) -> None:
        self.conversation.temperature = float(command.value or 0.0)
        self._update_subtitle()
        mode = "greedy" if self.conversation.temperature == 0 else "sampling"
        self.notify(f"Temperature {self.conversation.temperature:g} ({mode}) from the next reply.")

    async def _cmd_max(self: ChatApp, command: Command) -> None:
        self.conversation.max_new_tokens = int(command.value or 1)
        self._update_subtitle()
        self.notify(f"Replies stop after {self.conversation.max_new_tokens} new tokens.")

    async def _cmd_system(self: ChatApp, command: Command) -> None:
        if not command.arg:
            current = self.conversation.system or "(none)"
            await self._say(Note(Text(current), title="system prompt"))
        elif command.arg.lower() in ("off", "clear", "none", "-"):
            self.conversation.system = ""
            self.notify("System prompt cleared.")
        else:
            self.conversation.system = command.arg
            self.notify("System prompt set for the next reply.")

    async def _cmd_save(self: ChatApp, command: Command) -> None:
        if command.arg:
            self.conversation.title = command.arg
        path = self.store.save(self.conversation)
        self.notify(f"Saved '{self.conversation.display_title()}' to {path}")

    async def _cmd_new(self: ChatApp, command: Command) -> None:
        old = self.conversation
        await self._open_conversation(
            Conversation(
                profile=self.profile,
                system=old.system,
                temperature=old.temperature,
                max_new_tokens=old.max_new_tokens,
            )
        )
        saved = " The last one is saved: /load brings it back." if old.messages else ""
        self.notify("New conversation." + saved)

    async def _cmd_load(self: ChatApp, command: Command) -> None:
        if command.arg:
            await self._open_conversation(self.store.find(command.arg))
            return
        scan = self.store.scan()
        saved = scan.conversations
        if scan.problems:
            self._report_unreadable(scan.problems)
        if not saved:
            self.notify(f"No saved conversations yet (they go to {self.store.root}).")
            return

        async def chosen(conversation: Conversation | None) -> None:
            if conversation is not None:
                await self._open_conversation(conversation)

        self.push_screen(ConversationPicker(saved), chosen)

    async def _cmd_profile(self: ChatApp, command: Command) -> None:
        if not command.arg:
            await self._say(Note(Text(_profiles_text(self.profile)), title="profiles"))
            return
        self.minion_names = []
        await self._start_loading(command.arg, {})  # drops the old engine first

    async def _cmd_stats(self: ChatApp, command: Command) -> None:
        stats_panel = self.query_one(StatsPanel)
        body = render_stats(
            self.session_stats,
            minion_names=self.minion_names,
            colors=minion_colors(self.minion_names),
            memory=stats_panel.memory,
            title=f"This session ({len(self.conversation.messages)} messages)",
        )
        parts: list[Any] = [body]
        if self.plan_text:
            parts += [Text(""), Text("Memory plan", style="bold underline"), Text(self.plan_text)]
        await self._say(Note(Group(*parts), title="stats"))

    # ---- conversations ------------------------------------------------------------

    def _report_unreadable(self: ChatApp, problems: list[ConversationFileError]) -> None:
        """Name the files that are not conversations (they are left alone), never their text."""
        listed = "\n".join(f"{p.path.name}: {p.reason}" for p in problems[:5])
        more = f"\n(and {len(problems) - 5} more)" if len(problems) > 5 else ""
        self.notify(f"{listed}{more}\nThese files are kept as they are, in {self.store.root}.",
                    title=f"{len(problems)} saved files could not be read", severity="warning", timeout=15)

    async def _resume(self: ChatApp, query: str) -> None:
        try:
            if query:
                conversation, skipped = self.store.find(query), []
            else:
                conversation, skipped = self.store.latest_readable()
        except MinionsError as err:
            self.notify(str(err), title="--resume", severity="error", timeout=15)
            return
        except Exception as err:  # a bug: a message and the log file, never a crash
            self.notify(unexpected(err, "resuming"), title="--resume", severity="error", timeout=15)
            return
        if skipped:
            self.notify(skipped_note(skipped, conversation), title="--resume", severity="warning", timeout=15)
        elif conversation is None:
            self.notify("No saved conversation to resume; starting a new one.")
        if conversation is not None:
            await self._open_conversation(conversation)

    async def _open_conversation(self: ChatApp, conversation: Conversation) -> None:
        """Show a conversation and make it current; the engine forgets its cache. A last
        question that got no reply goes back into the prompt box, to send again."""
        self.conversation = conversation
        question = None if self.prompt.text else conversation.unanswered()  # never over what is typed
        if question is not None:
            self.prompt.text = question
            self.prompt.move_cursor(self.prompt.document.end)
        log = self.chat_log
        keep = [w for w in (self._loading, self._waiting) if w is not None]  # a waiting question joins this one
        await log.remove_children([w for w in log.children if w not in keep])
        widgets: list[Any] = []
        for message in conversation.messages:
            if message["role"] == "user":
                widgets.append(UserMessage(message["content"]))
            elif message["role"] == "assistant":
                label = conversation.profile or "target"
                widgets.append(AssistantMessage(message["content"], label=label, raw=self.options.raw))
        if widgets:
            await log.mount_all(widgets, before=0 if keep else None)
        history = self.prompt.sent_history
        asked = [m["content"] for m in conversation.messages if m["role"] == "user"]
        history.extend(q for q in asked if q not in history)
        if self.engine is not None and hasattr(self.engine, "reset"):
            self.engine.reset()
        self.session_stats = GenerationStats()
        self.query_one(StatsPanel).show(GenerationStats(), title="No reply yet")
        self.query_one(TreePanel).show(None, 0)
        self._update_subtitle()
        log.anchor()
        if conversation.messages:
            self.notify(f"Loaded '{conversation.display_title()}' ({len(conversation.messages)} messages).")
        if question is not None:
            self.notify("The last question got no reply: it is back in the box (Enter sends it).")


def _profiles_text(current: str) -> str:
    lines = [f"current profile: {current}"]
    try:
        from minions_local.profile import available_profiles
    except ImportError:
        lines.append("(the profile list is not available in this build)")
    else:
        try:
            names = available_profiles()
        except MinionsError as err:
            names = []
            lines.append(str(err))
        if names:
            lines.append("available: " + ", ".join(names))
    lines.append("Switch with /profile NAME or /profile path/to/profile.toml.")
    return "\n".join(lines)
