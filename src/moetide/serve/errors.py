"""The error every request handler raises to answer with an OpenAI-style body."""

from __future__ import annotations


class APIError(Exception):
    """An error answered with an OpenAI-style body; `status` is the HTTP status code."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(
    message: str, *, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict:
    """`{"error": {"message", "type", "param", "code"}}`, the body of every 4xx/5xx answer."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
