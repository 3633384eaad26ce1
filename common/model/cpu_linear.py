"""Linear layers that run on CPU through oneDNN with their weight reordered once into its blocked layout.

`F.linear` on CPU reorders a bfloat16 weight into oneDNN's blocked layout on every call, and runs float32 through
MKL's sgemm (slow on AMD's AVX-512); oneDNN's `_linear_pointwise` over a weight reordered once does neither. On the
`small` preset at 64 rows this is 1.3-1.4x (bf16) and 1.6-2.4x (fp32) per matmul (docs/performance.md, "The CPU forward outside attention").
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

# The row count oneDNN is told to expect when it picks the blocked layout; any row count runs on it (bitwise the
# same bf16 results as F.linear), the layout only tunes the kernel. 64 is a decode batch; prefill rows run as fast.
PACK_ROWS_HINT = 64
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled


class Linear(nn.Linear):
    """nn.Linear whose CPU forward multiplies by a oneDNN-packed copy of the weight.

    Writes that bypass autograd's version counter (through `param.data`, as weight updates do) must call
    `repack_weights` afterwards; the copy is also rebuilt by itself when the weight's storage, version counter,
    dtype or shape changes (a swapped `.data` on memory resume, an in-place op on the parameter).
    `drop_packed_weights` frees the copies (memory release). Forward hooks (LoRA, tensor parallelism) see the
    same inputs and outputs as nn.Linear's.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__(in_features, out_features, bias=bias)
        self.prepack = True  # False: plain F.linear (--disable-cpu-weight-prepack)
        self._packed: Optional[torch.Tensor] = None
        self._packed_key: Optional[tuple] = None

    def packs(self) -> bool:
        """Whether CPU forwards use the packed copy (prepack on, oneDNN present, a float32/bf16 CPU weight)."""
        weight = self.weight
        return self.prepack and weight.is_cpu and weight.dtype in PACKABLE_DTYPES and onednn_available()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Under torch.compile the plain linear is traced (Inductor's freezing packs weights itself).
        if not torch.compiler.is_compiling() and x.dtype == self.weight.dtype and self.packs():
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight(), self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def packed_weight(self) -> torch.Tensor:
        weight = self.weight
        key = (weight.data_ptr(), weight._version, weight.dtype, tuple(weight.shape))
        if key != self._packed_key:
            self._packed = None  # free the old copy before building the new one
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)
            self._packed_key = key
        return self._packed

    def drop_packed(self) -> None:
        self._packed = self._packed_key = None


def set_weight_prepack(model: nn.Module, enabled: bool) -> None:
    """Turn the packed CPU path of every Linear in `model` on or off. On: the copies are built now, so that what
    the KV pool is sized from (available RAM) already excludes them; off: they are freed."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.prepack = enabled
    repack_weights(model)


@torch.no_grad()
def repack_weights(model: nn.Module) -> None:
    """Rebuild every packed copy in `model` from its weight now (after the weights were written in place)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.drop_packed()
            if module.packs():
                module.packed_weight()


def drop_packed_weights(model: nn.Module) -> None:
    """Free every packed weight copy in `model` (they are rebuilt on the next forward)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.drop_packed()
