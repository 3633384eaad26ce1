"""ApiError: a request failure with its HTTP status, OpenAI error type and offending parameter."""

from __future__ import annotations

from typing import Optional

import grpc

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          413: "invalid_request_error", 429: "rate_limit_error", 500: "internal_error", 503: "service_unavailable", 504: "timeout"}
_GRPC_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
               404: grpc.StatusCode.NOT_FOUND, 413: grpc.StatusCode.RESOURCE_EXHAUSTED,
               429: grpc.StatusCode.RESOURCE_EXHAUSTED,
               503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 error_type: Optional[str] = None, headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.headers = headers or {}  # HTTP headers of the answer (Retry-After on a 429)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = error_type or _TYPES.get(status, "internal_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return _GRPC_CODES.get(self.status, grpc.StatusCode.INTERNAL)


def bad_request(param: str, message: str) -> ApiError:
    """400 whose message starts with the offending field, so clients see which one."""
    return ApiError(400, f"{param}: {message}", param=param)


class NoWorkerError(ApiError):
    def __init__(self, message: str):
        super().__init__(503, message, code="no_healthy_worker")
