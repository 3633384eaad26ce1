"""The llama.cpp harness: the GGUF it runs (F32/F16/BF16 from the HF directory), its batch filling, its message
when llama_cpp is missing; and, where llama-cpp-python is installed, its batched greedy decode against HF
transformers on the same checkpoint."""

from __future__ import annotations

import importlib.util
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tandem.common.bench import llamacpp_offline
from tandem.common.model.quant.gguf_write import write_gguf

HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None


def hf_weights(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(model_dir, "model.safetensors"))


@pytest.mark.parametrize("file_type,np_type,gguf_type", [("F32", np.float32, "F32"), ("F16", np.float16, "F16"),
                                                         ("BF16", None, "BF16")])
def test_the_gguf_holds_the_checkpoints_matrices_in_its_type_and_norms_in_f32(tiny_llama, tmp_path, file_type,
                                                                              np_type, gguf_type):
    from gguf import GGUFReader

    path = write_gguf(tiny_llama, str(tmp_path / f"m-{file_type}.gguf"), file_type)
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    weights = hf_weights(tiny_llama)
    down = tensors["blk.0.ffn_down.weight"]
    assert down.tensor_type.name == gguf_type and tensors["blk.0.attn_norm.weight"].tensor_type.name == "F32"
    want = weights["model.layers.0.mlp.down_proj.weight"]
    data = np.asarray(down.data)
    if file_type == "BF16":  # raw 16-bit words (the reader gives bytes): bfloat16 is the top half of a float32
        got = torch.from_numpy(data.view(np.uint16).astype(np.int32) << 16).view(torch.float32)
        assert torch.equal(got.reshape(want.shape), want.to(torch.bfloat16).float())
    else:
        assert data.dtype == np_type
        assert torch.equal(torch.from_numpy(data.copy()).reshape(want.shape), want.to(torch.from_numpy(
            np.zeros(1, np_type)).dtype))
    norm = np.asarray(tensors["output_norm.weight"].data)
    assert torch.equal(torch.from_numpy(norm.copy()), weights["model.norm.weight"].float())


def test_an_unknown_gguf_type_is_refused(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="GGUF file type 'Q8_0'"):
        write_gguf(tiny_llama, str(tmp_path / "m.gguf"), "Q8_0")


def test_each_batch_slot_gets_its_token_position_sequence_and_logits_flag():
    batch = SimpleNamespace(token=[0] * 4, pos=[0] * 4, n_seq_id=[0] * 4, seq_id=[[9] for _ in range(4)],
                            logits=[0] * 4, n_tokens=0)
    llamacpp_offline.fill_batch(batch, [(11, 0, 0, False), (12, 1, 0, True), (13, 0, 1, True)])
    assert batch.n_tokens == 3 and batch.token[:3] == [11, 12, 13] and batch.pos[:3] == [0, 1, 0]
    assert batch.n_seq_id[:3] == [1, 1, 1] and [s[0] for s in batch.seq_id[:3]] == [0, 0, 1]
    assert batch.logits[:3] == [False, True, True]


def test_the_prompts_are_vllm_offlines(tiny_llama):
    from tandem.common.bench import vllm_offline

    with open(os.path.join(tiny_llama, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    assert llamacpp_offline.random_prompts(vocab, 3, 5) == vllm_offline.random_prompts(tiny_llama, 3, 5)


def test_without_llama_cpp_the_harness_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(__import__("sys").modules, "llama_cpp", None)  # import llama_cpp -> ImportError
    assert llamacpp_offline.main(["--check"]) == 2
    assert 'CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python==0.3.36' in capsys.readouterr().err


def test_the_check_prints_how_llama_cpp_was_built(monkeypatch, capsys):
    """`tandem bench peer` prints this line before its rounds: which CPU features the peer's build runs."""
    from types import SimpleNamespace

    info = b"CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | AVX512 = 0 | \n"
    monkeypatch.setitem(__import__("sys").modules, "llama_cpp", SimpleNamespace(llama_print_system_info=lambda: info))
    assert llamacpp_offline.main(["--check"]) == 0
    assert capsys.readouterr().out == ("llama.cpp system info: CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | "
                                       "FMA = 1 | AVX512 = 0 |\n")


@pytest.mark.needs_peer
@pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed (not a CI dependency)")
def test_batched_greedy_equals_transformers_on_the_f32_gguf(tiny_llama, tmp_path):
    """Three sequences of different lengths in one llama.cpp context: each one's greedy tokens are HF's."""
    from transformers import AutoModelForCausalLM

    gguf = write_gguf(tiny_llama, str(tmp_path / "m-F32.gguf"), "F32")
    prompts = [[20, 31, 42, 53, 64, 75], [101, 7 + 90, 300], [250, 251, 252, 253]]
    engine = llamacpp_offline.BatchedGreedy(gguf, len(prompts), 16, threads=1)
    try:
        got = engine.generate(prompts, 6)
    finally:
        engine.close()
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32)
    for ids, tokens in zip(prompts, got):
        out = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, min_new_tokens=6,
                             pad_token_id=0)
        assert tokens == out[0, len(ids):].tolist()
