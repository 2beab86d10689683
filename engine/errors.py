"""Errors the engine raises for bad input. The server maps each to an OpenAI-shaped error with its status."""
from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""
    status = 500
    err_type = "internal_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidInputError(EngineError, ValueError):
    """The request cannot be served as sent (wrong type, out of range, unknown field...). HTTP 400."""
    status = 400
    err_type = "invalid_request_error"


class PromptTooLongError(InvalidInputError):
    """The prompt (plus the requested output) exceeds max_model_len or the whole KV pool."""


class ImageError(InvalidInputError):
    """An image could not be decoded or breaks a size/pixel limit."""


class PayloadTooLargeError(InvalidInputError):
    """Bytes over a configured size limit (request body, one image). HTTP 413."""
    status = 413


class ModelLoadError(EngineError):
    """The model cannot be loaded: missing directory or file, unsupported architecture, missing tensors."""
    err_type = "model_load_error"


class EngineOverloadedError(EngineError):
    """The engine cannot take more requests right now. HTTP 503, with a Retry-After header (every 503 has one)."""
    status = 503
    err_type = "service_unavailable"
    retry_after_s = 1


class QueueFullError(EngineOverloadedError):
    """More requests wait for a running slot than the server's limit (--max-waiting-requests). HTTP 503 with a
    Retry-After header: the client should come back, not give up."""

    def __init__(self, message: str, retry_after_s: int, param: str | None = None, code: str | None = "queue_full"):
        super().__init__(message, param=param, code=code)
        self.retry_after_s = retry_after_s


class PermissionDeniedError(EngineError):
    """The request asks for what only a client with the API key may (a priority below 0). HTTP 403."""
    status = 403
    err_type = "permission_error"


class ServerBusyError(EngineError):
    """A shared resource (the memory budget for decoding images) is used up for now. HTTP 429: retry shortly."""
    status = 429
    err_type = "rate_limit_error"
    retry_after_s = 1
