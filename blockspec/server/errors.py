"""OpenAI-shaped error responses, and the handlers that make every failure one of them.

Clients (the openai package, llama-benchy, curl users) read `{"error": {"message", "type", "param",
"code"}}`; type names follow vLLM's so scripts written against vLLM keep working. Bad input must
end as a 4xx with a message that names the field, never as a 500.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from blockspec.errors import RequestError
from blockspec.server.async_engine import EngineUnavailable

log = logging.getLogger("blockspec.server")

ERROR_TYPES = {
    400: "BadRequestError",
    401: "UnauthorizedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "PayloadTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error the server answers with an OpenAI-shaped body."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_body(status: int, message: str, param: str | None = None) -> dict:
    kind = ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def from_exception(exc: BaseException) -> APIError:
    """The API error for an exception raised while preparing or running a request."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestError):
        return APIError(400, str(exc), exc.param)
    if isinstance(exc, EngineUnavailable):
        return APIError(503, str(exc))
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        detail = ctx.get("error", first.get("msg", ""))
        return f"malformed JSON body: {detail}", None
    if not loc and first.get("type") in ("model_attributes_type", "dict_type", "missing"):
        return "the request body must be a JSON object", None
    # Union types report one error per alternative; the field and first message say enough.
    param = loc[0] if loc else None
    where = ".".join(loc) if loc else "body"
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 and len({e['loc'] for e in errors}) > 1 else ""
    return f"invalid value for {where}: {first.get('msg', 'invalid')}{more}", param


def install_error_handlers(app: FastAPI, on_error: Callable[[int], None] | None = None) -> None:
    """Every exception becomes an OpenAI-shaped body; `on_error(status)` counts them."""

    def count(status: int) -> None:
        if on_error is not None:
            on_error(status)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        count(exc.status)
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        count(400)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        if exc.status_code == 404:
            message = f"{message}: no such endpoint (see /openapi.json)"
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        count(500)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
