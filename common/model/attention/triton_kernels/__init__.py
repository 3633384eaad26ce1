"""Triton kernels of the triton attention backend: paged decode (split-K, two stages) and extend with a prefix."""

from __future__ import annotations


def kernels_interpreted() -> bool:
    """Whether the kernels were built for Triton's interpreter: @triton.jit decides that once, when their
    module is imported, from TRITON_INTERPRET at that moment."""
    # optional: triton; and importing the kernels builds them, which only a triton backend may do
    from triton.runtime.interpreter import InterpretedFunction

    from tandem.common.model.attention.triton_kernels.decode import _decode_stage1

    return isinstance(_decode_stage1, InterpretedFunction)
