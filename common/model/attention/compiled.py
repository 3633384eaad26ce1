"""The attention call as one opaque op under torch.compile, so a captured decode graph runs the backend eagerly."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

from tandem.common.model.attention.base import AttentionBackend
from tandem.common.model.forward_batch import ForwardBatch

# The batch being replayed: the compiled graph sees only q/k/v, the op finds the backend's plan here. Thread-local
# because the overlap loop runs forwards on the model thread while tests may run others elsewhere.
_current = threading.local()


@contextlib.contextmanager
def attention_context(backend: AttentionBackend, fb: ForwardBatch) -> Iterator[None]:
    """Lets `tandem::attention` reach the backend and the batch (with its plan) while a compiled forward runs."""
    previous = getattr(_current, "value", None)
    _current.value = (backend, fb)
    try:
        yield
    finally:
        _current.value = previous


# mutates_args is empty although the op writes the new K/V into the pool: the pool is not a graph input, nothing
# in the graph reads it, and each layer's op depends on the previous layer's output, so the order is fixed.
@torch.library.custom_op("tandem::attention", mutates_args=())
def opaque_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
    current = getattr(_current, "value", None)
    if current is None:
        raise RuntimeError("tandem::attention ran outside attention_context (a compiled forward without its batch)")
    backend, fb = current
    return backend.forward(q, k, v, layer_id, fb)


@opaque_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


def attention(backend: AttentionBackend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
              fb: ForwardBatch) -> torch.Tensor:
    """backend.forward, or the opaque op while torch.compile traces (the graph runner sets attention_context)."""
    if torch.compiler.is_compiling():
        return opaque_attention(q, k, v, layer_id)
    return backend.forward(q, k, v, layer_id, fb)
