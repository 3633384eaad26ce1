"""Create deterministic built-in models (weights + byte-level BPE tokenizer) in HF format; `tandem model create`."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import tempfile
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral")
PRESETS = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512, max_position_embeddings=2048),
    "small": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=1536, vocab_size=8192, max_position_embeddings=4096),
}
_HF_NAMES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "mixtral": ("MixtralForCausalLM", "mixtral"),
}
# Experts per preset: top_k experts of moe_intermediate_size each are as many active MLP columns as the dense
# preset's intermediate_size on `small` (384 x 4 = 1536), so `tandem bench` compares like with like.
MOE_PRESETS = {
    "tiny": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32),
    "small": dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=384),
}
BOS, EOS, IM_START, IM_END, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>", "<|pad|>"
SPECIAL_TOKENS = [BOS, EOS, IM_START, IM_END, PAD]  # ids 0..4
# ChatML with tools, tool calls and tool results written the way Qwen2.5's template writes them (tool schemas in
# the system turn, <tool_call> JSON in assistant turns, <tool_response> in a user turn), so tool calling works
# end to end with --tool-call-parser hermes. Without tools it renders plain ChatML (no default system prompt).
CHAT_TEMPLATE = """{{- bos_token }}
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
SEED = 1234
# --quantize NAME -> "module:function" writing that format: function(out_dir, tensors, config) writes the weight
# files as the real tool does and returns config.json's contents (with its quantization_config). Imported on use
# (torch: see make_weights).
QUANTIZE_WRITERS = {
    "fp8": "tandem.common.model.quant.fp8:write_fp8_block",  # FineGrainedFP8 / DeepSeek-V3, 128x128 blocks
    "fp8-channel": "tandem.common.model.quant.fp8:write_fp8_channel",  # compressed-tensors FP8, per channel
    "awq": "tandem.common.model.quant.int4_write:write_awq",  # AutoAWQ GEMM
    "gptq": "tandem.common.model.quant.int4_write:write_gptq",  # GPTQModel, checkpoint_format gptq (v1)
    "gptq-actorder": "tandem.common.model.quant.int4_write:write_gptq_actorder",  # GPTQ with desc_act
    "gguf-q4_0": "tandem.common.model.quant.gguf_write:write_q4_0_dir",  # llama.cpp GGUF, Q4_0 (llama only)
}
# Writers that convert a whole written model directory instead: function(hf_dir, out_dir) -> path (the GGUF file
# holds the tokenizer and config too).
DIR_WRITERS = ("gguf-q4_0",)


def model_config_dict(arch: str, preset: str) -> dict[str, Any]:
    """config.json contents, with the keys HF's config class for `arch` expects."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    architecture, model_type = _HF_NAMES[arch]
    cfg: dict[str, Any] = {"architectures": [architecture], "model_type": model_type, **PRESETS[preset]}
    cfg.update(hidden_act="silu", rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
               initializer_range=0.02, bos_token_id=0, eos_token_id=1, pad_token_id=4,
               tie_word_embeddings=arch == "qwen2", torch_dtype="float32", use_cache=True)
    if arch == "llama":
        cfg.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    elif arch == "mistral":
        cfg.update(sliding_window=None)
    elif arch == "qwen2":
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg["num_hidden_layers"])
    elif arch == "qwen3":  # explicit head_dim that differs from hidden/heads, q/k norm
        cfg.update(head_dim=2 * cfg["hidden_size"] // cfg["num_attention_heads"], attention_bias=False,
                   use_sliding_window=False, sliding_window=None, max_window_layers=cfg["num_hidden_layers"])
    else:
        _moe_config(cfg, arch, preset)
    return cfg


def _moe_config(cfg: dict[str, Any], arch: str, preset: str) -> None:
    """The MoE keys: Qwen3-MoE (q/k norm, normalized top-k; on tiny its last layer dense through mlp_only_layers),
    Qwen2-MoE (q/k/v bias, a gated shared expert, unnormalized top-k) and Mixtral (experts' width in
    intermediate_size)."""
    moe = MOE_PRESETS[preset]
    layers = cfg["num_hidden_layers"]
    if arch == "mixtral":
        cfg.update(num_local_experts=moe["num_experts"], num_experts_per_tok=moe["num_experts_per_tok"],
                   intermediate_size=moe["moe_intermediate_size"], sliding_window=None, router_jitter_noise=0.0,
                   output_router_logits=False, router_aux_loss_coef=0.001)
        return
    cfg.update(moe, decoder_sparse_step=1, output_router_logits=False, router_aux_loss_coef=0.001,
               use_sliding_window=False, sliding_window=None, max_window_layers=layers)
    if arch == "qwen3_moe":
        cfg.update(head_dim=2 * cfg["hidden_size"] // cfg["num_attention_heads"], attention_bias=False,
                   norm_topk_prob=True, mlp_only_layers=[layers - 1] if preset == "tiny" else [])
    else:
        cfg.update(norm_topk_prob=False, mlp_only_layers=[], qkv_bias=True,
                   shared_expert_intermediate_size=2 * moe["moe_intermediate_size"])


def _weight_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q_size, kv_size = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    qwen2 = cfg["model_type"] in ("qwen2", "qwen2_moe")
    qwen3 = cfg["model_type"] in ("qwen3", "qwen3_moe")
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes.update({
            f"{p}.input_layernorm.weight": (hidden,), f"{p}.post_attention_layernorm.weight": (hidden,),
            f"{p}.self_attn.q_proj.weight": (q_size, hidden), f"{p}.self_attn.k_proj.weight": (kv_size, hidden),
            f"{p}.self_attn.v_proj.weight": (kv_size, hidden), f"{p}.self_attn.o_proj.weight": (hidden, q_size),
        })
        shapes.update(_mlp_shapes(cfg, i) if _is_moe_layer(cfg, i) else _swiglu_shapes(f"{p}.mlp", hidden, inter))
        if qwen2:
            shapes.update({f"{p}.self_attn.q_proj.bias": (q_size,), f"{p}.self_attn.k_proj.bias": (kv_size,),
                           f"{p}.self_attn.v_proj.bias": (kv_size,)})
        if qwen3:
            shapes.update({f"{p}.self_attn.q_norm.weight": (head_dim,), f"{p}.self_attn.k_norm.weight": (head_dim,)})
    return shapes


def _is_moe_layer(cfg: dict[str, Any], layer: int) -> bool:
    if cfg["model_type"] == "mixtral":
        return True
    if "num_experts" not in cfg:
        return False
    return layer not in cfg["mlp_only_layers"] and (layer + 1) % cfg["decoder_sparse_step"] == 0


def _swiglu_shapes(prefix: str, hidden: int, inter: int, names=("gate_proj", "up_proj", "down_proj")) -> dict:
    gate, up, down = names
    return {f"{prefix}.{gate}.weight": (inter, hidden), f"{prefix}.{up}.weight": (inter, hidden),
            f"{prefix}.{down}.weight": (hidden, inter)}


def _mlp_shapes(cfg: dict[str, Any], layer: int) -> dict[str, tuple[int, ...]]:
    """An MoE layer's tensors, under the names its architecture's checkpoints use."""
    hidden, p = cfg["hidden_size"], f"model.layers.{layer}"
    if cfg["model_type"] == "mixtral":
        shapes = {f"{p}.block_sparse_moe.gate.weight": (cfg["num_local_experts"], hidden)}
        for e in range(cfg["num_local_experts"]):
            shapes.update(_swiglu_shapes(f"{p}.block_sparse_moe.experts.{e}", hidden, cfg["intermediate_size"],
                                         ("w1", "w3", "w2")))
        return shapes
    shapes = {f"{p}.mlp.gate.weight": (cfg["num_experts"], hidden)}
    for e in range(cfg["num_experts"]):
        shapes.update(_swiglu_shapes(f"{p}.mlp.experts.{e}", hidden, cfg["moe_intermediate_size"]))
    if cfg.get("shared_expert_intermediate_size"):
        shapes.update(_swiglu_shapes(f"{p}.mlp.shared_expert", hidden, cfg["shared_expert_intermediate_size"]))
        shapes[f"{p}.mlp.shared_expert_gate.weight"] = (1, hidden)
    return shapes


def make_weights(cfg: dict[str, Any], seed: int = SEED) -> dict:
    """Seeded random weights. Norm weights and biases are perturbed too, so parity tests exercise them."""
    import torch  # torch: `tandem up` and the bench tools import this module (default_model_dir) without it

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in sorted(_weight_shapes(cfg).items()):
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith(".bias"):
            t = 0.1 * torch.randn(shape, generator=gen)
        elif "embed_tokens" in name:
            # Tied embeddings make a token's own logit grow with its embedding norm; keep it small there
            # so greedy decoding does not just repeat the input token.
            t = (0.15 if cfg["tie_word_embeddings"] else 0.5) * torch.randn(shape, generator=gen)
        else:  # std ~ 1/sqrt(fan_in) keeps activations O(1); x1.5 for livelier, varied greedy outputs
            t = torch.randn(shape, generator=gen) * (1.5 / shape[1] ** 0.5)
        tensors[name] = t.contiguous()
    return tensors


# ---- tokenizer -----------------------------------------------------------------------------------

_WORDS = ("the of and to in is was for on that with as by at from it be this are or an have not which "
          "one all were they their there has been more will would can about when what time people year "
          "model token server request prefill decode cache page memory batch router worker stream river "
          "mountain city garden music light morning story house water window table paper friend quiet "
          "bright small large green blue happy early late north south quickly slowly very good new old").split()
_SYLLABLES = ("ka ro mi ten sa lo ver an ti mus pe dor la qui ne zo ba fi gen tor el ma chi ru de "
              "po sen li val or ca ny est ul gra fen ho").split()
_EXTRA = ["café", "naïve", "résumé", "élève", "Zürich", "façade", "niño", "Ελλάδα", "Москва",
          "中文", "你好", "世界", "日本語", "東京", "한국어", "🙂", "🚀", "🌍", "✨", "👍🏽"]
_PUNCT = [".", ",", "!", "?", ";", ":", " -", "...", " (", ")", "\""]


def build_corpus(num_sentences: int) -> list[str]:
    """A deterministic English-like corpus: words, pseudo-words, numbers, punctuation, UTF-8."""
    rng = random.Random(SEED)
    lexicon = list(_WORDS)
    lexicon += ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4))) for _ in range(4000)]
    lines = []
    for _ in range(num_sentences):
        words = []
        for _ in range(rng.randint(4, 16)):
            r = rng.random()
            if r < 0.06:
                words.append(str(rng.randint(0, 10 ** rng.randint(1, 6))))
            elif r < 0.09:
                words.append(rng.choice(_EXTRA))
            elif r < 0.5:
                words.append(rng.choice(_WORDS))
            else:
                words.append(rng.choice(lexicon))
            if rng.random() < 0.08:
                words[-1] += rng.choice(_PUNCT)
        line = " ".join(words)
        lines.append(line[0].upper() + line[1:] + rng.choice([".", ".", ".", "!", "?"]))
    return lines


def train_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer (tokenizers library) trained on the built-in corpus."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    tokenizer.train_from_iterator(build_corpus(4000 if vocab_size <= 1024 else 40000), trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)])
    return tokenizer


# The Qwen model types' tokenizer class, as their checkpoints name it; transformers 5 makes any qwen2 model a
# Qwen2Tokenizer whatever tokenizer_config.json says. That class keeps tokenizer.json's vocabulary and merges but
# builds its own normalizer and pre-tokenizer (this regex, transformers' qwen2/tokenization_qwen2.py), so the files
# written for these archs carry the same: tokenizer.json alone then encodes as AutoTokenizer does.
_QWEN_ARCHS = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe")
_QWEN_PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                           r"""\s*[\r\n]+|\s+(?!\S)|\s+""")


def arch_tokenizer(arch: str, vocab_size: int):
    """The built-in tokenizer as `arch`'s tokenizer class builds it: one vocabulary and merges for every arch."""
    tokenizer = train_tokenizer(vocab_size)
    if arch in _QWEN_ARCHS:
        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return tokenizer


def _tokenizer_config(max_len: int, arch: str) -> dict[str, Any]:
    qwen = arch in _QWEN_ARCHS
    return {
        "added_tokens_decoder": {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True}
                                 for i, t in enumerate(SPECIAL_TOKENS)},
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "additional_special_tokens": [IM_START, IM_END],
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        # Llama 3's choice for a byte-level BPE (LlamaTokenizer would rebuild it as SentencePiece's Metaspace).
        "tokenizer_class": "Qwen2Tokenizer" if qwen else "PreTrainedTokenizerFast",
        # Qwen2Tokenizer's default unk_token "<|endoftext|>" would be added at id vocab_size, past the embeddings.
        **({"unk_token": None} if qwen else {}),
    }


# ---- files ----------------------------------------------------------------------------------------

def _write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True, ensure_ascii=False)
        f.write("\n")


def save_weights(out_dir: str, tensors: dict) -> None:
    """model.safetensors in out_dir."""
    from safetensors.torch import save_file  # torch: see make_weights

    weights_path = os.path.join(out_dir, "model.safetensors")
    save_file(tensors, weights_path, metadata={"format": "pt"})
    os.chmod(weights_path, 0o644)  # safetensors writes 0600; the other files get the umask default


def quantize_writer(name: str):
    """The --quantize table's writer for `name`."""
    if name not in QUANTIZE_WRITERS:
        raise ValueError(f"unknown --quantize {name!r}; choose one of {', '.join(QUANTIZE_WRITERS)}")
    module, function = QUANTIZE_WRITERS[name].split(":")
    return getattr(importlib.import_module(module), function)


def create_model(out_dir: str, arch: str = "llama", preset: str = "tiny", seed: int = SEED,
                 quantize: str | None = None) -> str:
    """Write config, weights, generation config and tokenizer files to out_dir; byte-identical each time. Another
    `seed` gives other weights of the same architecture and tokenizer (a checkpoint to update weights to).
    `quantize` (QUANTIZE_WRITERS): the same weights written in that quantized format."""
    if quantize in DIR_WRITERS:
        with tempfile.TemporaryDirectory() as hf_dir:
            return quantize_model_dir(create_model(hf_dir, arch, preset, seed), out_dir, quantize)
    cfg = model_config_dict(arch, preset)
    tensors = make_weights(cfg, seed)
    os.makedirs(out_dir, exist_ok=True)
    if quantize is None:
        save_weights(out_dir, tensors)
    else:
        cfg = quantize_writer(quantize)(out_dir, tensors, cfg)
    _write_json(os.path.join(out_dir, "config.json"), cfg)
    _write_json(os.path.join(out_dir, "generation_config.json"),
                {"bos_token_id": 0, "eos_token_id": [1, 3], "pad_token_id": 4, "do_sample": False})
    arch_tokenizer(arch, cfg["vocab_size"]).save(os.path.join(out_dir, "tokenizer.json"), pretty=False)
    _write_json(os.path.join(out_dir, "tokenizer_config.json"),
                _tokenizer_config(cfg["max_position_embeddings"], arch))
    _write_json(os.path.join(out_dir, "special_tokens_map.json"),
                {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "additional_special_tokens": [IM_START, IM_END]})
    return out_dir


def quantize_model_dir(hf_dir: str, out_dir: str, quantize: str) -> str:
    """Write `hf_dir`'s checkpoint into `out_dir` in a whole-directory format (DIR_WRITERS: GGUF)."""
    if quantize not in DIR_WRITERS:
        raise ValueError(f"unknown --quantize {quantize!r} for a directory; choose one of {', '.join(DIR_WRITERS)}")
    return quantize_writer(quantize)(hf_dir, out_dir)


def default_model_dir(preset: str = "small", arch: str = "llama") -> str:
    """The random-weight model of `preset` and `arch` (the benchmarks' small Llama by default), created on first
    use under $TANDEM_CACHE_DIR (default ~/.cache/tandem); built-in name PRESET-ARCH."""
    from tandem.common.model.builtin import builtin_model_path

    return builtin_model_path(f"{preset}-{arch}")


# ---- CLI --------------------------------------------------------------------------------------------

def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `model create DIR [--arch] [--preset] [--force]`."""
    model = subparsers.add_parser("model", help="built-in model utilities")
    sub = model.add_subparsers(dest="model_command", required=True)
    create = sub.add_parser("create", help="write a deterministic built-in model in HF format")
    create.add_argument("dir", help="output directory")
    create.add_argument("--arch", choices=ARCHS, default="llama",
                        help="model family, as its config.json names it (default: llama)")
    create.add_argument("--preset", choices=sorted(PRESETS), default="small",
                        help="size: tiny (tests) or small (benchmarks; built-in name small-llama) (default: small)")
    create.add_argument("--force", action="store_true", help="overwrite a non-empty directory")
    create.add_argument("--seed", type=int, default=SEED,
                        help=f"weights' random seed (default {SEED}); another seed, another checkpoint of the same "
                             "architecture and tokenizer")
    create.add_argument("--quantize", choices=list(QUANTIZE_WRITERS), default=None,
                        help="write the weights quantized, as the real tools do: fp8 (FineGrainedFP8 128x128 "
                             "blocks, DeepSeek-V3's layout), fp8-channel (compressed-tensors FP8, per channel), awq "
                             "(AutoAWQ GEMM), gptq (GPTQModel), gptq-actorder (desc_act), gguf-q4_0 (a llama.cpp GGUF "
                             "file, DIR/model-Q4_0.gguf; llama only); dense archs (default: unquantized)")
    create.set_defaults(func=run_create)


def run_create(args: argparse.Namespace) -> int:
    if os.path.isdir(args.dir) and os.listdir(args.dir) and not args.force:
        raise ValueError(f"{args.dir!r} is not empty; pass --force to overwrite it")
    create_model(args.dir, arch=args.arch, preset=args.preset, seed=args.seed, quantize=args.quantize)
    print(args.dir)
    return 0
