"""The OpenAI server's error bodies: what its routes raise, as OpenAI clients expect it."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagoda.entrypoints.openai.middleware import error_response, http_error
from pagoda.entrypoints.openai.protocol import describe_validation_errors
from pagoda.entrypoints.openai.errors import OpenAIError, bad_value

logger = logging.getLogger("pagoda.server")


def install_error_handlers(app: FastAPI) -> None:
    """OpenAI-style error bodies for what the routes raise, and a bare 500 for a bug."""

    @app.exception_handler(OpenAIError)
    async def on_openai_error(_request: Request, e: OpenAIError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_request: Request, e: RequestValidationError):
        message, param = describe_validation_errors(e.errors())
        return error_response(OpenAIError(message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, e: StarletteHTTPException):
        return http_error(request.scope, e)

    @app.exception_handler(ValueError)
    async def on_value_error(_request: Request, e: ValueError):
        return error_response(bad_value(e))

    @app.exception_handler(Exception)
    async def on_unexpected_error(request: Request, e: Exception):
        """A bug, not the client's fault: a 500 that says no more; the traceback goes to the log
        (Starlette re-raises the exception after this response, and uvicorn logs it)."""
        logger.error("internal error on %s %s: %s", request.method, request.url.path, type(e).__name__)
        return error_response(OpenAIError("internal error", status=500, type_="server_error", code="internal_error"))
