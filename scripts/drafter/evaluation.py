"""Does a trained drafter pay? The profile's own minions, the drafter with the n-gram
minion, and all of them, each decoding the chat benchmark's first requests greedily
and at T=0.7 on the profile's tier, in one run: tokens per target pass and tokens per
second (the same engine settings otherwise)."""

from __future__ import annotations

import time
from pathlib import Path


def lineups(profile: str, weights: Path) -> dict[str, list]:
    from minions_local.engine.from_profile import engine_kwargs_from_profile
    from minions_local.engine.loading import MinionSpec

    own = list(engine_kwargs_from_profile(profile)["minions"])
    eagle = MinionSpec(path=str(weights), kind="eagle")
    return {"profile's minions": own, "eagle + ngram": [eagle, "ngram"], "all": [*own, eagle]}


def compare(profile: str, weights: Path, *, prompts: int = 3, max_new: int = 96, log=print) -> dict:
    from benchmarks.chat_prompts import CHAT_PROMPTS

    result = {}
    for name, minions in lineups(profile, weights).items():
        engine = _engine(profile, minions)
        row = {}
        for temperature in (0.0, 0.7):
            tokens = passes = 0
            seconds = 0.0
            for _, message in CHAT_PROMPTS[:prompts]:
                engine.reset()
                start = time.perf_counter()
                out = engine.chat([{"role": "user", "content": message}], max_new_tokens=max_new,
                                  temperature=temperature)
                seconds += time.perf_counter() - start
                tokens, passes = tokens + len(out.token_ids), passes + len(out.steps)
            regime = "greedy" if temperature == 0 else "sampled"
            row[regime] = {"tokens_per_pass": round(tokens / passes, 2), "tokens_per_s": round(tokens / seconds, 1)}
        log(f"  {name:18s} {row}")
        result[name] = row
    return result


def _engine(profile: str, minions: list):
    from minions_local import Engine
    from minions_local.engine.from_profile import engine_kwargs_from_profile

    kwargs = engine_kwargs_from_profile(profile)
    kwargs["minions"] = minions
    return Engine.from_pretrained(**kwargs)
