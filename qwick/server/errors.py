"""OpenAI's error envelope for every failure the server can answer with.

`{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}`, always, whatever went wrong:
validation (400, with the offending parameter named), malformed JSON (400), a content type other than
JSON (415), an unknown model (404), a missing or wrong API key (401), a body over the size limit (413),
an unknown route (404) or method (405), a full waiting queue or a dead engine (503 with Retry-After),
and anything unexpected (500, logged with its traceback; the message says no more than "internal error").
"""

from __future__ import annotations

import json
import logging
from typing import Any

logger = logging.getLogger("qwick.server")

INVALID_REQUEST = "invalid_request_error"
NOT_FOUND = "not_found_error"
AUTHENTICATION = "authentication_error"
SERVER_ERROR = "server_error"
OVERLOADED = "overloaded_error"


class APIError(Exception):
    """An error the API answers with, in OpenAI's envelope."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def json(self) -> str:
        return json.dumps(self.body(), ensure_ascii=False)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str) -> APIError:
    return APIError(
        404,
        f"The model `{model}` does not exist.",
        type=NOT_FOUND,
        param="model",
        code="model_not_found",
    )


def invalid_api_key() -> APIError:
    return APIError(
        401,
        "Incorrect API key provided. Pass it as 'Authorization: Bearer <key>'.",
        type=AUTHENTICATION,
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def overloaded(num_waiting: int, bound: int, retry_after: int = 1) -> APIError:
    return APIError(
        503,
        f"The server is overloaded: {num_waiting} requests are already waiting (the bound is {bound}). "
        "Retry later.",
        type=OVERLOADED,
        code="server_overloaded",
        headers={"Retry-After": str(retry_after)},
    )


def engine_dead(reason: str | None) -> APIError:
    detail = f": {reason}" if reason else ""
    return APIError(
        503,
        f"The engine is not running{detail}.",
        type=SERVER_ERROR,
        code="engine_dead",
        headers={"Retry-After": "5"},
    )


def internal_error() -> APIError:
    return APIError(500, "The server had an internal error while processing the request.", type=SERVER_ERROR)


def format_param(loc: tuple | list) -> str | None:
    """A pydantic location as OpenAI names parameters: `messages[0].role`."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("body",) and not out:
            continue
        else:
            out += f".{part}" if out else str(part)
    return out or None


def from_validation_errors(errors: list[dict[str, Any]]) -> APIError:
    """Turn pydantic's list of errors into one 400: the first error, with the parameter it concerns."""
    first = errors[0]
    kind = first.get("type", "")
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error") or first.get("msg", "")
        return bad_request(
            "We could not parse the JSON body of your request. (HINT: This likely means you aren't using "
            f"your HTTP library correctly. The OpenAI API expects a JSON payload.) Detail: {detail}",
            code="invalid_json",
        )
    loc = tuple(first.get("loc", ()))
    param = format_param(loc)
    if kind == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param=param)
    if kind == "missing":
        return bad_request(f"Missing required parameter: '{param}'.", param=param, code="missing_required")
    if kind == "model_type" and not loc:
        return bad_request("The request body must be a JSON object.", code="invalid_type")
    msg = str(first.get("msg", "invalid value"))
    msg = msg.removeprefix("Value error, ")
    value = first.get("input")
    shown = ""
    if kind != "value_error" and (value is None or isinstance(value, (int, float, str, bool))):
        shown = f" (got {json.dumps(value)[:100]})"
    code = "invalid_type" if kind.endswith("_type") else "invalid_value"
    return bad_request(f"Invalid value for '{param}': {msg}{shown}.", param=param, code=code)
