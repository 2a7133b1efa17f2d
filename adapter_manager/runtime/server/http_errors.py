"""Errors as HTTP responses in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with the status
each typed error deserves (the openai client turns them into NotFoundError, BadRequestError, ...)."""

from __future__ import annotations

import logging
import re

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from adapter_manager import (
    AdapterAccessError,
    AdapterConflictError,
    AdapterError,
    AdapterFormatError,
    AdapterNotFoundError,
    AdapterNotPinnedError,
    HubUnavailableError,
    InvalidAdapterRefError,
    SlotsExhaustedError,
)

from ..engine.request import RequestFailedError
from .generation import OverloadedError

log = logging.getLogger(__name__)

# A part of a validation error's location that names a union member (pydantic's "str", "list[int]", ...), not a field:
# the schemas' fields are snake_case and none is named after a type.
_UNION_MEMBER = re.compile(r"[^a-z0-9_]|^(str|int|float|bool|list|dict)$")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    502: "upstream_error",
    503: "service_unavailable_error",
}
# Most specific first: the first matching class decides the status.
_STATUS: tuple[tuple[type[BaseException], int, str | None], ...] = (
    (AdapterNotFoundError, 404, "model_not_found"),
    (InvalidAdapterRefError, 400, "invalid_adapter_id"),
    (AdapterConflictError, 409, "adapter_conflict"),
    (AdapterFormatError, 422, "invalid_adapter"),
    (AdapterAccessError, 403, "hub_access_denied"),
    (HubUnavailableError, 502, "hub_unavailable"),
    (SlotsExhaustedError, 409, "slots_exhausted"),
    (AdapterNotPinnedError, 409, "not_pinned"),
    (OverloadedError, 503, "overloaded"),
    (AdapterError, 500, "adapter_failed"),
    (ValueError, 400, None),
)


class APIError(Exception):
    """An error a route raises on purpose, with its status, OpenAI ``param`` and ``code``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    headers = {"Retry-After": "1"} if status == 503 else None
    if status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def to_api_error(err: BaseException, param: str | None = None) -> APIError:
    """The status and code of any exception a route can meet (a failed request is judged by its cause)."""
    if isinstance(err, APIError):
        return err
    if isinstance(err, RequestFailedError):
        err = err.cause
    for kind, status, code in _STATUS:
        if isinstance(err, kind):
            named = param if kind is AdapterNotFoundError else getattr(err, "param", None)  # SamplingParamsError's
            return APIError(status, str(err), named, code)
    log.error("unexpected error while serving a request", exc_info=err)
    return APIError(500, f"internal error: {type(err).__name__}: {err}", None, "internal_error")


def _validation_param(loc: tuple) -> str | None:
    """The OpenAI ``param`` of a request validation error's location: ``("body", "messages", 0, "content", "str")``
    -> ``messages[0].content`` (a union member's tag and what lies under it dropped); None for the body itself (not
    JSON: its location is a character position)."""
    param = ""
    for part in loc[1:] if loc[:1] == ("body",) else loc:
        if isinstance(part, int):
            if not param:
                return None
            param += f"[{part}]"
        elif _UNION_MEMBER.search(part):
            break
        else:
            param += f".{part}" if param else part
    return param or None


def install_handlers(app) -> None:
    """Every error leaves the server as an OpenAI-shaped JSON body; none takes the server down."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError) -> JSONResponse:
        return error_response(err.status, err.message, err.param, err.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, err: RequestValidationError) -> JSONResponse:
        errors = err.errors()
        where = _validation_param(errors[0].get("loc", ())) if errors else None
        said = dict.fromkeys(e.get("msg", "") for e in errors if _validation_param(e.get("loc", ())) == where)
        return error_response(400, f"{where or 'body'}: {'; '.join(said) or 'invalid request'}", where)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, err: HTTPException) -> JSONResponse:
        return error_response(err.status_code, str(err.detail))

    @app.exception_handler(Exception)
    async def _any(request: Request, err: Exception) -> JSONResponse:
        api = to_api_error(err)
        return error_response(api.status, api.message, api.param, api.code)
