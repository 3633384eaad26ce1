"""Role: what a Tandem process is, named once for metrics, messages, worker info and configuration."""

from __future__ import annotations

import enum


class Role(str, enum.Enum):
    """A str enum, so a Role is its own metric label, JSON value and CLI word."""

    ROUTER = "router"
    PREFILL = "prefill"
    DECODE = "decode"
    UNIFIED = "unified"  # one worker process that prefills and decodes

    def __str__(self) -> str:
        return self.value

    @property
    def disaggregation_mode(self) -> str:
        """SGLang's server-args word for the role ("null" for a unified worker)."""
        return "null" if self is Role.UNIFIED else self.value


WORKER_ROLES = (Role.PREFILL, Role.DECODE, Role.UNIFIED)
