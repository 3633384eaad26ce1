"""Load a HF-format Llama-family checkpoint (safetensors, single or sharded); its tokenizer: common.tokenizer."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import torch
from safetensors import safe_open
from torch.overrides import TorchFunctionMode

from tandem.common.model.attention import create_attention_backend
from tandem.common.model.config import ModelConfig
from tandem.common.model.cpu_linear import set_weight_prepack
from tandem.common.model.llama import LlamaForCausalLM
from tandem.common.flags import ConfigError
from tandem.common.model.moe import MOE_RUNNERS, moe_blocks
from tandem.common.model.moe_weights import expert_sources
from tandem.common.memory.kv_scales import is_kv_scale
from tandem.common.model.quant.base import bf16_weight_bytes, quantize_model, resolve_method, weight_bytes
from tandem.common.model.parallel.dist import TPGroup
from tandem.common.model.parallel.experts import ExpertLocation, check_ep, initial_location
from tandem.common.model.parallel.layers import TPShard, local_config, parallelize
from tandem.common.model.parallel.stages import PipelineStage, StageModel

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "half": torch.float16}

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class WeightLoadError(ValueError):
    """The checkpoint's weights do not match what the config describes."""


class _SkipInit(TorchFunctionMode):
    """Skip torch.nn.init while the meta module is built: the checkpoint overwrites every value anyway, and a meta
    tensor's random init goes through torch._refs, whose first call imports torch._dynamo (about 4 s of CPU in every
    worker and rank that never compiles)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


def resolve_dtype(dtype: Union[str, torch.dtype], config: ModelConfig) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = config.torch_dtype.replace("torch.", "") if dtype == "auto" else dtype
    if name not in _DTYPES:
        if dtype == "auto":
            return torch.float32
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
    return _DTYPES[name]


def load_model(path: str, dtype: Union[str, torch.dtype] = "auto", device: Union[str, torch.device] = "cpu",
               attention_backend: str = "auto", tp: Optional[tuple[TPShard, TPGroup]] = None,
               stage: Optional[PipelineStage] = None,
               cpu_weight_prepack: bool = True, cpu_bf16_matmul: str = "auto",
               ep_redundant_experts: int = 0, init_expert_location: Optional[str] = None,
               expert_location: Optional[ExpertLocation] = None,
               moe_runner: str = "auto",
               quantization: Optional[str] = None) -> tuple[ModelConfig, LlamaForCausalLM]:
    """Build the model on `device` in `dtype` and fill it from the checkpoint in `path`. With `tp` (a shard and its
    group) only that rank's part is built, and only its slices are read from the safetensors. With `stage` (a
    pipeline stage) only that stage's layers (and the embedding or the final norm and LM head) are built and read:
    a StageModel; with both, that stage's shard. `cpu_weight_prepack`: CPU linears run on oneDNN-packed weight
    copies (common/model/cpu_linear.py), at the cost of a second copy; `cpu_bf16_matmul` how bfloat16 ones multiply.
    An MoE model's experts get `ep_redundant_experts` extra slots per layer, placed by `expert_location`, else by
    the `init_expert_location` file, else expert i in slot i (parallel/experts.py); `moe_runner`: moe.MOE_RUNNERS.
    A quantized checkpoint (config.json quantization_config), or `quantization` (online: --quantization) over an
    unquantized one, gets its projections as quant.base.QuantizedLinear, read in their quantized form."""
    config = ModelConfig.from_pretrained(path)
    method = resolve_method(config.quantization, config, quantization)
    if method is not None:
        method.check(config, tp[0].size if tp is not None else 1)
    ep_size = tp[0].ep_size if tp is not None else 1
    check_ep(config, tp[0].size if tp is not None else 1, ep_size, ep_redundant_experts)
    if config.moe is not None:
        if expert_location is None:
            expert_location = initial_location(config, ep_size, ep_redundant_experts, init_expert_location)
        config = with_physical_experts(config, expert_location.num_physical)
    torch_dtype = resolve_dtype(dtype, config)
    device = torch.device(device)
    backend = create_attention_backend(attention_backend, device=device)
    shard = tp[0] if tp is not None else None
    with torch.device("meta"), _SkipInit():
        model = _build(config, backend, tp, stage, torch_dtype)
    # Cast while still on meta so real memory is allocated once, in the final dtype. torch.empty, not to_empty's
    # empty_like: empty_like of a meta tensor runs a Python reference that imports sympy and torch.fx's symbolic
    # shapes (~0.3 s of CPU in every worker's and rank's start-up).
    model.to(torch_dtype)._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    if config.tie_word_embeddings and stage is None:  # _apply re-creates parameters, so tie again
        model.lm_head.weight = model.model.embed_tokens.weight
    with ExitStack() as stack:
        read = _open_checkpoint(path, stack, config)
        if method is not None:
            swapped = quantize_model(model, method, config, read, shard, torch_dtype, device)
            logger.info("%s: %d projections quantized", method.describe(), swapped)
        _fill_weights(model, config, read, shard, whole=stage is None, location=expert_location)
    model.rotary_emb.init_cache(device)
    if config.moe is not None:
        place_experts(model, config, expert_location, shard.ep_rank if shard is not None else 0)
        # The current placement: EPLB moves experts from it (parallel/expert_move.py) and replaces it; runtime
        # weight updates find each expert's slots in it (control/weights.py).
        model.expert_location = expert_location
        set_moe_runner(model, moe_runner, device)
    set_weight_prepack(model, cpu_weight_prepack, cpu_bf16_matmul)
    model.eval()
    logger.info("loaded %s (%s, %d layers, %.1fM params) as %s on %s", path, config.architecture,
                config.num_layers, sum(p.numel() for p in model.parameters()) / 1e6, torch_dtype, device)
    if method is not None:
        logger.info("weights: %.1f MiB resident (%.1f MiB in bfloat16)", weight_bytes(model) / 2**20,
                    bf16_weight_bytes(model) / 2**20)
    return config, model


def with_physical_experts(config: ModelConfig, num_physical: int) -> ModelConfig:
    return dataclasses.replace(config, moe=dataclasses.replace(config.moe, num_physical_experts=num_physical))


def place_experts(model: torch.nn.Module, config: ModelConfig, location: ExpertLocation, ep_rank: int) -> None:
    """Tell every MoE block which physical copies of each expert exist and which of them this rank holds."""
    for block in moe_blocks(model):
        block.set_placement(*location.block_maps(block.moe_index, config.moe.num_experts, ep_rank))


def set_moe_runner(model: torch.nn.Module, runner: str, device: torch.device) -> None:
    """`auto`: the Triton fused-MoE kernel on CUDA, the grouped torch path elsewhere."""
    if runner not in MOE_RUNNERS:
        raise ValueError(f"--moe-runner-backend must be one of {', '.join(MOE_RUNNERS)}, got {runner!r}")
    chosen = runner if runner != "auto" else ("triton" if device.type == "cuda" else "torch")
    if chosen == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError("--moe-runner-backend triton on CPU needs TRITON_INTERPRET=1 (Triton's interpreter; for "
                          "testing the kernel): use torch on CPU")
    for block in moe_blocks(model):
        block.experts.runner = chosen


def _build(config: ModelConfig, backend, tp: Optional[tuple[TPShard, TPGroup]],
           stage: Optional[PipelineStage], dtype: torch.dtype) -> torch.nn.Module:
    """The (meta) module of this rank: the whole model, a pipeline stage, a tensor-parallel shard, or one stage's
    shard (tp x pp)."""
    local = config
    if tp is not None:
        local = local_config(config, tp[0])
    backend.configure(local.num_heads, local.num_kv_heads, local.head_dim, dtype)
    if stage is not None:
        model = StageModel(local, backend, stage)
    else:
        model = LlamaForCausalLM(local, backend)
    if tp is not None:
        parallelize(model, config, *tp)
    return model


def _open_checkpoint(path: str, stack: ExitStack, config: Optional[ModelConfig] = None) -> "_WeightReader":
    if config is not None and (config.quantization or {}).get("quant_method") == "gguf":
        from tandem.common.model.quant.gguf_file import GGUFReader  # the gguf package: only for a .gguf

        return GGUFReader.open(config.quantization["file"], config)
    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files, weight_map = ["model.safetensors"], {}
    else:
        raise FileNotFoundError(f"{path!r} has neither model.safetensors nor model.safetensors.index.json "
                                "(only safetensors checkpoints are supported)")
    handles = {}
    for name in files:
        file_path = os.path.join(path, name)
        if not os.path.isfile(file_path):
            raise FileNotFoundError(f"checkpoint shard {file_path!r} listed in the index is missing")
        handles[name] = stack.enter_context(safe_open(file_path, framework="pt", device="cpu"))
    where = {key: fname for fname, h in handles.items() for key in h.keys()}
    return _WeightReader(path, handles, where)


@dataclass
class _WeightReader:
    path: str
    handles: dict
    where: dict[str, str]  # tensor name -> shard file
    used: set[str] = field(default_factory=set)

    def shape(self, name: str) -> list[int]:
        """The tensor's shape, read from the header only."""
        if name not in self.where:
            raise WeightLoadError(f"checkpoint {self.path!r} is missing weight {name!r}")
        return list(self.handles[self.where[name]].get_slice(name).get_shape())

    def has(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str, dim: int = 0, part: Optional[range] = None) -> torch.Tensor:
        """The tensor, or only rows (dim 0) / columns (dim 1) `part` of it: a shard reads just its slice."""
        if name not in self.where:
            raise WeightLoadError(f"checkpoint {self.path!r} is missing weight {name!r}")
        self.used.add(name)
        handle = self.handles[self.where[name]]
        if part is None:
            return handle.get_tensor(name)
        piece = handle.get_slice(name)
        return piece[part.start:part.stop] if dim == 0 else piece[:, part.start:part.stop]


def _fill_weights(model: LlamaForCausalLM, config: ModelConfig, read: _WeightReader,
                  shard: Optional[TPShard] = None, whole: bool = True,
                  location: Optional[ExpertLocation] = None) -> None:
    """Copy every parameter from its HF tensor(s); fused parameters concatenate several. `whole`: the model uses
    the whole checkpoint (a pipeline stage reads only its part, and a last stage of a tied model its LM head from
    the embedding). `location`: which logical expert each of this rank's expert slots holds (MoE)."""
    sources = _weight_sources(config) if shard is None else _shard_sources(config, shard)
    if config.moe is not None:
        sources.update(expert_sources(config, shard or TPShard(0, 1), location))
    if config.tie_word_embeddings and not whole:
        sources["lm_head.weight"] = sources["model.embed_tokens.weight"]
    params = dict(model.named_parameters(remove_duplicate=True))
    for name, param in params.items():
        if name not in sources:
            raise WeightLoadError(f"no checkpoint mapping for parameter {name!r}")
        tensor = sources[name](read)
        if tensor.shape != param.shape:
            raise WeightLoadError(f"weight {name!r} in {read.path!r} has shape {tuple(tensor.shape)}, "
                                  f"expected {tuple(param.shape)} from config.json")
        if tensor.dtype in _FP8_DTYPES:  # a scale-less cast would serve wrong weights
            raise WeightLoadError(f"weight {name!r} in {read.path!r} is {tensor.dtype} but its module is not "
                                  "quantized here (a quantized LM head or embedding is not supported; or "
                                  "quantization_config's ignore / modules_to_not_convert lists the module)")
        with torch.no_grad():
            param.copy_(tensor.to(param.dtype))
    unused = sorted(set(read.where) - read.used - {"lm_head.weight"})
    unused = [n for n in unused if not n.endswith("rotary_emb.inv_freq") and not is_kv_scale(n)]  # kv_scales.py
    if config.moe is not None and location is not None and location.ep_size > 1:
        unused = [n for n in unused if ".experts." not in n]  # the other expert-parallel ranks' experts
    if unused and whole:
        logger.warning("ignoring %d checkpoint tensors the model does not use, e.g. %s", len(unused), unused[:3])


def _weight_sources(config: ModelConfig) -> dict[str, Callable[[_WeightReader], torch.Tensor]]:
    """Our parameter name -> how to build it from HF tensor names."""
    def one(hf_name: str):
        return lambda r: r.get(hf_name)

    def cat(*hf_names: str):
        return lambda r: torch.cat([r.get(n) for n in hf_names], dim=0)

    sources = {
        "model.embed_tokens.weight": one("model.embed_tokens.weight"),
        "model.norm.weight": one("model.norm.weight"),
    }
    if not config.tie_word_embeddings:  # tied: lm_head shares the embedding (named_parameters lists it once)
        sources["lm_head.weight"] = one("lm_head.weight")
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}", f"model.layers.{i}"
        attn = f"{hf}.self_attn"
        sources[f"{ours}.input_layernorm.weight"] = one(f"{hf}.input_layernorm.weight")
        sources[f"{ours}.post_attention_layernorm.weight"] = one(f"{hf}.post_attention_layernorm.weight")
        sources[f"{ours}.self_attn.qkv_proj.weight"] = cat(*(f"{attn}.{p}_proj.weight" for p in "qkv"))
        if config.attention_bias:
            sources[f"{ours}.self_attn.qkv_proj.bias"] = cat(*(f"{attn}.{p}_proj.bias" for p in "qkv"))
        sources[f"{ours}.self_attn.o_proj.weight"] = one(f"{attn}.o_proj.weight")
        if config.qk_norm:
            sources[f"{ours}.self_attn.q_norm.weight"] = one(f"{attn}.q_norm.weight")
            sources[f"{ours}.self_attn.k_norm.weight"] = one(f"{attn}.k_norm.weight")
        if not config.is_moe_layer(i):
            sources[f"{ours}.mlp.gate_up_proj.weight"] = cat(f"{hf}.mlp.gate_proj.weight", f"{hf}.mlp.up_proj.weight")
            sources[f"{ours}.mlp.down_proj.weight"] = one(f"{hf}.mlp.down_proj.weight")
    return sources


def _shard_sources(config: ModelConfig, shard: TPShard) -> dict[str, Callable[[_WeightReader], torch.Tensor]]:
    """Like _weight_sources, for one tensor-parallel rank: its q/kv heads and MLP columns (rows of the
    column-parallel weights, columns of the row-parallel ones), its vocabulary rows zero-padded to an equal share."""
    hd = config.head_dim
    q = shard.q_heads(config)
    kv = shard.kv_heads(config)
    q_rows, kv_rows = range(q.start * hd, q.stop * hd), range(kv.start * hd, kv.stop * hd)
    mlp = shard.intermediate(config)
    vocab, per = shard.vocab(config), shard.vocab_rows_per_rank(config)

    def vocab_rows(hf_name: str):
        def read(r: _WeightReader) -> torch.Tensor:
            rows = r.get(hf_name, 0, vocab)
            return torch.cat([rows, rows.new_zeros(per - rows.shape[0], rows.shape[1])]) if rows.shape[0] < per else rows
        return read

    def qkv(attn: str, kind: str):
        return lambda r: torch.cat([r.get(f"{attn}.q_proj.{kind}", 0, q_rows), r.get(f"{attn}.k_proj.{kind}", 0, kv_rows),
                                    r.get(f"{attn}.v_proj.{kind}", 0, kv_rows)])

    sources = _weight_sources(config)  # the replicated ones (norms) as they are; the sharded ones replaced below
    sources["model.embed_tokens.weight"] = vocab_rows("model.embed_tokens.weight")
    if not config.tie_word_embeddings:
        sources["lm_head.weight"] = vocab_rows("lm_head.weight")
    for i in range(config.num_layers):
        p = f"model.layers.{i}"
        attn, mlp_name = f"{p}.self_attn", f"{p}.mlp"
        sources[f"{attn}.qkv_proj.weight"] = qkv(attn, "weight")
        if config.attention_bias:
            sources[f"{attn}.qkv_proj.bias"] = qkv(attn, "bias")
        sources[f"{attn}.o_proj.weight"] = lambda r, n=f"{attn}.o_proj.weight": r.get(n, 1, q_rows)
        if not config.is_moe_layer(i):
            sources[f"{mlp_name}.gate_up_proj.weight"] = lambda r, m=mlp_name: torch.cat(
                [r.get(f"{m}.gate_proj.weight", 0, mlp), r.get(f"{m}.up_proj.weight", 0, mlp)])
            sources[f"{mlp_name}.down_proj.weight"] = lambda r, n=f"{mlp_name}.down_proj.weight": r.get(n, 1, mlp)
    return sources
