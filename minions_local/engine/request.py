"""Checks on every argument of a generation request, made before any model work.

Each check raises `RequestError` whose message names the argument, the value it got
and what is allowed, and whose `argument` attribute names the argument (so a server
can point at the field). Numbers must be numbers: a string, a bool, NaN or an
infinity is refused rather than coerced, and a float is not accepted where a whole
number is meant (2.5 tokens would otherwise silently become 3, and 1e300 a crash).
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from minions_local.core.errors import RequestError
from minions_local.core.sampling import SamplingParams

MIN_TEMPERATURE = 1e-3
"""Below this a float32 division of the logits may overflow to inf (and the softmax to
NaN) for no visible difference from greedy, which 0 already asks for."""
MAX_TEMPERATURE = 100.0
SEED_RANGE = (0, 2**64 - 1)
"""What torch.Generator.manual_seed takes without error."""


def show(value: Any, limit: int = 60) -> str:
    """A value as the user wrote it, cut short: messages must not echo a whole prompt."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _number(value: Any, argument: str, allowed: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RequestError(f"{argument} must be a number ({allowed}), got {show(value)}", argument=argument)
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float
        number = math.inf
    if not math.isfinite(number):
        raise RequestError(f"{argument} must be a finite number ({allowed}), got {show(value)}", argument=argument)
    return number


def _whole(value: Any, argument: str, allowed: str) -> int:
    """An int (or anything with __index__: numpy and 0-d integer torch values), never a bool or a float."""
    if isinstance(value, bool):
        raise RequestError(f"{argument} must be a whole number ({allowed}), got {value!r}", argument=argument)
    try:
        return operator.index(value)
    except TypeError:
        raise RequestError(f"{argument} must be a whole number ({allowed}), got {show(value)}",
                           argument=argument) from None


def sampling_params(temperature: Any, top_p: Any, top_k: Any) -> SamplingParams:
    allowed = f"0 for greedy, or from {MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g}"
    t = _number(temperature, "temperature", allowed)
    if t != 0 and not MIN_TEMPERATURE <= t <= MAX_TEMPERATURE:
        raise RequestError(f"temperature must be {allowed}, got {show(temperature)}", argument="temperature")
    p = _number(top_p, "top_p", "greater than 0 and at most 1")
    if not 0 < p <= 1:
        raise RequestError(f"top_p must be greater than 0 and at most 1, got {show(top_p)}", argument="top_p")
    k = _whole(top_k, "top_k", "0 = off, or how many top tokens to keep")
    if k < 0:
        raise RequestError(f"top_k must be >= 0 (0 = off), got {k}", argument="top_k")
    return SamplingParams(t, p, k)


def max_new_tokens_arg(value: Any) -> int | None:
    """None means "as many as the context window leaves" (the engine works that out)."""
    if value is None:
        return None
    n = _whole(value, "max_new_tokens", "1 or more")
    if n < 1:
        raise RequestError(f"max_new_tokens must be 1 or more, got {n}", argument="max_new_tokens")
    return n


def parallel_arg(value: Any) -> int:
    """Requests a batch decodes at once."""
    n = _whole(value, "parallel", "1 or more")
    if n < 1:
        raise RequestError(f"parallel must be 1 or more, got {n}", argument="parallel")
    return n


def seed_arg(value: Any) -> int | None:
    if value is None:
        return None
    lo, hi = SEED_RANGE
    allowed = f"None, or from {lo} to 2**64 - 1"
    seed = _whole(value, "seed", allowed)
    if not lo <= seed <= hi:
        raise RequestError(f"seed must be {allowed}, got {show(value)}", argument="seed")
    return seed


def check_text(text: str, what: str, argument: str | None = None) -> str:
    """Refuse strings that are not valid Unicode (lone surrogates): tokenizers fail on
    them deep inside, and they are what undecodable bytes become under surrogateescape."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise RequestError(
            f"{what} is not valid Unicode text: character {err.start} is a lone surrogate "
            f"({text[err.start:err.end]!r}), which is what bytes that are not UTF-8 turn into. Decode the "
            f"input with errors='replace', or fix its encoding.", argument=argument or what) from None
    return text


def _sequence(value: Any, argument: str, what: str) -> list[Any]:
    if isinstance(value, (str, bytes, bytearray, memoryview, Mapping)) or not isinstance(value, Iterable):
        raise RequestError(f"{argument} must be {what}, got {show(value)}", argument=argument)
    return list(value)


def stop_strings(stop: Any) -> list[str]:
    if stop is None:
        return []
    what = "a string or a list of strings"
    stops = [stop] if isinstance(stop, str) else _sequence(stop, "stop", what)
    for s in stops:
        if not isinstance(s, str):
            raise RequestError(f"stop must be {what}; it holds {show(s)}", argument="stop")
        if not s:
            raise RequestError("stop strings must not be empty (an empty one would end every reply before "
                               "it starts)", argument="stop")
        check_text(s, "stop")
    return stops


def prompt_ids(prompt: Any, *, encode: Callable[[str], list[int]], vocab_size: int,
               start_token: int | None) -> list[int]:
    """Token ids for text or a list of ids; an empty prompt starts from `start_token`."""
    if isinstance(prompt, str):
        ids = encode(check_text(prompt, "prompt"))
    elif isinstance(prompt, (bytes, bytearray, memoryview)):
        raise RequestError("prompt is bytes: decode it to str first (or pass token ids as a list of ints)",
                           argument="prompt")
    else:
        items = _sequence(prompt, "prompt", "text or a list of token ids")
        ids = [_token_id(t, i) for i, t in enumerate(items)]
    if not ids:
        if start_token is None:
            raise RequestError("The prompt is empty and this model has no BOS token to start from: give "
                               "at least one token.", argument="prompt")
        ids = [start_token]
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"Prompt token ids {bad[:5]} are outside the target's vocabulary (0..{vocab_size - 1});"
                           f" encode prompts with this model's tokenizer.", argument="prompt")
    return ids


def _token_id(value: Any, position: int) -> int:
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise RequestError(f"prompt token ids must be whole numbers; position {position} holds {show(value)}",
                       argument="prompt")


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """Each message a mapping with a non-empty text 'role' and a text 'content'."""
    what = "a list of {'role': ..., 'content': ...} messages"
    items = _sequence(messages, "messages", what)
    if not items:
        raise RequestError("messages is empty: give at least one message", argument="messages")
    out = []
    for i, message in enumerate(items):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise RequestError(f"messages[{i}] must be a dict with 'role' and 'content', got {show(message)}",
                               argument="messages")
        role, content = message["role"], message["content"]
        if not isinstance(role, str) or not role:
            raise RequestError(f"messages[{i}]['role'] must be a non-empty string, got {show(role)}",
                               argument="messages")
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}]['content'] must be a string, got {show(content)}",
                               argument="messages")
        check_text(role, f"messages[{i}]['role']", "messages")
        check_text(content, f"messages[{i}]['content']", "messages")
        out.append(dict(message))
    return out
