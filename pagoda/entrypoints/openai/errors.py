"""OpenAIError: an error with an HTTP status and an OpenAI-style body, raised wherever a request
is refused (the routes, admission, the security checks) and answered by error_handlers.py."""

from __future__ import annotations


class OpenAIError(Exception):
    """An error with an HTTP status and an OpenAI-style body."""

    def __init__(self, message: str, status: int = 400, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_value(e: ValueError) -> OpenAIError:
    """A ValueError from SamplingParams / the engine names the field as its first word (a field
    name: lower case; "Overflow when unpacking long long" names none)."""
    message = str(e)
    first = message.split(" ", 1)[0]
    named = first.isidentifier() and first.islower() and first not in _NOT_FIELDS
    return OpenAIError(message, param=first if named else None)


_NOT_FIELDS = {"the", "a", "an", "this", "that", "it", "no", "cannot", "request", "model"}  # words, not fields
