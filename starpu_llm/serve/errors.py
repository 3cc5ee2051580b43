"""The API's refusals: BadRequest (raised while a request is checked: serve/api.py,
serve/chat.py, serve/scoring.py) and OpenAI's error object. Its own module so that every
checker imports it without importing the others."""
from __future__ import annotations


class BadRequest(Exception):
    """A request this server refuses: HTTP `status` with an OpenAI error object."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


def error_body(message: str, kind: str = "invalid_request_error", param=None, code=None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
