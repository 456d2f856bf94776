"""The same request, the same reply, through a real `minions-serve` on the real model
(SmolLM2 with its minions), whatever the server served before it or beside it.

The reference for a greedy reply is the target alone reading that chat from an empty
cache. The server meets the caches its earlier requests left: the same chats one at a
time in order, again in reverse, each after an unrelated long conversation, and all at
once. A seeded sampled request gives the same text on a fresh server, after all that,
and beside other requests. Streamed from disk in bfloat16, resident in float32."""

from __future__ import annotations

import concurrent.futures
import signal

import openai
import pytest

from benchmarks.reference import profile_copy, reference_replies
from tests.server.process import start_server

pytestmark = pytest.mark.realmodel

CHATS = [[{"role": "user", "content": text}] for text in (
    "Why is the sky blue? Answer in two sentences.",
    "How do I keep basil alive on a windowsill?",
    "Write a haiku about a train.",
    "What is the capital of Australia?",
)]
LONG = [{"role": "user", "content": "Here are my notes; which three tasks matter most?\n" + "\n".join(
    f"- Day {d}: answered mail, fixed the build, met the team about the Q{d % 4 + 1} plan." for d in range(1, 25))}]
SEEDED = {"messages": [{"role": "user", "content": "Tell me a short story about a fox."}], "temperature": 0.9,
          "top_p": 0.95, "seed": 4321}
TOKENS = 24


@pytest.mark.parametrize("name, dtype", [("cpu-demo-disk", "bfloat16"), ("cpu-demo", "float32")])
def test_every_reply_is_the_target_alone_whatever_ran_before_or_beside_it(converted, tmp_path, name, dtype):
    profile = profile_copy(name, tmp_path, dtype=dtype, disk_path=tmp_path / "offload")
    reference = reference_replies(profile, CHATS, TOKENS)
    server = start_server("--parallel", str(len(CHATS)), "--queue", "8", profile=profile, minions=(),
                          one_thread=False, cwd=tmp_path, timeout=300)
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=300)

        def ask(messages, **kwargs) -> str:
            kwargs = {"max_tokens": TOKENS, "temperature": 0, **kwargs}
            return client.chat.completions.create(model="m", messages=messages, **kwargs).choices[0].message.content

        def seeded() -> str:
            return ask(SEEDED["messages"], **{k: v for k, v in SEEDED.items() if k != "messages"})

        first_seeded = seeded()  # on a fresh server
        order = list(range(len(CHATS)))
        for mode, indices, before in (("in order", order, None), ("reversed", order[::-1], None),
                                      ("interleaved", order, LONG)):
            for i in indices:
                if before is not None:
                    ask(before)
                assert ask(CHATS[i]) == reference[i], f"{mode}: chat {i} parted from the target alone"
        assert seeded() == first_seeded, "a seeded request changed with what the server served before it"
        with concurrent.futures.ThreadPoolExecutor(len(CHATS) + 1) as pool:
            beside = pool.submit(seeded)
            replies = list(pool.map(ask, CHATS))
        assert replies == reference, "all at once: a reply parted from the target alone"
        assert beside.result() == first_seeded, "a seeded request changed with what ran beside it"
        assert "Traceback" not in server.log
    finally:
        server.stop(signal.SIGKILL)
