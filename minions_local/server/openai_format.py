"""Responses and stream chunks in the OpenAI API's shapes.

Our speculation stats ride along in an extra top-level field, `minions`, which
standard clients ignore (the official Python client keeps it in `model_extra`).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

from minions_local import __version__
from minions_local.core.events import Generation

FINGERPRINT = f"minions-local-{__version__}"


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event; `[DONE]` ends the stream."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def usage(generation: Generation) -> dict[str, int]:
    completion = len(generation.token_ids)
    return {"prompt_tokens": generation.prompt_tokens, "completion_tokens": completion,
            "total_tokens": generation.prompt_tokens + completion}


def speculation_stats(generation: Generation, *, queue_seconds: float, profile: str,
                      notices: Sequence[str] = ()) -> dict[str, Any]:
    steps = generation.steps
    return ({"notices": list(notices)} if notices else {}) | {
        "profile": profile,
        "target_passes": len(steps),
        "tokens_per_pass": round(generation.tokens_per_pass, 3),
        "draft_tokens_verified": sum(s.tree_size for s in steps),
        "draft_tokens_accepted": sum(s.accepted for s in steps),
        "tokens_per_second": round(generation.tokens_per_second, 2),
        "prefill_seconds": round(generation.prefill_seconds, 4),
        "decode_seconds": round(generation.decode_seconds, 4),
        "queue_seconds": round(queue_seconds, 4),
        # Requests whose trees shared its passes (continuous batching): mean and most.
        "batch_size": round(sum(s.batch_size for s in steps) / len(steps), 2) if steps else 0,
        "max_batch_size": max((s.batch_size for s in steps), default=0),
    }


@dataclass
class OpenAIReply:
    """One response's identity, shared by all its chunks."""

    chat: bool
    model: str
    include_usage: bool = False
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not self.id:
            self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def _head(self, object_name: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "system_fingerprint": FINGERPRINT}

    def complete(self, generation: Generation, stats: dict[str, Any]) -> dict[str, Any]:
        """The whole answer of a request without `stream`."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": generation.finish_reason, "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": generation.text, "refusal": None}
        else:
            choice["text"] = generation.text
        return {**self._head(self.object), "choices": [choice], "usage": usage(generation), "minions": stats}

    def _chunk(self, choice: dict[str, Any] | None) -> dict[str, Any]:
        chunk = {**self._head("chat.completion.chunk" if self.chat else "text_completion"),
                 "choices": [] if choice is None else [{"index": 0, "logprobs": None, **choice}]}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def first_chunk(self) -> dict[str, Any] | None:
        """Chat streams open with the assistant's role (the API's clients expect it)."""
        if not self.chat:
            return None
        return self._chunk({"delta": {"role": "assistant", "content": ""}, "finish_reason": None})

    def text_chunk(self, text: str) -> dict[str, Any]:
        if self.chat:
            return self._chunk({"delta": {"content": text}, "finish_reason": None})
        return self._chunk({"text": text, "finish_reason": None})

    def final_chunk(self, generation: Generation, stats: dict[str, Any]) -> dict[str, Any]:
        choice = {"delta": {}} if self.chat else {"text": ""}
        chunk = self._chunk({**choice, "finish_reason": generation.finish_reason})
        chunk["minions"] = stats
        return chunk

    def usage_chunk(self, generation: Generation, stats: dict[str, Any]) -> dict[str, Any]:
        """Asked for with stream_options.include_usage: no choices, the usage of the whole."""
        chunk = self._chunk(None)
        chunk["usage"] = usage(generation)
        chunk["minions"] = stats
        return chunk
