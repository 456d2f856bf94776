"""Modal screens: a readable error with what to do next, and the conversation picker."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Label, OptionList, Static
from textual.widgets.option_list import Option

from minions_local.tui.store import Conversation


class ErrorScreen(ModalScreen[str]):
    """Shows `str(error)` (never a traceback). Dismisses with 'quit' or 'close'."""

    BINDINGS = [
        Binding("escape", "dismiss('close')", "Close"),
        Binding("q", "dismiss('quit')", "Quit"),
    ]

    def __init__(self, title: str, message: str, *, hint: str = "") -> None:
        super().__init__()
        self.error_title = title
        self.message = message
        self.hint = hint

    def compose(self) -> ComposeResult:
        with Vertical(id="error-box") as box:
            box.border_title = "error"
            yield Label(self.error_title, id="error-title")
            yield Static(self.message, id="error-message", markup=False)
            if self.hint:
                yield Static(self.hint, id="error-hint", markup=False)
            with Horizontal(id="error-buttons"):
                yield Button("Close (Esc)", id="close", variant="primary")
                yield Button("Quit (q)", id="quit", variant="error")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id or "close")


class ConversationPicker(ModalScreen[Conversation | None]):
    """Lists saved conversations, newest first; Enter loads one, Esc goes back."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Back")]

    def __init__(self, conversations: list[Conversation]) -> None:
        super().__init__()
        self.conversations = conversations

    def compose(self) -> ComposeResult:
        with Vertical(id="picker-box") as box:
            box.border_title = "saved conversations"
            options = [
                Option(
                    f"{i + 1:>2}. {c.display_title()}  ·  {len(c.messages)} messages  ·  "
                    f"{c.updated[:16].replace('T', ' ')}",
                    id=c.id,
                )
                for i, c in enumerate(self.conversations)
            ]
            yield OptionList(*options, id="picker-list")
            yield Label("Enter loads · Esc goes back", classes="picker-hint")

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        chosen = next(c for c in self.conversations if c.id == event.option.id)
        self.dismiss(chosen)
