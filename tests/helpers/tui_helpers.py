"""Shared helpers for the minions-chat tests (the fake engine lives in fake_engine.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from tests.helpers.fake_engine import FakeEngine, FakeFactory

from minions_local.tui.app import ChatApp, ChatOptions
from minions_local.tui.store import ConversationStore


def make_app(
    tmp_path: Path,
    engine: FakeEngine | None = None,
    *,
    factory: FakeFactory | None = None,
    **options: Any,
) -> ChatApp:
    factory = factory or FakeFactory(engine or FakeEngine())
    return ChatApp(
        ChatOptions(cursor_blink=False, **options),
        engine_factory=factory,
        store=ConversationStore(tmp_path / "conversations"),
    )


async def until(pilot: Any, predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    """Let the app run until `predicate()` holds (polling in small steps)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the app")
        await pilot.pause(0.01)


async def error_shown(pilot: Any) -> Any:
    """Wait until the error screen is current *and* composed, and return it.

    The screen becomes `app.screen` when pushed, a tick before its message
    widget is mounted; querying it in between is a race (it failed in CI)."""
    from minions_local.tui.screens import ErrorScreen

    app = pilot.app
    await until(pilot, lambda: isinstance(app.screen, ErrorScreen) and bool(app.screen.query("#error-message")))
    await pilot.pause()
    return app.screen


async def ready(pilot: Any) -> None:
    """Wait for the engine to load."""
    app = pilot.app
    await until(pilot, lambda: app.engine is not None or app._load_failed)
    await pilot.pause()


async def send(pilot: Any, text: str) -> None:
    """Put `text` in the prompt, press Enter and wait for the reply to finish."""
    app = pilot.app
    app.prompt.text = text
    app.prompt.move_cursor(app.prompt.document.end)
    await pilot.press("enter")
    await until(pilot, lambda: not app.generating)
    await app.workers.wait_for_complete()
    await pilot.pause()


async def start(pilot: Any, text: str, engine: FakeEngine) -> None:
    """Send `text` and wait until the reply is under way, held at the fake engine's
    gate (FakeEngine(gate_after=N)): the in-flight half of send()."""
    pilot.app.prompt.text = text
    await pilot.press("enter")
    await until(pilot, engine.waiting.is_set)


def notes(app: ChatApp) -> list[str]:
    """Text of the app's current notifications."""
    return [n.message for n in app._notifications]


def text_of(widget: Any) -> str:
    """The plain text a Static/Label shows (rich renderables rendered without style)."""
    from io import StringIO

    from rich.console import Console

    content = widget.content
    if isinstance(content, str):
        return content
    console = Console(file=StringIO(), width=200, color_system=None, legacy_windows=False)
    with console.capture() as capture:
        console.print(content)
    return capture.get()
