"""Linear layers that run on CPU through oneDNN with their weight reordered once into its blocked layout.

`F.linear` on CPU reorders a bfloat16 weight into oneDNN's blocked layout on every call, and runs float32 through
MKL's sgemm (slow on AMD's AVX-512); oneDNN's `_linear_pointwise` over a weight reordered once does neither. On the
`small` preset at 64 rows this is 1.3-1.4x (bf16) and 1.6-2.4x (fp32) per matmul (docs/performance-history.md
section 11).
On a CPU without a native bfloat16 dot product (avx512_bf16 or AMX) oneDNN emulates bf16 GEMMs, slower than its
float32 GEMM; there a bfloat16 linear multiplies in float32 instead (`--cpu-bf16-matmul`): `fp32` by a float32
packed copy of its weight (4 bytes a parameter beside the checkpoint's 2), `widen` by Tandem's kernel over the weight
packed in bfloat16 (2 bytes a parameter), widened to float32 in registers as the kernel streams it in: the same
float32 products, half the weight bytes held and read, which is what a decode step bound by memory bandwidth pays
for.
oneDNN packs a bfloat16 weight only where the CPU has avx512bw/vl/dq or avx_ne_convert; on an AVX2-only CPU a
`--cpu-bf16-matmul bf16` layer runs unpacked through F.linear (said once in the log).
A float16 layer (a float16 checkpoint under `--dtype auto`) follows the same flag (`resolve_fp16_matmul`): torch's
float16 GEMM on a CPU without avx512_fp16/AMX-FP16 runs at a tenth of the float32 rate, so `auto` multiplies in
float32 (`fp32`; `widen` from float16 panels), and `bf16` (the layer's own 16-bit dtype) keeps F.linear in float16.

Which float32 GEMM a packed Linear runs (an MoE layer's stacked experts stay on oneDNN) is TANDEM_CPU_GEMM's
(CPU_GEMMS): `onednn`, `tandem` (our register-blocked kernel, common/model/cpu_gemm), `mkl` (MKL's packed sgemm) or
`auto` (ours under AUTO_TANDEM_ROWS rows, where `tandem bench gemm` measured it ahead, oneDNN above; it holds both
packed copies). Unset, it is `tandem` on the CPUs where ours measured ahead end to end (TANDEM_GEMM_CPUS: AMD Zen 5,
whose decode step ran 5-25 % faster through it, and Zen 4, level on dense layers and a third faster on MoE ones) and
`onednn` elsewhere (default_cpu_gemm). A bfloat16 layer
multiplied in bfloat16 always runs oneDNN's; one multiplied through its float32 copy follows TANDEM_CPU_GEMM.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from tandem.common.cpuinfo import cpu_vendor_family

logger = logging.getLogger(__name__)

# The row count oneDNN is told to expect when it picks the blocked layout; any row count runs on it (bitwise the
# same bf16 results as F.linear), the layout only tunes the kernel. 64 is a decode batch; prefill rows run as fast.
PACK_ROWS_HINT = 64
PACKABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HALF_DTYPES = (torch.bfloat16, torch.float16)
NATIVE_MODES = ("bf16", "fp16")  # resolved modes that multiply a 16-bit layer in its own dtype
CPU_BF16_MATMULS = ("auto", "bf16", "fp32", "widen")
CPU_GEMMS = ("onednn", "tandem", "mkl", "auto")
# `auto`: our kernel below this many rows (decode batches), where it led oneDNN on the small preset's shapes
# (docs/performance.md, "GEMMs against the FMA peak"); oneDNN from here up, where neither led consistently.
AUTO_TANDEM_ROWS = 32
# (vendor_id, cpu family) of the CPUs whose default float32 GEMM is ours (with its AVX-512 variant): AMD Zen 5
# (family 26), where it ran a decode step 5-8 % faster at batch 64 and 20-25 % at 32, the served stack 7-9 % faster,
# against prefill rows 4-9 % slower; AMD family 25 with AVX-512 (Zen 4; its Zen 3 models have no AVX-512 variant and
# keep oneDNN), level with oneDNN on the dense decode and prefill steps and an MoE decode step 30 % faster through
# the fused, one-call experts (docs/performance.md, "GEMMs against the FMA peak"). On Intel oneDNN measured level or
# ahead.
TANDEM_GEMM_CPUS = frozenset({("AuthenticAMD", 25), ("AuthenticAMD", 26)})


@functools.cache
def default_cpu_gemm() -> str:
    """TANDEM_CPU_GEMM's value when unset: `tandem` on TANDEM_GEMM_CPUS where our AVX-512 kernel builds, else
    `onednn`."""
    if cpu_vendor_family() in TANDEM_GEMM_CPUS:
        from tandem.common.model import cpu_gemm  # builds the kernel once per machine

        if 32 in cpu_gemm.panel_widths():
            return "tandem"
    return "onednn"


def cpu_gemm_path() -> str:
    """The float32 GEMM packed layers run (TANDEM_CPU_GEMM, default default_cpu_gemm()); a value outside CPU_GEMMS
    raises."""
    name = os.environ.get("TANDEM_CPU_GEMM") or default_cpu_gemm()
    if name not in CPU_GEMMS:
        raise ValueError(f"TANDEM_CPU_GEMM must be one of {', '.join(CPU_GEMMS)}, got {name!r}")
    if name in ("tandem", "auto"):
        from tandem.common.model import cpu_gemm  # builds the kernel once per machine

        if not cpu_gemm.panel_widths():
            raise ValueError(f"TANDEM_CPU_GEMM={name}: our GEMM kernel needs AVX-512 or AVX2+FMA and a C++ "
                             "compiler, which this machine lacks; use onednn or mkl")
    return name


def native_bf16_dot() -> bool:
    """Whether this CPU multiplies bfloat16 natively (avx512_bf16 or AMX tiles), so oneDNN runs real bf16 GEMMs."""
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # a torch without these probes: assume native, the bitwise-F.linear path
        return True


@functools.cache
def onednn_packs_bf16() -> bool:
    """Whether oneDNN can reorder a bfloat16 weight here: it needs avx512bw, avx512vl and avx512dq, or
    avx_ne_convert (an AVX2-only CPU has neither, and `_reorder_linear_weight` raises there)."""
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        return bool(probe()) if probe is not None else bool(torch.cpu._is_avx512_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_bf16_matmul(name: str) -> str:
    """`auto` is fp32 on a CPU that emulates bf16 GEMMs, else bf16; `widen` needs our kernel (AVX-512 or AVX2+FMA
    and a C++ compiler) and raises ValueError where it cannot be built."""
    if name not in CPU_BF16_MATMULS:
        raise ValueError(f"--cpu-bf16-matmul must be one of {', '.join(CPU_BF16_MATMULS)}, got {name!r}")
    if name == "auto":
        return "bf16" if native_bf16_dot() else "fp32"
    if name == "widen":
        from tandem.common.model import cpu_gemm  # builds the kernel once per machine

        if not cpu_gemm.panel_widths():
            raise ValueError("--cpu-bf16-matmul widen: Tandem's GEMM kernel needs AVX-512 or AVX2+FMA and a C++ "
                             "compiler, which this machine lacks; use fp32 or bf16")
    return name


def resolve_fp16_matmul(name: str) -> str:
    """How float16 layers multiply under --cpu-bf16-matmul `name`: `auto` is fp32 (no CPU Tandem has met multiplies
    float16 faster than float32: none had avx512_fp16), `bf16` (the layer's own dtype) is fp16, F.linear."""
    mode = resolve_bf16_matmul("fp32" if name == "auto" else name)
    return "fp16" if mode == "bf16" else mode


def layer_matmul(module: nn.Module, dtype: torch.dtype) -> str:
    """The resolved mode a packed module (Linear, PackedGroup) multiplies a weight of `dtype` in."""
    return module.fp16_matmul if dtype == torch.float16 else module.bf16_matmul


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled


# Callbacks run whenever a PackedWeight builds or drops a copy: what keeps a copy's tensor beyond its PackedWeight
# (cpu_layers' saved call arguments) forgets it then, so that no copy outlives its PackedWeight's hold on it.
_on_repack: list = []


def on_repack(callback) -> None:
    """Call `callback()` whenever any packed copy is built or dropped."""
    _on_repack.append(callback)


def _repacked() -> None:
    for callback in _on_repack:
        callback()


class PackedWeight:
    """A packed copy of one 2-D weight (a Linear's, or one expert's slice of a stacked MoE weight), rebuilt when the
    weight's storage, version counter, dtype or shape changes. How a 16-bit weight multiplies is the resolved mode
    each call names (`mode`: bf16 or fp16, the weight's own dtype; fp32; widen; ignored for a float32 weight)."""

    def __init__(self, gemm: str = "onednn") -> None:
        self.gemm = gemm  # CPU_GEMMS: which float32 GEMM runs
        self.packed: Optional[torch.Tensor] = None  # oneDNN's copy
        self.panels: Optional[torch.Tensor] = None  # our kernel's (tandem, auto, widen), or MKL's packed sgemm's
        self.source: Optional[torch.Tensor] = None  # the float32 weight MKL's packed sgemm also takes
        self.bias: Optional[torch.Tensor] = None  # the float32 bias of a 16-bit layer multiplied in float32
        self.key: Optional[tuple] = None

    @staticmethod
    def usable(weight: torch.Tensor, prepack: bool, mode: str) -> bool:
        """Whether CPU forwards can use a packed copy (prepack on, oneDNN present, a float32/16-bit CPU weight; a
        16-bit weight multiplied in its own dtype is packed only where oneDNN packs bf16, never for float16)."""
        if not (prepack and weight.is_cpu and weight.dtype in PACKABLE_DTYPES and onednn_available()):
            return False
        if weight.dtype == torch.float32 or mode not in NATIVE_MODES:
            return True
        return weight.dtype == torch.bfloat16 and onednn_packs_bf16()

    def get(self, weight: torch.Tensor, bias: Optional[torch.Tensor], mode: str) -> torch.Tensor:
        mode = mode if weight.dtype in HALF_DTYPES else "fp32"  # fp32: a float32 layer's own GEMM
        key = (weight.data_ptr(), weight._version, weight.dtype, tuple(weight.shape), mode,
               None if bias is None else (bias.data_ptr(), bias._version))
        if key != self.key:
            self.drop()  # free the old copy before building the new one
            if mode == "widen":
                from tandem.common.model import cpu_gemm

                self.panels = cpu_gemm.pack_weight(weight.detach())  # 16-bit panels
            else:
                source = weight.detach().float() if mode == "fp32" else weight.detach()
                if self.gemm != "onednn" and source.dtype == torch.float32:
                    self._pack_float32(source)
                if self.gemm in ("onednn", "auto") or source.dtype != torch.float32:
                    self.packed = torch.ops.mkldnn._reorder_linear_weight(source, PACK_ROWS_HINT)
            widened = weight.dtype in HALF_DTYPES and mode not in NATIVE_MODES
            self.bias = bias.detach().float() if widened and bias is not None else None
            self.key = key
            _repacked()
        return self.packed if self.packed is not None else self.panels

    def _pack_float32(self, source: torch.Tensor) -> None:
        if self.gemm == "mkl":
            self.source = source.contiguous()
            self.panels = torch.ops.mkl._mkl_reorder_linear_weight(self.source, PACK_ROWS_HINT)
        else:
            from tandem.common.model import cpu_gemm

            self.panels = cpu_gemm.pack_weight(source)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
               mode: str) -> torch.Tensor:
        """x @ weight.T + bias through the packed copy (x in weight's dtype)."""
        self.get(weight, bias, mode)
        widened = weight.dtype in HALF_DTYPES and mode not in NATIVE_MODES  # a 16-bit layer multiplied in float32
        x_in, bias_in = (x.float(), self.bias) if widened else (x, bias)
        if widened and mode == "widen":
            from tandem.common.model import cpu_gemm

            return cpu_gemm.packed_linear(x_in, self.panels, weight.shape[0], bias_in).to(x.dtype)
        out = self._float32(x_in, bias_in, weight.shape[0]) if x_in.dtype == torch.float32 else None
        if out is None:  # a bf16 GEMM, or the float32 one is oneDNN's
            out = torch.ops.mkldnn._linear_pointwise(x_in, self.packed, bias_in, "none", [], "")
        return out.to(x.dtype)

    def _float32(self, x: torch.Tensor, bias: Optional[torch.Tensor], n: int) -> Optional[torch.Tensor]:
        """x @ weight.T through MKL's or our kernel when this layer's path picks one for x's rows, else None."""
        rows = x.numel() // x.shape[-1]
        if self.gemm == "mkl":
            out = torch.ops.mkl._mkl_linear(x.reshape(rows, -1), self.panels, self.source, bias, PACK_ROWS_HINT)
            return out.view(*x.shape[:-1], n)
        if self.ours(rows):
            from tandem.common.model import cpu_gemm

            return cpu_gemm.packed_linear(x, self.panels, n, bias)
        return None

    def ours(self, rows: int) -> bool:
        """Whether a float32 GEMM of `rows` rows runs our kernel on this copy's path (tandem; auto below its cut)."""
        return self.gemm == "tandem" or (self.gemm == "auto" and rows < AUTO_TANDEM_ROWS)

    def gate_up_silu(self, x: torch.Tensor, weight: torch.Tensor, mode: str) -> Optional[torch.Tensor]:
        """silu(gate) * up of x @ weight.T for a fused [gate; up] weight (no bias) in one pass of our kernel
        (cpu_gemm.packed_gate_up_silu: bitwise `linear` then attention/cpu's silu_and_mul), where `linear` would
        run our kernel on these rows; None where it would not (oneDNN's or MKL's GEMM, a half that is not whole
        panels), decided before the copy is looked at."""
        widened = weight.dtype in HALF_DTYPES and mode not in NATIVE_MODES
        if not ((widened and mode == "widen")
                or ((weight.dtype == torch.float32 or widened) and self.ours(x.numel() // x.shape[-1]))):
            return None
        self.get(weight, None, mode)
        inter = weight.shape[0] // 2
        if self.panels is None or inter % self.panels.shape[2]:
            return None
        from tandem.common.model import cpu_gemm

        return cpu_gemm.packed_gate_up_silu(x.float() if widened else x, self.panels, inter, x.dtype)

    def drop(self) -> None:
        self.packed = self.panels = self.source = self.key = self.bias = None
        _repacked()


def hooked(module: nn.Module) -> bool:
    """Whether a hook may change what `module` computes: any pre-hook, any forward hook but LoRA's while no adapter
    batch is active (lora.LoRAHooks marks its hooks)."""
    if module._forward_pre_hooks:
        return True
    return any(getattr(getattr(hook, "lora_hooks", None), "active", True) is not None
               for hook in module._forward_hooks.values())


class Linear(nn.Linear):
    """nn.Linear whose CPU forward multiplies by a oneDNN-packed copy of the weight.

    Writes that bypass autograd's version counter (through `param.data`, as weight updates do) must call
    `repack_weights` afterwards; the copy is also rebuilt by itself when the weight's storage, version counter,
    dtype or shape changes (a swapped `.data` on memory resume, an in-place op on the parameter).
    `drop_packed_weights` frees the copies (memory release). Forward hooks (LoRA, tensor parallelism) see the
    same inputs and outputs as nn.Linear's.

    `bf16_matmul` (resolved --cpu-bf16-matmul): `bf16` multiplies a bfloat16 layer in bf16 (bitwise F.linear);
    `fp32` keeps a float32 packed copy (4 bytes a parameter) and `widen` bfloat16 panels our kernel widens in
    registers (2 bytes), both multiplying the input widened to float32 and rounding the output to bfloat16 once,
    as a bf16 GEMM does; only the summation order differs from F.linear (the last bf16 bit of a few outputs in
    10,000). `widen` gives every bit `fp32` gives under TANDEM_CPU_GEMM=tandem. `fp16_matmul` is the same for a
    float16 layer (resolve_fp16_matmul; `fp16` keeps F.linear).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__(in_features, out_features, bias=bias)
        self.prepack = True  # False: plain F.linear (--disable-cpu-weight-prepack)
        self._pack = PackedWeight(cpu_gemm_path())
        self.bf16_matmul, self.fp16_matmul = "bf16", "fp16"

    def packs(self) -> bool:
        """Whether CPU forwards use the packed copy (PackedWeight.usable)."""
        return PackedWeight.usable(self.weight, self.prepack, layer_matmul(self, self.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Under torch.compile the plain linear is traced (Inductor's freezing packs weights itself).
        if not torch.compiler.is_compiling() and x.dtype == self.weight.dtype and self.packs():
            return self._pack.linear(x, self.weight, self.bias, layer_matmul(self, self.weight.dtype))
        return F.linear(x, self.weight, self.bias)

    def packed_weight(self) -> torch.Tensor:
        return self._pack.get(self.weight, self.bias, layer_matmul(self, self.weight.dtype))

    def gate_up_silu(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """For a fused gate/up projection: silu(gate) * up of this layer's forward in one pass of our kernel, as
        its forward then attention/cpu's silu_and_mul compute it (PackedWeight.gate_up_silu); None where that
        kernel would not run this forward, or a hook may change its output."""
        if (torch.compiler.is_compiling() or x.dtype != self.weight.dtype or self.bias is not None or hooked(self)
                or not self.packs()):
            return None
        return self._pack.gate_up_silu(x, self.weight, layer_matmul(self, self.weight.dtype))

    def drop_packed(self) -> None:
        self._pack.drop()


class PackedGroup(nn.Module):
    """A module with several packed weights of its own (an MoE layer's stacked experts): set_weight_prepack,
    repack_weights and drop_packed_weights treat it as they treat a Linear."""

    prepack: bool = True
    bf16_matmul: str = "bf16"
    fp16_matmul: str = "fp16"

    def repack(self) -> None:
        raise NotImplementedError

    def drop_packed(self) -> None:
        raise NotImplementedError


def set_weight_prepack(model: nn.Module, enabled: bool, bf16_matmul: str = "auto") -> None:
    """Turn the packed CPU path of every Linear in `model` on or off, bfloat16 (and float16) layers multiplying in
    `bf16_matmul` (CPU_BF16_MATMULS). On: the copies are built now, so that what the KV pool is sized from
    (available RAM) already excludes them; off: they are freed."""
    mode, fp16_mode = resolve_bf16_matmul(bf16_matmul), resolve_fp16_matmul(bf16_matmul)
    if enabled and mode == "bf16" and not onednn_packs_bf16() and _has_bf16_linear(model):
        _warn_unpacked_bf16()
    for module in model.modules():
        if isinstance(module, (Linear, PackedGroup)):
            module.prepack, module.bf16_matmul, module.fp16_matmul = enabled, mode, fp16_mode
    repack_weights(model)


def _has_bf16_linear(model: nn.Module) -> bool:
    return any(isinstance(m, Linear) and m.weight.dtype == torch.bfloat16 for m in model.modules())


@functools.cache  # once a process
def _warn_unpacked_bf16() -> None:
    logger.warning("--cpu-bf16-matmul bf16: oneDNN cannot pack bfloat16 weights on this CPU (it needs avx512bw/vl/dq "
                   "or avx_ne_convert); bfloat16 linears run unpacked through F.linear (--cpu-bf16-matmul fp32 packs "
                   "a float32 copy instead)")


@torch.no_grad()
def repack_weights(model: nn.Module) -> None:
    """Rebuild every packed copy in `model` from its weight now (after the weights were written in place)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.drop_packed()
            if module.packs():
                module.packed_weight()
        elif isinstance(module, PackedGroup):
            module.repack()


def drop_packed_weights(model: nn.Module) -> None:
    """Free every packed weight copy in `model` (they are rebuilt on the next forward)."""
    for module in model.modules():
        if isinstance(module, (Linear, PackedGroup)):
            module.drop_packed()
