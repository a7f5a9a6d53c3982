"""Kubernetes `Status` error bodies and the exception that carries them through the fake."""

from __future__ import annotations

from typing import Any

REASONS: dict[int, str] = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    406: "NotAcceptable",
    409: "Conflict",
    410: "Gone",
    413: "RequestEntityTooLarge",
    415: "UnsupportedMediaType",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}

GENERIC_MESSAGES: dict[int, str] = {
    429: "Too many requests, please try again later.",
    500: "Internal error occurred: injected fault",
    503: "The server is currently unable to handle the request",
    504: "The server was unable to return a response in the time allotted, but may still be processing the request",
}


def status_body(code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
    """A `Status` object as the API server writes it for a failed request."""
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
    }
    if details:
        body["details"] = details
    body["code"] = code
    return body


def success_status(code: int = 200, details: dict[str, Any] | None = None) -> dict[str, Any]:
    """A `Status` object reporting success (deletes of non-pod resources, evictions)."""
    body: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"}
    if details:
        body["details"] = details
    body["code"] = code
    return body


class ApiError(Exception):
    """An error the fake answers with a `Status` body and the matching HTTP code."""

    def __init__(self, code: int, message: str, reason: str | None = None,
                 details: dict[str, Any] | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.code = code
        self.reason = reason or REASONS.get(code, "Unknown")
        self.message = message
        self.details = details
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return status_body(self.code, self.reason, self.message, self.details)


def not_found(resource: str, name: str, group: str = "") -> ApiError:
    qualified = f"{resource}.{group}" if group else resource
    return ApiError(404, f'{qualified} "{name}" not found', details=_details(name, resource, group))


def path_not_found() -> ApiError:
    return ApiError(404, "the server could not find the requested resource", details={})


def conflict(resource: str, name: str, group: str = "") -> ApiError:
    qualified = f"{resource}.{group}" if group else resource
    message = (f'Operation cannot be fulfilled on {qualified} "{name}": the object has been modified; '
               "please apply your changes to the latest version and try again")
    return ApiError(409, message, details=_details(name, resource, group))


def already_exists(resource: str, name: str, group: str = "") -> ApiError:
    qualified = f"{resource}.{group}" if group else resource
    return ApiError(409, f'{qualified} "{name}" already exists', reason="AlreadyExists",
                    details=_details(name, resource, group))


def bad_request(message: str) -> ApiError:
    return ApiError(400, message)


def invalid(kind: str, name: str, causes: list[tuple[str, str, str]], group: str = "") -> ApiError:
    """422 with one cause per (field, reason, message), formatted like apimachinery's NewInvalid."""
    texts = [f"{field}: {message}" for field, _, message in causes]
    summary = texts[0] if len(texts) == 1 else "[" + ", ".join(texts) + "]"
    qualified = f"{kind}.{group}" if group else kind
    details: dict[str, Any] = {"name": name, "kind": kind}
    if group:
        details["group"] = group
    details["causes"] = [{"reason": reason, "message": message, "field": field} for field, reason, message in causes]
    return ApiError(422, f'{qualified} "{name}" is invalid: {summary}', details=details)


def unprocessable(message: str) -> ApiError:
    """422 as NewGenericServerResponse builds it (e.g. a failed JSON-patch `test`)."""
    return ApiError(422, "the server rejected our request due to an error in our request",
                    details={"causes": [{"message": message}]})


def expired(message: str) -> ApiError:
    return ApiError(410, message, reason="Expired")


def _details(name: str, resource: str, group: str) -> dict[str, Any]:
    details: dict[str, Any] = {"name": name}
    if group:
        details["group"] = group
    details["kind"] = resource
    return details
