"""The requests the server accepts, checked field by field before anything is queued.

Types are strict (JSON's `"0.7"` is not a temperature, `true` is not a token count)
and ranges are the OpenAI API's. Fields standard clients send that change nothing
here (`user`, `store`, `metadata`, ...) are ignored; fields that would change the
answer and that this server cannot honour (`n` > 1, tools, logprobs, penalties, ...)
are refused with a 400 that names them, rather than silently dropped.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from minions_local.server.errors import ApiError, bad_request, unsupported

MAX_STOPS = 4


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool | None = False


class _Generation(_Strict):
    """What both endpoints take."""

    model: str | None = None
    """Any name is accepted: the server has one model, and each response says which."""
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, le=2**64 - 1)
    stop: Any = None
    n: int | None = Field(None, ge=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    logit_bias: dict[str, Any] | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: Any) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ValueError(f"must be a string or a list of up to {MAX_STOPS} strings")
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings, got {len(stops)}")
        if not all(stops):
            raise ValueError("stop strings must not be empty")
        return stops

    def refuse_unsupported(self) -> None:
        if self.n is not None and self.n > 1:
            raise unsupported("n", f"n={self.n} (several choices per request)")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise unsupported(name, f"{name}={getattr(self, name)}")
        if self.logit_bias:
            raise unsupported("logit_bias", "logit_bias")

    def engine_options(self) -> dict[str, Any]:
        """Keyword arguments for Engine.stream / stream_chat."""
        return {
            "max_new_tokens": self.max_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "seed": self.seed,
            "stop": self.stop,
        }

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Any = None
    tool_calls: list[Any] | None = None
    function_call: Any = None

    def text(self, index: int) -> str:
        param = f"messages.{index}"
        if self.role in ("tool", "function") or self.tool_calls or self.function_call:
            raise unsupported(param, "A tool or function message")
        content = self.content
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            parts = []
            for i, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise bad_request(f"Only text content parts are supported, got {str(kind)[:40]!r}",
                                      f"{param}.content.{i}")
                parts.append(part["text"])
            return "\n".join(parts)
        raise bad_request(f"messages[{index}].content must be a string or a list of text parts", f"{param}.content")


class ChatRequest(_Generation):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.tools or self.functions:
            raise unsupported("tools" if self.tools else "functions", "Tool and function calling")
        if self.tool_choice not in (None, "none") or self.function_call not in (None, "none"):
            raise unsupported("tool_choice" if self.tool_choice else "function_call", "Tool and function calling")
        if self.logprobs or self.top_logprobs:
            raise unsupported("logprobs", "logprobs")
        if self.response_format and self.response_format.get("type") != "text":
            raise unsupported("response_format", f"response_format {str(self.response_format.get('type'))[:40]!r}")
        if (self.max_tokens and self.max_completion_tokens and self.max_tokens != self.max_completion_tokens):
            raise bad_request("max_tokens and max_completion_tokens disagree; give one of them",
                              "max_completion_tokens")

    def chat_messages(self) -> list[dict[str, str]]:
        # Chat templates know 'system'; 'developer' is the newer API's name for it.
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text(i)}
                for i, m in enumerate(self.messages)]

    def engine_options(self) -> dict[str, Any]:
        options = super().engine_options()
        options["max_new_tokens"] = self.max_completion_tokens or self.max_tokens
        return options


class CompletionRequest(_Generation):
    prompt: Any = ""
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)
    logprobs: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: Any) -> str | list[int]:
        """Text or token ids; the API's list forms ask for one completion per prompt, so a
        list may hold only one."""
        if _one_prompt(value):
            return value
        if isinstance(value, list) and value and all(_one_prompt(p) for p in value):
            if len(value) == 1:
                return value[0]
            raise ValueError(f"one prompt per request (a list of {len(value)} prompts asks for {len(value)} "
                             f"completions)")
        raise ValueError("must be a string, a list of token ids, or a list holding one of those")

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.best_of is not None and self.best_of > 1:
            raise unsupported("best_of", f"best_of={self.best_of}")
        if self.echo:
            raise unsupported("echo", "echo")
        if self.suffix:
            raise unsupported("suffix", "suffix (fill-in-the-middle)")
        if self.logprobs is not None:
            raise unsupported("logprobs", "logprobs")


def _one_prompt(value: Any) -> bool:
    return isinstance(value, str) or (
        isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value))


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def parse_json(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object; NaN and Infinity (which Python would accept)
    are refused like any other invalid JSON."""
    try:
        data = json.loads(body, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        reason = str(err) if isinstance(err, ValueError) else "nested too deeply"
        raise bad_request(f"The request body is not valid JSON: {reason[:200]}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request(f"The request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    return data


def parse(model: type[_Generation], data: dict[str, Any]) -> Any:
    try:
        request = model.model_validate(data)
    except ValidationError as err:
        raise _validation_error(err) from None
    request.refuse_unsupported()
    return request


def _validation_error(err: ValidationError) -> ApiError:
    first = err.errors(include_url=False)[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "missing":
        return bad_request(f"'{param}' is required", param)
    got = first.get("input")
    shown = repr(got) if not isinstance(got, (dict, list)) else type(got).__name__
    if isinstance(got, float) and not math.isfinite(got):
        shown = str(got)
    return bad_request(f"Invalid value for '{param}': {message} (got {shown[:60]})", param)
