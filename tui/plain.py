"""`minions-chat --plain`: a line REPL on a terminal, a one-shot completion in a pipe.

With stdin a pipe, the whole input is one user message (`Engine.stream_chat`) when
the model has a chat template, else the prompt of a plain completion (`Engine.stream`),
and only the reply goes to stdout; with --resume it is the next message of the saved
conversation, and the reply is saved to it. On a terminal it is a
chat (`Engine.stream_chat`); progress, the memory plan and stats go to stderr.
Generation runs on a helper thread so that Ctrl+C stops it between two target
passes instead of tearing through the engine; a second Ctrl+C quits.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any, TextIO

from minions_local.core.errors import MinionsError
from minions_local.core.events import LoadProgress
from minions_local.tui.bridge import EngineFactory, Outcome, deferred, drive, request_stop, unexpected
from minions_local.tui.commands import CommandError, is_command, parse_command
from minions_local.tui.stats import format_bytes
from minions_local.tui.store import Conversation, ConversationStore, is_unicode

PLAIN_HELP = (
    "Type a message and press Enter; end a line with \\ to continue it, or wrap lines in \"\"\".\n"
    "/new  /temp 0.7  /max 512  /system TEXT|off  /save [title]  /help  /quit\n"
    "Ctrl+C stops a reply, Ctrl+C twice or Ctrl+D quits."
)


@dataclass
class PlainIO:
    stdin: TextIO
    stdout: TextIO
    stderr: TextIO
    closed: bool = False
    """The reader of stdout went away (`| head`): stop generating, exit quietly."""

    def out(self, text: str) -> None:
        if self.closed:
            return
        try:
            self.stdout.write(text)
            self.stdout.flush()
        except BrokenPipeError:
            self.closed = True
            if self.stdout is sys.stdout:  # no "Exception ignored" noise at exit
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())

    def err(self, text: str, end: str = "\n") -> None:
        self.stderr.write(text + end)
        self.stderr.flush()


def run_plain(
    *,
    profile: str,
    overrides: dict[str, Any],
    conversation: Conversation,
    engine_factory: EngineFactory,
    store: ConversationStore,
    io: PlainIO,
    resumed: bool = False,
) -> int:
    if not io.stdin.isatty():
        prompt = _read_piped(io)  # read before loading: an empty pipe fails fast
        if prompt is None:
            return 2
        if not prompt.strip():
            problem = _profile_problem(profile, overrides)  # a wrong --profile is the news, not the empty pipe
            io.err(f"minions-chat: {problem or 'nothing to complete on stdin.'}")
            return 1 if problem else 2
        engine = _load(profile, overrides, engine_factory, io)
        if engine is None:
            return 1
        _say_choices(engine, io)
        if resumed:
            return _continue(engine, prompt, conversation, store, io)
        return _complete(engine, prompt, conversation, io)
    engine = _load(profile, overrides, engine_factory, io)
    if engine is None:
        return 1
    io.err(engine.memory_plan_text())
    io.err(PLAIN_HELP)
    if resumed and conversation.messages:
        io.err(f"(resumed '{conversation.display_title()}' · {len(conversation.messages)} messages)")
    _take_back_unanswered(conversation, io)
    try:
        return _repl(engine, conversation, store, io)
    except KeyboardInterrupt:
        io.err("")
        return 130


def _say_choices(engine: Any, io: PlainIO) -> None:
    """What was chosen for a target named on the command line (memory, minions), on
    stderr; the REPL and the app show it within the memory plan."""
    plan = getattr(engine, "memory_plan", None)
    for line in plan.choices() if hasattr(plan, "choices") else []:
        io.err(f"minions-chat: {line.strip()}")


def _read_piped(io: PlainIO) -> str | None:
    """All of stdin, less one final newline; None (said on stderr) when it is not UTF-8."""
    try:
        text = io.stdin.read()
    except UnicodeDecodeError as err:
        _not_utf8(io, err.object[err.start])
        return None
    if not is_unicode(text):  # undecodable bytes kept as surrogates (errors="surrogateescape")
        _not_utf8(io, next(ord(c) - 0xDC00 for c in text if 0xDC80 <= ord(c) <= 0xDCFF))
        return None
    return text[:-1] if text.endswith("\n") else text


def _not_utf8(io: PlainIO, byte: int) -> None:
    io.err(f"minions-chat: stdin is not UTF-8 text (it holds the byte 0x{byte:02x}). Convert it first, "
           f"e.g. `iconv -f latin1 -t utf-8 FILE | minions-chat --plain`.")


def _profile_problem(profile: str, overrides: dict[str, Any]) -> str | None:
    """What is wrong with the profile, found without loading any weights (None: nothing)."""
    from minions_local.profile.loader import load_profile

    try:
        load_profile(profile, **overrides)
    except MinionsError as err:
        return str(err)
    except OSError as err:
        return f"the profile {profile} cannot be read: {err.strerror or err}"
    return None


def _take_back_unanswered(conversation: Conversation, io: PlainIO) -> None:
    """A resumed conversation that ends in a question without a reply (the chat stopped
    mid-reply) gets it back, so that the next message is not a second question in a row."""
    question = conversation.unanswered()
    if question is not None:
        first = question.strip().splitlines()[0] if question.strip() else ""
        shown = first[:60] + ("…" if len(first) > 60 or "\n" in question.strip() else "")
        io.err(f"(the last question had no reply and is taken back: \"{shown}\"; send it again if you like)")


def _save(store: ConversationStore, conversation: Conversation, io: PlainIO) -> None:
    try:
        store.save(conversation)
    except MinionsError as err:
        io.err(f"minions-chat: {err}")


def _record(conversation: Conversation, outcome: Outcome) -> None:
    """The reply joins the conversation; a turn that brought nothing back takes its question back."""
    if outcome.text.strip() or outcome.reason not in ("cancelled", "error"):
        conversation.messages.append({"role": "assistant", "content": outcome.text})
    else:
        conversation.messages.pop()


def _load(profile: str, overrides: dict[str, Any], factory: EngineFactory, io: PlainIO) -> Any:
    show = io.stderr.isatty()

    def progress(p: LoadProgress) -> None:
        if show:
            share = p.done_bytes / p.total_bytes if p.total_bytes else 1.0
            io.err(
                f"\rloading {p.model} → {p.tier}: {share:4.0%} "
                f"({format_bytes(p.done_bytes)} / {format_bytes(p.total_bytes)})\x1b[K",
                end="",
            )

    try:
        engine = factory(profile, progress=progress, **overrides)
    except MinionsError as err:
        io.err(("\r\x1b[K" if show else "") + f"minions-chat: {err}")
        return None
    except Exception as err:
        io.err(("\r\x1b[K" if show else "") + "minions-chat: " + unexpected(err, "loading"))
        return None
    if show:
        io.err("\r\x1b[K", end="")
    return engine


def _generate(engine: Any, start: Callable[[], Any], io: PlainIO) -> Outcome:
    """Drive the stream on a helper thread; the first Ctrl+C asks it to stop."""
    cancel = threading.Event()
    box: list[Outcome] = []
    worker = threading.Thread(
        target=lambda: box.append(
            drive(deferred(start), on_text=io.out, cancelled=lambda: cancel.is_set() or io.closed,
                  on_notice=lambda text: io.err(f"minions-chat: {text}"))
        ),
        name="minions-generate",
        daemon=True,
    )
    worker.start()
    while worker.is_alive():
        try:
            worker.join(0.1)
        except KeyboardInterrupt:
            if cancel.is_set():
                raise
            cancel.set()
            request_stop(engine)
            io.err(" [stopping…]", end="")
    return box[0]


def _complete(engine: Any, prompt: str, conversation: Conversation, io: PlainIO) -> int:
    options = dict(max_new_tokens=conversation.max_new_tokens, temperature=conversation.temperature)
    # An instruct model answers a piped question only through its chat template (raw,
    # SmolLM2-Instruct ends "What is ...?" at once); a base model completes the text.
    if getattr(getattr(engine, "tokenizer", None), "chat_template", None):
        messages = [{"role": "user", "content": prompt}]
        start = lambda: engine.stream_chat(messages, **options)  # noqa: E731
    else:
        start = lambda: engine.stream(prompt, **options)  # noqa: E731
    try:
        outcome = _generate(engine, start, io)
    except KeyboardInterrupt:
        return 130
    return _finish(outcome, io)


def _finish(outcome: Outcome, io: PlainIO) -> int:
    """End a piped reply on a newline; its error (if any) goes to stderr as exit 1."""
    if io.closed:
        return 0
    if not outcome.text.endswith("\n"):
        io.out("\n")
    if outcome.error:
        io.err(f"minions-chat: {outcome.error}")
        return 1
    return 0


def _continue(engine: Any, prompt: str, conversation: Conversation, store: ConversationStore, io: PlainIO) -> int:
    """A piped message as the next turn of a resumed conversation; the turn is saved."""
    _take_back_unanswered(conversation, io)
    conversation.messages.append({"role": "user", "content": prompt})
    _save(store, conversation, io)  # the question is on disk before the reply starts
    messages = conversation.engine_messages()
    try:
        outcome = _generate(
            engine,
            lambda: engine.stream_chat(messages, max_new_tokens=conversation.max_new_tokens,
                                       temperature=conversation.temperature),
            io,
        )
    except KeyboardInterrupt:
        return 130
    _record(conversation, outcome)
    _save(store, conversation, io)
    return _finish(outcome, io)


def _read_line(io: PlainIO, prompt: str) -> str:
    if io.stdin is sys.stdin and io.stdout is sys.stdout:
        return input(prompt)  # readline editing and history on a real terminal
    io.out(prompt)
    line = io.stdin.readline()
    if not line:
        raise EOFError
    return line.rstrip("\n")


def _read_message(io: PlainIO) -> str | None:
    """One message; a trailing backslash continues it on the next line, and a block
    between two triple quotes is one message (as in Ollama's REPL). None at EOF."""
    lines: list[str] = []
    prompt = ">>> "
    quoted = False
    while True:
        try:
            line = _read_line(io, prompt)
        except EOFError:
            return None if not lines else "\n".join(lines)
        if not lines and line.startswith('"""'):
            quoted, line = True, line[3:]
        if quoted:
            if line.endswith('"""'):
                lines.append(line[:-3])
                return "\n".join(lines).strip("\n")
            lines.append(line)
            prompt = "... "
            continue
        if line.endswith("\\"):
            lines.append(line[:-1])
            prompt = "... "
            continue
        lines.append(line)
        return "\n".join(lines)


def _repl(engine: Any, conversation: Conversation, store: ConversationStore, io: PlainIO) -> int:
    try:
        import readline  # noqa: F401  (gives input() history and line editing)
    except ImportError:
        pass
    last_interrupt = -10.0
    while True:
        try:
            text = _read_message(io)
            if text is not None and not is_unicode(text):
                raise UnicodeError
        except UnicodeError:  # bytes the terminal's encoding does not decode
            io.err("(that line is not UTF-8 text, so it was not sent: check the terminal's encoding)")
            continue
        except KeyboardInterrupt:
            if time.monotonic() - last_interrupt < 2.0:
                io.err("")
                return 130
            last_interrupt = time.monotonic()
            io.err("\n(Ctrl+C again, Ctrl+D or /quit leaves)")
            continue
        if text is None:
            io.err("")
            return 0
        if not text.strip():
            continue
        if is_command(text.strip()):
            if _command(text.strip(), engine, conversation, store, io) == "quit":
                return 0
            continue
        if text.startswith("//"):
            text = text[1:]
        conversation.messages.append({"role": "user", "content": text})
        _save(store, conversation, io)  # the question is on disk before the reply starts
        messages = conversation.engine_messages()
        outcome = _generate(
            engine,
            lambda: engine.stream_chat(
                messages,
                max_new_tokens=conversation.max_new_tokens,
                temperature=conversation.temperature,
            ),
            io,
        )
        _record(conversation, outcome)
        if not outcome.text.endswith("\n"):
            io.out("\n")
        s = outcome.stats
        note = "stopped · " if outcome.reason == "cancelled" else ""
        io.err(
            f"[{note}{s.new_tokens} tokens · {s.tokens_per_pass:.2f} tok/pass · "
            f"{s.tokens_per_second:.1f} tok/s]"
        )
        if outcome.error:
            io.err(f"minions-chat: {outcome.error}")
        _save(store, conversation, io)


def _command(text: str, engine: Any, conversation: Conversation, store: ConversationStore, io: PlainIO) -> str:
    try:
        command = parse_command(text)
    except CommandError as err:
        io.err(str(err))
        return ""
    name = command.name
    if name == "quit":
        return "quit"
    if name == "help":
        io.err(PLAIN_HELP)
    elif name == "new":
        conversation.messages.clear()
        conversation.id = Conversation().id
        conversation.title = ""
        engine.reset()
        io.err("(new conversation)")
    elif name == "temp":
        conversation.temperature = float(command.value or 0.0)
        io.err(f"(temperature {conversation.temperature:g})")
    elif name == "max":
        conversation.max_new_tokens = int(command.value or 1)
        io.err(f"(at most {conversation.max_new_tokens} new tokens)")
    elif name == "system":
        if command.arg.lower() in ("off", "clear", "none", "-"):
            conversation.system = ""
        elif command.arg:
            conversation.system = command.arg
        io.err(f"(system prompt: {conversation.system or 'none'})")
    elif name == "save":
        conversation.title = command.arg or conversation.title
        try:
            io.err(f"(saved to {store.save(conversation)})")
        except MinionsError as err:
            io.err(str(err))
    else:
        io.err(f"/{name} is only in the full app (run minions-chat without --plain).")
    return ""
