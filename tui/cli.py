"""`minions-chat`: parse the command line, then run the app, the plain REPL, or a report."""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from minions_local.core.errors import MinionsError
from minions_local.profile.split import add_rpc_arguments, rpc_overrides
from minions_local.tui.bridge import DEFAULT_PROFILE, EngineFactory, load_engine, overrides_from

DESCRIPTION = """\
Chat with a big local model that several small 'minion' models speed up (lossless
speculative decoding). Opens a terminal app; with --plain, or when stdin/stdout is
not a terminal, a line-based REPL that streams to stdout
(`echo "def f(" | minions-chat --plain` prints the completion and exits)."""


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if not 0.0 <= value <= 2.0:
        raise argparse.ArgumentTypeError("temperature must be between 0 and 2 (0 is greedy)")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="minions-chat", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    model = p.add_argument_group("model")
    model.add_argument("--profile", "-p", default=DEFAULT_PROFILE, metavar="NAME|PATH",
                       help=f"hardware + model profile: a shipped name or a .toml path "
                            f"(default: {DEFAULT_PROFILE})")
    model.add_argument("--target", metavar="PATH", help="use this target checkpoint instead of the profile's")
    model.add_argument("--minion", metavar="PATH", action="append", dest="minions",
                       help="use this minion instead of the profile's (repeat for several)")
    add_rpc_arguments(model)
    model.add_argument("--plan", action="store_true",
                       help="print the profile's memory plan and exit (loads no weights)")
    model.add_argument("--list-profiles", action="store_true", help="list the shipped profiles and exit")
    gen = p.add_argument_group("generation")
    gen.add_argument("--temp", type=_temperature, dest="temperature", metavar="T",
                     help="sampling temperature, 0 = greedy (default: 0)")
    gen.add_argument("--max", type=_positive, dest="max_new_tokens", metavar="N",
                     help="most new tokens per reply (default: 256)")
    gen.add_argument("--system", metavar="TEXT", help="system prompt for the conversation")
    gen.add_argument("--raw", nargs="?", const="", metavar="LANG",
                     help="show replies verbatim instead of as Markdown (highlighted as LANG if given)")
    chat = p.add_argument_group("conversation")
    chat.add_argument("--resume", nargs="?", const="", metavar="ID|N|TITLE",
                      help="continue the latest saved conversation (or the one named); in a pipe, the "
                           "piped text is its next message and the reply is saved to it")
    chat.add_argument("--plain", action="store_true", help="line-based REPL instead of the full-screen app")
    return p


def _report(kind: str, profile: str, out: TextIO, err: TextIO, *, target: str | None = None,
            minions: list[str] | None = None, rpc: dict[str, Any] | None = None) -> int:
    """--plan and --list-profiles: the profile package's report, no weights loaded
    (--target and --minion override the profile's models in the plan, as in the chat)."""
    from minions_local.planning import cli

    try:
        if kind == "plan":
            out.write(cli.plan_report(profile, target=target, minions=minions, **(rpc or {})).rstrip("\n") + "\n")
        else:
            out.write("\n".join(cli.available_profiles()) + "\n")
    except MinionsError as error:
        err.write(f"minions-chat: {error}\n")
        return 1
    return 0


def _resume(store: Any, query: str, stderr: TextIO) -> Any:
    """The conversation `--resume` names (MinionsError if none can be used), or the newest
    readable one, saying which newer files it skipped."""
    from minions_local.tui.store import skipped_note

    if query:
        return store.find(query)
    conversation, skipped = store.latest_readable()
    if skipped:
        stderr.write(f"minions-chat: {skipped_note(skipped, conversation)}\n")
    elif conversation is None:
        stderr.write("minions-chat: no saved conversation to resume; starting a new one.\n")
    return conversation


def main(
    argv: list[str] | None = None,
    *,
    engine_factory: EngineFactory = load_engine,
    store: Any = None,
    stdin: TextIO | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    args = build_parser().parse_args(argv)
    if args.plan:
        return _report("plan", args.profile, stdout, stderr, target=args.target, minions=args.minions,
                       rpc=rpc_overrides(args))
    if args.list_profiles:
        return _report("list-profiles", args.profile, stdout, stderr)

    from minions_local.tui.store import Conversation, ConversationStore

    store = store or ConversationStore()
    overrides = {**overrides_from(args.target, args.minions), **rpc_overrides(args)}
    if args.plain or not stdin.isatty() or not stdout.isatty():
        from minions_local.tui.plain import PlainIO, run_plain

        conversation = Conversation(profile=args.profile)
        if args.resume is not None:
            try:
                conversation = _resume(store, args.resume, stderr) or conversation
            except MinionsError as error:
                stderr.write(f"minions-chat: {error}\n")
                return 1
        if args.temperature is not None:
            conversation.temperature = args.temperature
        if args.max_new_tokens is not None:
            conversation.max_new_tokens = args.max_new_tokens
        if args.system is not None:
            conversation.system = args.system
        try:
            return run_plain(
                profile=args.profile,
                overrides=overrides,
                conversation=conversation,
                engine_factory=engine_factory,
                store=store,
                io=PlainIO(stdin, stdout, stderr),
                resumed=args.resume is not None,
            )
        except KeyboardInterrupt:  # Ctrl+C while loading: leave quietly
            stderr.write("\n")
            return 130

    from minions_local.tui.app import ChatApp, ChatOptions

    options = ChatOptions(
        profile=args.profile,
        overrides=overrides,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        system=args.system,
        raw=args.raw,
        resume=args.resume,
    )
    app = ChatApp(options, engine_factory=engine_factory, store=store)
    app.run()
    return app.return_code or 0  # 1 after a crash (see ChatApp._fatal_error)


if __name__ == "__main__":
    sys.exit(main())
