"""Errors in OpenAI's shape: every failure answers ``{"error": {"message", "type", "param", "code"}}`` with its
HTTP status (400 bad request, 401 no key, 404 unknown model or route, 429 overloaded, 500 engine failure)."""
from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

log = logging.getLogger("tllm_spec.serve")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          429: "rate_limit_error", 500: "server_error", 503: "server_error"}


class APIError(Exception):
    """A request that fails with ``status``; ``param`` names the request field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "invalid_request_error")

    def body(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)

    def event(self) -> str:
        """The error as one server-sent event (a stream that fails after its 200)."""
        return f"data: {json.dumps(self.body())}\n\n"


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)


async def _api_error(request: Request, err: APIError) -> JSONResponse:
    return err.response()


async def _validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
    """Malformed JSON, a wrong type or a missing field: 400 naming the first field at fault (``param``) and what
    was wrong with it (a value that fits no member of a union gets one line per member, up to three)."""
    errors = err.errors() or [{"loc": (), "msg": "invalid request"}]
    if errors[0].get("type") == "json_invalid":
        detail = errors[0].get("ctx", {}).get("error", errors[0]["msg"])
        return APIError(400, f"the body is not valid JSON: {detail}").response()
    paths = [".".join(str(part) for part in e.get("loc", ()) if part != "body") for e in errors]
    content_type = request.headers.get("content-type", "")
    if not paths[0] and content_type.split(";")[0].strip().lower() != "application/json":
        return APIError(400, f"the body must be JSON sent with 'Content-Type: application/json'; this request's "
                        f"Content-Type is {content_type or 'missing'!r}").response()
    if not paths[0]:
        return APIError(400, f"the body must be a JSON object: {errors[0]['msg']}").response()
    param = paths[0].split(".")[0]
    same_field = [(path, e["msg"]) for path, e in zip(paths, errors) if path.split(".")[0] == param][:3]
    return APIError(400, "; ".join(f"{path}: {msg}" for path, msg in same_field), param).response()


async def _http_error(request: Request, err: HTTPException) -> JSONResponse:
    return APIError(err.status_code, str(err.detail)).response()


async def _unexpected_error(request: Request, err: Exception) -> JSONResponse:
    log.exception("request %s failed", request.url.path)
    return APIError(500, f"internal error: {type(err).__name__}: {err}").response()
