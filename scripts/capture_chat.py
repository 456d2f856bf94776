"""Capture the chat's screen after a real reply (the README's picture).

    python scripts/capture_chat.py [--profile cpu-demo-disk] [--out docs/chat-cpu-demo-disk.svg]

Runs minions-chat headless (Textual's Pilot) on the real engine, asks one question,
waits for the whole reply and saves the screen as SVG.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from minions_local.tui.app import ChatApp, ChatOptions
from minions_local.tui.store import ConversationStore

QUESTION = "Write a Python function that checks whether a string is a palindrome."


async def capture(profile: str, out: Path, question: str, size: tuple[int, int]) -> None:
    with tempfile.TemporaryDirectory() as data:
        app = ChatApp(ChatOptions(profile=profile, cursor_blink=False, max_new_tokens=160),
                      store=ConversationStore(Path(data)))
        async with app.run_test(size=size) as pilot:
            deadline = time.monotonic() + 300
            while app.engine is None:
                if time.monotonic() > deadline or app._load_failed:
                    raise SystemExit("the engine did not load")
                await pilot.pause(0.2)
            app.prompt.text = question
            await pilot.press("enter")
            await pilot.pause(0.5)
            while app.generating:
                await pilot.pause(0.2)
            await app.workers.wait_for_complete()
            await pilot.pause(0.5)
            out.parent.mkdir(parents=True, exist_ok=True)
            app.save_screenshot(filename=out.name, path=str(out.parent))
    print(f"saved {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="cpu-demo-disk")
    parser.add_argument("--out", type=Path, default=Path("docs/chat-cpu-demo-disk.svg"))
    parser.add_argument("--question", default=QUESTION)
    args = parser.parse_args()
    asyncio.run(capture(args.profile, args.out, args.question, (110, 42)))


if __name__ == "__main__":
    main()
