"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

An internal error is logged here with its request id and traceback; the client gets the id (in the
message and the ``x-request-id`` header) and never the traceback."""

from __future__ import annotations

import logging
from contextvars import ContextVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mstar.runtime.failures import FailureKind
from mstar.runtime.handles import RequestError

log = logging.getLogger("mstar.server")

# The id of the request being served, set by the app's middleware for the task that serves it (and
# so for the body of a streamed response too); logs and 500 bodies name it.
request_id: ContextVar[str] = ContextVar("request_id", default="-")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


# The one table from what went wrong to an HTTP status. A request the runtime ran and failed: bad
# input is the client's fault; a lost worker, exhausted memory or a request ended by shutdown will
# likely succeed on retry elsewhere or later.
STATUS_OF_FAILURE: dict[FailureKind, int] = {
    FailureKind.INPUT: 400,
    FailureKind.WORKER_LOST: 503,
    FailureKind.OUT_OF_MEMORY: 503,
    FailureKind.ABORTED: 503,
    FailureKind.INTERNAL: 500,
}
# What adapter or model checks raise on a body of the wrong shape (``int([1])``, ``list(5)``, a missing key)
SHAPE_ERRORS = (TypeError, KeyError, IndexError, OverflowError)


def api_error(exc: BaseException, what: str = "the model") -> APIError:
    """The ``APIError`` of an exception raised while a request was read, submitted or run: a
    ``ValueError`` (bad input) or a wrong-shaped body is 400, a failed request its failure kind's
    status, a runtime not serving (``RuntimeError`` at submit) 503, anything else a logged 500.
    ``what``: who rejected a wrong-shaped body (for the log)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestError):
        status = STATUS_OF_FAILURE[exc.kind]
        if status == 500:
            log.error("request %s failed: %s", request_id.get(), exc)
        return APIError(status, str(exc))
    if isinstance(exc, ValueError):
        return APIError(400, str(exc))
    if isinstance(exc, SHAPE_ERRORS):
        log.warning("request %s: %s rejected its input", request_id.get(), what, exc_info=exc)
        return APIError(400, f"invalid request: {type(exc).__name__}: {exc}")
    if isinstance(exc, RuntimeError):
        return APIError(503, str(exc))
    return internal_error(exc)


def internal_error(exc: BaseException) -> APIError:
    """Log ``exc`` with the request id and its traceback; the 500 the client gets names the id only."""
    rid = request_id.get()
    log.error("request %s failed with an internal error", rid, exc_info=exc)
    return APIError(500, f"internal error ({type(exc).__name__}); request id {rid}", code="internal_error")


def install_handlers(app) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        detail = str(first.get("msg", "invalid request")).removeprefix("Value error, ")  # a validator's ValueError
        msg = f"{loc}: {detail}" if loc else detail
        return error_response(400, msg, param=loc or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        e = internal_error(exc)
        return error_response(e.status, e.message, code=e.code)
