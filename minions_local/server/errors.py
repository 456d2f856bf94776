"""Errors as the OpenAI API writes them: a status code and
`{"error": {"message", "type", "param", "code"}}`, never a traceback.

Engine errors map onto them here: a request the engine refuses is a 400 naming the
request's field; anything the model or the server got wrong is a 500 whose message
is the engine's (written for users) or, for a bug, a pointer to the server's log.
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.responses import JSONResponse

from minions_local.core.errors import ContextOverflowError, EngineBusyError, MinionsError, RequestError

log = logging.getLogger("minions_local.server")

ENGINE_ARGUMENT_TO_FIELD = {"max_new_tokens": "max_tokens"}
"""The engine's argument names where the API calls them differently."""


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unsupported(param: str, what: str) -> ApiError:
    return ApiError(400, f"{what} is not supported by this server", param=param, code="unsupported_parameter")


def shutting_down() -> ApiError:
    return ApiError(503, "The server is shutting down; the request was not run.", type="server_error",
                    code="server_shutting_down")


def from_engine(err: BaseException, prompt_field: str) -> ApiError:
    """The API error for what the engine raised while starting or running a generation."""
    if isinstance(err, ApiError):
        return err
    if isinstance(err, ContextOverflowError):
        return ApiError(400, str(err), param=prompt_field, code="context_length_exceeded")
    if isinstance(err, RequestError):
        argument = err.argument or prompt_field
        field = ENGINE_ARGUMENT_TO_FIELD.get(argument, argument)
        return ApiError(400, str(err), param=prompt_field if field in ("prompt", "messages") else field)
    if isinstance(err, EngineBusyError):  # the scheduler runs one generation at a time: a bug if seen
        log.error("engine busy although the scheduler serialises generations: %s", err)
        return ApiError(503, str(err), type="server_error", code="engine_busy")
    if isinstance(err, MinionsError):
        return ApiError(500, str(err), type="server_error", code="model_error")
    log.error("unexpected error in a generation", exc_info=err)
    return internal_error(err)


def internal_error(err: BaseException) -> ApiError:
    return ApiError(500, f"Internal error ({type(err).__name__}): this is a bug in minions-local; the server's "
                         f"log has the details.", type="server_error", code="internal_error")
