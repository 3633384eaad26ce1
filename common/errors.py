"""Errors shared by every service; each maps onto one HTTP status / gRPC code at the edge."""

from __future__ import annotations


class TandemError(Exception):
    """Base class of Tandem's own errors."""


class InvalidRequestError(TandemError, ValueError):
    """The request is malformed; `field` names the offending parameter (HTTP 400, INVALID_ARGUMENT)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class UnsupportedModelError(TandemError, ValueError):
    """The checkpoint's architecture or a config option is not supported by Tandem's model code."""


class CapacityError(TandemError):
    """The engine cannot take the request now (queue full; HTTP 429, RESOURCE_EXHAUSTED)."""


class UnavailableError(TandemError):
    """The worker cannot serve now (memory released): gRPC UNAVAILABLE with this message."""


class WeightUpdateError(ValueError):
    """A weight update that cannot be applied (bad path, unknown name, wrong shape); nothing was changed."""


class PreconditionError(TandemError):
    """The worker cannot do this in its configuration (the expert recorder of a dense model): FAILED_PRECONDITION."""
