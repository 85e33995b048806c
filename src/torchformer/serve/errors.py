"""The API's error: answered as OpenAI's error envelope. Below protocol.py, grammar.py and tools.py,
which all raise it (protocol.py checks requests with grammar.py's and tools.py's readers)."""

from __future__ import annotations


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def envelope(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code=code)


def shutting_down() -> APIError:
    """The 503 of a request refused or ended because the server is stopping."""
    return APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
