"""Key actions of `ChatApp` (a mixin): stop, Ctrl+C, quit, paging and the panels.

The bindings themselves, and `check_action`, stay on the app class.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from minions_local.tui.bridge import request_stop
from minions_local.tui.widgets import StatsPanel, TreePanel

if TYPE_CHECKING:
    from minions_local.tui.app import ChatApp

QUIT_WINDOW = 2.0
"""Seconds within which a second Ctrl+C quits."""


class KeyActions:
    def action_stop(self: ChatApp) -> None:
        if self._waiting is not None:
            self._take_back_waiting()
            return
        if self.generating and self._generation is not None:
            self._generation.cancel()
            request_stop(self.engine)
            if self._reply is not None:
                self._reply.footer.update("stopping after this pass…")

    def action_interrupt(self: ChatApp) -> None:
        if not self.generating and self._copy_selection():
            return
        now = time.monotonic()
        if now - self._last_interrupt < QUIT_WINDOW:
            self.action_quit_now()
            return
        self._last_interrupt = now
        if self.generating:
            self.action_stop()
            self.notify("Stopped. Ctrl+C again quits.", timeout=QUIT_WINDOW)
        else:
            self.notify("Press Ctrl+C again (or Ctrl+Q) to quit.", timeout=QUIT_WINDOW)

    def _copy_selection(self: ChatApp) -> bool:
        """Ctrl+C with text selected (with the mouse, or in the prompt) copies it."""
        selected = self.screen.get_selected_text()
        if not selected and self.focused is self.prompt:
            selected = self.prompt.selected_text
        if not selected:
            return False
        self.copy_to_clipboard(selected)
        self.screen.clear_selection()
        self.notify(f"Copied {len(selected)} characters.", timeout=QUIT_WINDOW)
        return True

    def action_quit_now(self: ChatApp) -> None:
        if self.generating:
            request_stop(self.engine)
            if self._reply is not None and self._reply.text.strip():
                # The reply's own end will not be seen: keep what streamed so far.
                self.conversation.messages.append({"role": "assistant", "content": self._reply.text})
                self._autosave()
        self.workers.cancel_all()
        self.exit()

    async def action_quit(self: ChatApp) -> None:
        self.action_quit_now()

    def action_scroll_chat(self: ChatApp, direction: int) -> None:
        """Page through the conversation without leaving the prompt; paging back to
        the end makes the view follow new text again."""
        if direction < 0:
            self.chat_log.scroll_page_up(animate=False)
        else:
            self.chat_log.scroll_page_down(animate=False)

    def action_toggle_stats(self: ChatApp) -> None:
        panel = self.query_one(StatsPanel)
        panel.display = not panel.display

    def action_toggle_tree(self: ChatApp) -> None:
        panel = self.query_one(TreePanel)
        panel.display = not panel.display
        if panel.display:
            panel.refresh_tree()
