"""GGUF weights in their quantized form: each block type against gguf-py's reference, the kernels against the
dequantized weight, and a `tandem model create --quantize gguf-q4_0` model against transformers' GGUF loader."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402

from tandem.common.errors import UnsupportedModelError  # noqa: E402
from tandem.common.model.config import ModelConfig  # noqa: E402
from tandem.common.model.loader import load_model  # noqa: E402
from tandem.common.model.quant.base import quantized_linears  # noqa: E402
from tandem.common.model import cpu_gemm  # noqa: E402
from tandem.common.model.quant.gguf import GroupedLinear, Int4Linear, QuantizedEmbedding  # noqa: E402

WIDTHS = cpu_gemm.panel_widths()
from tandem.common.model.quant.gguf_quants import unpack  # noqa: E402
from tandem.common.model.quant.gguf_write import quantize_q4_0  # noqa: E402

ROWS, COLS = 32, 512


def _k_quant_blocks(kind: T, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_K / Q6_K blocks (gguf-py cannot quantize to them) with small finite f16 super-scales."""
    size = {T.Q4_K: 144, T.Q6_K: 210}[kind]
    raw = rng.integers(0, 256, (ROWS, COLS // 256, size), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.05, (ROWS, COLS // 256, 2)).astype(np.float16).view(np.uint8)
    if kind == T.Q4_K:
        raw[..., 0:4] = scales.reshape(ROWS, COLS // 256, 4)  # d, dmin
    else:
        raw[..., 208:210] = scales[..., :2]  # d
    return raw.reshape(ROWS, -1)


def _blocks(kind: T) -> np.ndarray:
    rng = np.random.default_rng(int(kind))
    if kind in (T.Q4_K, T.Q6_K):
        return _k_quant_blocks(kind, rng)
    return gguf.quants.quantize(rng.standard_normal((ROWS, COLS)).astype(np.float32), kind)


@pytest.mark.parametrize("kind", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q6_K])
def test_unpacked_codes_dequantize_like_gguf_py(kind):
    raw = _blocks(kind)
    got = unpack(int(kind), torch.from_numpy(raw.copy()), COLS).dequantize()
    np.testing.assert_array_equal(got.numpy(), gguf.quants.dequantize(raw, kind))


@pytest.mark.parametrize("ours", [True, False])  # False: as where Tandem's GEMM kernel does not build
@pytest.mark.parametrize("kind,linear", [(T.Q4_0, Int4Linear), (T.Q4_1, Int4Linear), (T.Q4_K, Int4Linear),
                                         (T.Q8_0, GroupedLinear), (T.Q6_K, GroupedLinear),
                                         (T.Q4_1, GroupedLinear)])  # 4-bit off CPU: codes a byte each
def test_quantized_linear_multiplies_by_the_dequantized_weight(monkeypatch, kind, linear, ours):
    if not ours:
        monkeypatch.setattr(cpu_gemm, "panel_widths", lambda: ())
    codes = unpack(int(kind), torch.from_numpy(_blocks(kind).copy()), COLS)
    if linear is Int4Linear:
        module = Int4Linear(codes, torch.float32, False)
    else:
        module = GroupedLinear(codes, torch.float32, False, torch.device("cpu"))
        module.block_rows = 5  # several row blocks, the last one short
    assert module.ours == (ours and bool(WIDTHS))
    weight = torch.from_numpy(gguf.quants.dequantize(_blocks(kind), kind))
    for x in (torch.randn(3, 7, COLS), torch.randn(2, COLS)):  # GroupedLinear: by row blocks, then group by group
        torch.testing.assert_close(module(x), x @ weight.t(), rtol=1e-4, atol=1e-4 * weight.abs().max().item())
    torch.testing.assert_close(module.dequantize(), weight, rtol=0, atol=1e-6)
    if linear is GroupedLinear:  # an embedding's lookup: any rows, in any order, repeated
        ids = torch.tensor([3, 0, ROWS - 1, 3])
        torch.testing.assert_close(module.rows(ids, torch.float32), weight[ids], rtol=0, atol=1e-6)
        bf16 = module.rows(slice(2, 9), torch.bfloat16)  # multiplied in bf16: its rounding
        assert bf16.dtype == torch.bfloat16
        torch.testing.assert_close(bf16.float(), weight[2:9], rtol=0, atol=2 ** -6 * weight.abs().max().item())
    if linear is Int4Linear:  # half a byte a weight plus a (scale, zero) pair per 32
        assert module.resident_bytes() == ROWS * COLS // 2 + ROWS * COLS // 32 * 2 * 4
        # bfloat16: the same kernel (or torch's int4 kernel), its scales and offsets in bf16, within bf16's rounding
        half = Int4Linear(codes, torch.bfloat16, False)
        assert half.ours == module.ours
        assert half.resident_bytes() == ROWS * COLS // 2 + ROWS * COLS // 32 * 2 * 2
        x = torch.randn(5, COLS)
        torch.testing.assert_close(half(x.bfloat16()).float(), x @ weight.t(), rtol=0.05,
                                   atol=0.05 * (x @ weight.t()).abs().max().item())


def test_q4_0_writer_matches_ggml_bytes():
    weight = torch.randn(64, 256)
    weight[3, :32] = 0  # an all-zero block: d = 0
    np.testing.assert_array_equal(quantize_q4_0(weight), gguf.quants.quantize(weight.numpy(), T.Q4_0))


@pytest.fixture(scope="module")
def q4_0_model(model_factory, tmp_path_factory) -> str:
    from tandem.common.model.create import quantize_model_dir

    out = str(tmp_path_factory.mktemp("gguf-q4_0"))
    quantize_model_dir(model_factory("llama"), out, "gguf-q4_0")
    return out


@pytest.fixture(scope="module")
def hf_q4_0(q4_0_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(q4_0_model, gguf_file="model-Q4_0.gguf",
                                                dtype=torch.float32).eval()


def test_created_gguf_reads_as_transformers_dequantizes_it(q4_0_model, hf_q4_0):
    config, model = load_model(q4_0_model, dtype="float32")
    assert config.quantization["quant_method"] == "gguf" and not config.tie_word_embeddings
    ref = hf_q4_0.state_dict()
    linears = dict(quantized_linears(model))
    assert isinstance(linears["lm_head"], Int4Linear)
    for name, module in linears.items():
        if name.startswith("model.embed_tokens"):
            continue
        prefix = name.rsplit(".", 1)[0]
        if name.endswith("qkv_proj"):
            want = torch.cat([ref[f"{prefix}.{p}_proj.weight"] for p in "qkv"])
        elif name.endswith("gate_up_proj"):
            want = torch.cat([ref[f"{prefix}.gate_proj.weight"], ref[f"{prefix}.up_proj.weight"]])
        else:
            want = ref[f"{name}.weight"]
        torch.testing.assert_close(module.dequantize(), want, rtol=0, atol=1e-6, msg=name)
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding)
    ids = torch.tensor([0, 7, 511, 7])
    torch.testing.assert_close(model.model.embed_tokens(ids), ref["model.embed_tokens.weight"][ids], rtol=0, atol=0)
    params = {n for n, _ in model.named_parameters()}  # what stays full precision: the norms
    assert params and all(n.endswith("norm.weight") for n in params)


def test_created_gguf_greedy_equals_transformers(q4_0_model, hf_q4_0, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from tandem.common.config import EngineConfig
    from tandem.common.engine import Engine
    from tandem.common.sampling.params import SamplingParams
    from tandem.common.scheduler.io_struct import GenerateRequest
    from tandem.common.tokenizer import load_tokenizer

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    ref_tok = AutoTokenizer.from_pretrained(q4_0_model, gguf_file="model-Q4_0.gguf")
    ours = load_tokenizer(q4_0_model)
    texts = ["the quick brown fox", "  two  spaces\nand a line, 12345!"]
    assert [ours.tokenizer.encode(t).ids for t in texts] == [ref_tok(t)["input_ids"] for t in texts]
    assert ours.chat_template == ref_tok.chat_template and ours.chat_template
    prompts = [ref_tok(t)["input_ids"] for t in texts]
    want = [hf_q4_0.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, min_new_tokens=12,
                             )[0, len(p):].tolist() for p in prompts]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    gguf_file = os.path.join(q4_0_model, "model-Q4_0.gguf")
    for model_path in (q4_0_model, gguf_file):  # a directory holding one .gguf, or the file itself
        with Engine(EngineConfig(model_path=model_path, dtype="float32", max_total_tokens=1024)) as engine:
            results = engine.generate([GenerateRequest(f"r{i}", p, params) for i, p in enumerate(prompts)])
        assert [r.sequences[0].output_ids for r in results] == want


def test_directory_with_several_gguf_files_is_an_error_naming_them(q4_0_model, tmp_path):
    for name in ("a.gguf", "b.gguf"):
        shutil.copy(os.path.join(q4_0_model, "model-Q4_0.gguf"), tmp_path / name)
    with pytest.raises(UnsupportedModelError, match="2 GGUF files.*a.gguf, b.gguf"):
        ModelConfig.from_pretrained(str(tmp_path))


def _rewrite_gguf(src_path: str, dst_path: str, change) -> None:
    """Copy a GGUF file, its tensors through `change(name, data, kind) -> (data, kind)`, or None to drop one."""
    src = gguf.GGUFReader(src_path)
    writer = gguf.GGUFWriter(dst_path, "llama")
    for key, field in src.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, value, vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, value, vtype)
    for t in src.tensors:
        changed = change(t.name, np.array(t.data), t.tensor_type)
        if changed is None:
            continue
        data, kind = changed
        writer.add_tensor(t.name, data, raw_dtype=kind if kind not in (T.F32,) else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _requantize(data: np.ndarray, kind: T, to: T) -> np.ndarray:
    return gguf.quants.quantize(gguf.quants.dequantize(data, kind), to)


def test_unknown_tensor_type_is_a_start_up_error_naming_it(q4_0_model, tmp_path):
    """A Q5_0 projection (a type not implemented here) fails the load naming the tensor, never dequantized."""
    def change(name, data, kind):
        return (_requantize(data, kind, T.Q5_0), T.Q5_0) if name == "blk.1.ffn_up.weight" else (data, kind)

    _rewrite_gguf(os.path.join(q4_0_model, "model-Q4_0.gguf"), str(tmp_path / "m.gguf"), change)
    with pytest.raises(UnsupportedModelError, match=r"blk\.1\.ffn_up\.weight .*type Q5_0"):
        load_model(str(tmp_path), dtype="float32")


def test_model_create_quantize_flag_writes_one_gguf(tmp_path):
    import argparse

    from tandem.common.model.create import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["model", "create", str(tmp_path / "m"), "--preset", "tiny", "--quantize", "gguf-q4_0"])
    assert args.func(args) == 0
    assert os.listdir(tmp_path / "m") == ["model-Q4_0.gguf"]
    config = ModelConfig.from_pretrained(str(tmp_path / "m"))
    assert (config.num_layers, config.hidden_size, config.vocab_size) == (2, 64, 512)


@pytest.mark.parametrize("kind", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q6_K, T.F32])
def test_row_parallel_columns_are_whole_blocks_of_the_codes(kind, tmp_path):
    """A row-parallel rank's input columns, cut from the stored blocks, dequantize to those columns of the weight;
    a run that cuts a block is refused."""
    from tandem.common.flags import ConfigError
    from tandem.common.model.quant.gguf import _read
    from tandem.common.model.quant.gguf_file import GGUFReader

    raw = _blocks(kind) if kind != T.F32 else np.random.default_rng(0).standard_normal((ROWS, COLS), np.float32)
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    writer.add_tensor("blk.0.ffn_down.weight", raw, raw_dtype=kind if kind != T.F32 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = ModelConfig("LlamaForCausalLM", "llama", 512, COLS, COLS, 1, 4, 4, COLS // 4)  # read uses its heads
    read = GGUFReader.open(str(tmp_path / "m.gguf"), config)
    name = "model.layers.0.mlp.down_proj.weight"
    whole = gguf.quants.dequantize(raw, kind) if kind != T.F32 else raw
    for cols in (range(0, 256), range(256, 512)):
        part = _read(read, name, range(3, 9), cols)
        got = part if kind == T.F32 else part.dequantize()
        np.testing.assert_array_equal(got.numpy(), whole[3:9, cols.start:cols.stop])
    if kind != T.F32:
        block = gguf.constants.GGML_QUANT_SIZES[kind][0]
        with pytest.raises(ConfigError, match=f"{block}-column blocks"):
            _read(read, name, None, range(block // 2, block // 2 + 256))


def test_tensor_parallel_split_that_cuts_a_block_is_refused(q4_0_model):
    """tiny: o_proj has 64 input columns; at --tp-size 4 a rank takes 16, half a Q4_0 block."""
    from tandem.common.flags import ConfigError
    from tandem.common.model.quant.base import resolve_method

    config = ModelConfig.from_pretrained(q4_0_model)
    method = resolve_method(config.quantization, config)
    method.check(config, 2)  # 32 of o_proj's 64, 64 of down_proj's 128: whole blocks
    with pytest.raises(ConfigError, match=r"--tp-size 4: GGUF tensor blk\.0\.attn_output\.weight "
                                          r"\(model\.layers\.0\.self_attn\.o_proj\.weight, Q4_0\) has 64 input "
                                          r"columns; a rank .* takes 16 .* not whole 32-column blocks"):
        method.check(config, 4)


def _hf_logprobs(hf_model, prompt: list[int], output: list[int]) -> list[float]:
    """transformers' logprob of each output token, given the prompt and the outputs before it."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + output])).logits[0].float()
    lps = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    return lps[torch.arange(len(output)), torch.tensor(output)].tolist()


TP_PROMPTS = [[1, 300, 511, 42, 260, 7], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]]  # ids in both ranks' vocab rows


def _greedy(model_path: str, tp_size: int, event_loop: str = "normal") -> list[tuple[list[int], list[float]]]:
    from tandem.common.config import EngineConfig
    from tandem.common.engine import Engine
    from tandem.common.sampling.params import SamplingParams
    from tandem.common.scheduler.io_struct import GenerateRequest

    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    config = EngineConfig(model_path=model_path, dtype="float32", max_total_tokens=512, tp_size=tp_size,
                          num_threads=1, event_loop=event_loop)
    with Engine(config) as engine:
        results = engine.generate([GenerateRequest(f"r{i}", p, params, return_logprob=True)
                                   for i, p in enumerate(TP_PROMPTS)])
    return [(r.sequences[0].output_ids, r.sequences[0].logprobs) for r in results]


def _assert_same(got, want, tol: float = 1e-4) -> None:
    for (ids, lps), (want_ids, want_lps) in zip(got, want, strict=True):
        assert ids == want_ids
        assert max(abs(a - b) for a, b in zip(lps, want_lps, strict=True)) < tol


@pytest.fixture(scope="module")
def tied_q8_embed_model(q4_0_model, tmp_path_factory) -> str:
    """The created model with its LM head tied to the embedding (output.weight dropped) and the embedding in
    Q8_0: the quantized table a vocab-parallel rank both looks up and multiplies by."""
    out = tmp_path_factory.mktemp("gguf-tied-q8")

    def change(name, data, kind):
        if name == "output.weight":
            return None
        return (_requantize(data, kind, T.Q8_0), T.Q8_0) if name == "token_embd.weight" else (data, kind)

    _rewrite_gguf(os.path.join(q4_0_model, "model-Q4_0.gguf"), str(out / "model.gguf"), change)
    return str(out)


@pytest.mark.e2e
@pytest.mark.parametrize("event_loop", ["normal", "overlap"])
def test_tp2_gguf_greedy_equals_tp1_and_transformers(q4_0_model, hf_q4_0, event_loop, tmp_path, monkeypatch):
    """Q4_0 projections split over 2 ranks (q/k rows un-permuted, then split by heads; o_proj/down_proj by whole
    blocks), the Q4_0 embedding and untied LM head by vocab rows: the same greedy ids and logprobs (1e-4) as TP 1
    on the same file and as transformers' float32 GGUF load."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    tp2 = _greedy(q4_0_model, 2, event_loop)
    want = [(ids, _hf_logprobs(hf_q4_0, p, ids)) for p, (ids, _) in zip(TP_PROMPTS, tp2)]
    want_ids = [hf_q4_0.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False
                                 )[0, len(p):].tolist() for p in TP_PROMPTS]
    assert [ids for ids, _ in tp2] == want_ids
    _assert_same(tp2, want)
    _assert_same(tp2, _greedy(q4_0_model, 1))


@pytest.mark.e2e
def test_tp2_gguf_tied_quantized_embedding_equals_tp1(tied_q8_embed_model, tmp_path, monkeypatch):
    """A tied LM head over a Q8_0 embedding: each rank multiplies by its vocab rows of the same codes."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    config, model = load_model(tied_q8_embed_model, dtype="float32")
    assert config.tie_word_embeddings and model.lm_head is model.model.embed_tokens.table
    assert isinstance(model.lm_head, GroupedLinear)
    assert (model.lm_head.panels if model.lm_head.ours else model.lm_head.q).dtype == torch.int8
    _assert_same(_greedy(tied_q8_embed_model, 2, "overlap"), _greedy(tied_q8_embed_model, 1))
