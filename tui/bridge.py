"""The thin layer between the UI and the engine, shared by the app and `--plain`.

`load_engine` imports `minions_local.engine` (and so torch) only when called, on
the thread that loads. `drive` runs one stream of events to its end, checking a
cancellation flag between events, and always closes the generator.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from pathlib import Path
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from minions_local.core.errors import MinionsError
from minions_local.core.events import (DoneEvent, Generation, LoadProgress, NoticeEvent, StepEvent, TokenEvent,
                                      TreeSnapshot)
from minions_local.tui.stats import GenerationStats

log = logging.getLogger("minions_local.tui")

DEFAULT_PROFILE = "cpu-demo"

EngineFactory = Callable[..., Any]
"""`factory(profile, *, progress, **overrides) -> engine`; `Engine.from_profile` fits."""


def load_engine(profile: str, *, progress: Callable[[LoadProgress], None], **overrides: Any) -> Any:
    """The real factory: `Engine.from_profile`, imported lazily."""
    from minions_local.planning.target_read_ahead import read_named_profile_target_ahead

    read_named_profile_target_ahead(profile, **overrides)  # a GGUF held in RAM: read while torch is imported
    try:
        from minions_local.engine import Engine
    except ImportError as err:
        raise MinionsError(
            f"The inference engine could not be imported ({err}). Install minions-local "
            "with its dependencies (torch first: `pip install torch`, then "
            "`pip install minions-local`)."
        ) from err
    _quiet_libraries()
    return Engine.from_profile(profile, progress=progress, **overrides)


def _quiet_libraries() -> None:
    """Library progress bars would draw over the app (and clutter --plain's stderr);
    the engine reports loading through `progress` instead."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()


def overrides_from(target: str | None, minions: list[str] | None) -> dict[str, Any]:
    """Only the overrides the user gave, so the profile's own values stand otherwise."""
    out: dict[str, Any] = {}
    if target:
        out["target"] = target
    if minions:
        out["minions"] = list(minions)
    return out


def log_path() -> Path:
    import platformdirs

    return Path(platformdirs.user_log_dir("minions-local", appauthor=False)) / "minions-chat.log"


def _file_logger() -> logging.Logger:
    """Tracebacks go to a file: printing them would tear up the full-screen app."""
    if not log.handlers:
        log.propagate = False
        try:
            path = log_path()
            path.parent.mkdir(parents=True, exist_ok=True)
            handler: logging.Handler = logging.FileHandler(path, encoding="utf-8")
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        except OSError:
            handler = logging.NullHandler()
        log.addHandler(handler)
    return log


def unexpected(err: BaseException, doing: str) -> str:
    """A readable message for an error that is not a `MinionsError` (a bug); the
    traceback goes to the log file, not to the screen."""
    _file_logger().error("unexpected error while %s", doing, exc_info=err)
    return (
        f"Unexpected error while {doing}: {type(err).__name__}: {err}. "
        f"This is a bug in minions-local; the details are in {log_path()}."
    )


def deferred(start: Callable[[], Iterator[Any]]) -> Iterator[Any]:
    """Open the engine's stream lazily, so that request errors the engine raises
    before any work (context overflow, bad arguments) reach `drive` like the rest;
    closing this generator closes the engine's."""
    yield from start()


def request_stop(engine: Any) -> None:
    """Also tell the engine itself (when it can hear it) so a stop during prefill
    does not wait for a first pass."""
    cancel = getattr(engine, "cancel", None)
    if callable(cancel):
        cancel()


class DaemonExecutor(concurrent.futures.ThreadPoolExecutor):
    """Runs each job on its own daemon thread and never waits at shutdown (a
    ThreadPoolExecutor only because asyncio accepts nothing else as default).

    Textual runs thread workers on the event loop's default executor, which asyncio
    joins when the app exits: a model load or a target pass, which cannot be
    interrupted, would then hold the terminal after the UI is gone. While the app
    runs, stops still land at the next pass; once the user quits, nothing waits.
    """

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                result = fn(*args, **kwargs)
            except BaseException as err:
                future.set_exception(err)
            else:
                future.set_result(result)

        threading.Thread(target=run, name="minions-chat-worker", daemon=True).start()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Nothing to wait for: the threads are daemons."""


@dataclass
class Outcome:
    text: str
    reason: str
    """'length', 'stop', 'cancelled' or 'error'."""
    stats: GenerationStats
    generation: Generation | None = None
    error: str | None = None


def drive(
    events: Iterator[Any],
    *,
    on_text: Callable[[str], None],
    on_step: Callable[[GenerationStats, TreeSnapshot | None], None] = lambda s, t: None,
    cancelled: Callable[[], bool] = lambda: False,
    on_notice: Callable[[str], None] = lambda text: None,
) -> Outcome:
    """Consume one generation; stop (closing the generator) as soon as `cancelled()`.

    The engine finishes the target pass it is in, so a stop lands within one pass.
    """
    stats = GenerationStats()
    parts: list[str] = []
    outcome: Outcome | None = None
    try:
        for event in events:
            if isinstance(event, TokenEvent):
                if event.text:
                    parts.append(event.text)
                    on_text(event.text)
            elif isinstance(event, NoticeEvent):  # e.g. the target reloaded after losing an RPC server
                on_notice(event.text)
            elif isinstance(event, StepEvent):
                stats.add(event.record)
                on_step(stats.copy(), event.record.tree)
            elif isinstance(event, DoneEvent):
                generation = event.generation
                outcome = Outcome("".join(parts), generation.finish_reason, stats, generation)
                break
            # A pass ends with its StepEvent: stopping there keeps its stats record.
            if isinstance(event, StepEvent) and cancelled():
                outcome = Outcome("".join(parts), "cancelled", stats)
                break
        else:
            outcome = Outcome("".join(parts), "stop", stats)
    except MinionsError as err:
        outcome = Outcome("".join(parts), "error", stats, error=str(err))
    except Exception as err:  # a bug: keep the partial reply, show a message, log the rest
        outcome = Outcome("".join(parts), "error", stats, error=unexpected(err, "generating"))
    finally:
        close = getattr(events, "close", None)
        if close is not None:
            try:
                close()
            except Exception as err:
                _file_logger().error("closing the generation failed", exc_info=err)
    assert outcome is not None
    return outcome
