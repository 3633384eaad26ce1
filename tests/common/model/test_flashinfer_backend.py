"""--attention-backend flashinfer where no GPU is: every refusal is a clear start-up error naming the flag, and the
KV index layout the backend hands FlashInfer is each request's req_to_token row. The kernels themselves run on a
GPU only: tests/common/model/test_cuda_paths.py checks them there, layer by layer and end to end."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tandem.common.config import ConfigError, EngineConfig
from tandem.common.memory.req_to_token import ReqToTokenPool
from tandem.common.model.attention import create_attention_backend
from tandem.common.model.attention.flashinfer_backend import _kv_layout
from tandem.common.model.forward_batch import ForwardBatch, ForwardMode


def test_refusals_are_clear_start_up_errors(tiny_llama, monkeypatch):
    with pytest.raises(ConfigError, match="flashinfer runs FlashInfer's CUDA kernels, on --device cuda only"):
        EngineConfig(model_path=tiny_llama, attention_backend="flashinfer").validate()
    with pytest.raises(ConfigError, match="not --dtype float32: pass --dtype bfloat16"):
        EngineConfig(model_path=tiny_llama, attention_backend="flashinfer", device="cuda", dtype="float32").validate()
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "flashinfer" else real_find_spec(name, *a))
    with pytest.raises(ConfigError, match="needs the flashinfer-python package"):
        EngineConfig(model_path=tiny_llama, attention_backend="flashinfer", device="cuda", dtype="bfloat16").validate()
    # An FP8 KV cache is refused with FlashInfer (not verified here), whether or not the package is installed.
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "flashinfer" else real_find_spec(name, *a))
    with pytest.raises(ConfigError, match="--kv-cache-dtype fp8 with --attention-backend flashinfer.*not verified"):
        EngineConfig(model_path=tiny_llama, attention_backend="flashinfer", device="cuda", dtype="bfloat16",
                     kv_cache_dtype="fp8").validate()
    # The backend refuses the same when a model is built outside EngineConfig.
    with pytest.raises(ValueError, match="on --device cuda only"):
        create_attention_backend("flashinfer", "cpu")


def test_kv_layout_is_each_request_row_in_turn():
    """Indices of ragged requests at scattered rows of the table, a radix-shared prefix among them."""
    r2t = ReqToTokenPool(6, 64)
    r2t.req_to_token[4, :9] = torch.arange(100, 109)
    r2t.req_to_token[1, :3] = torch.arange(7, 10)
    r2t.req_to_token[2, :12] = torch.cat([torch.arange(100, 105), torch.arange(300, 307)])  # shares 5 slots with 4

    def t(x):
        return torch.tensor(x, dtype=torch.int64)

    seq = [9, 3, 12]
    fb = ForwardBatch(ForwardMode.DECODE, 3, t([1, 1, 1]), t([8, 2, 11]), t([108, 9, 306]), t([4, 1, 2]), t(seq),
                      t([8, 2, 11]), t([1, 1, 1]), r2t, None, seq, [8, 2, 11], [1, 1, 1])
    indptr, indices = _kv_layout(fb)
    assert indptr.dtype == torch.int32 and indptr.tolist() == [0, 9, 12, 24]
    assert indices.dtype == torch.int32
    assert indices.tolist() == [*range(100, 109), 7, 8, 9, *range(100, 105), *range(300, 307)]
    # A graph is captured on a plan for longer sequences than the batch tensors say: the host lengths rule.
    long = ForwardBatch(ForwardMode.DECODE, 1, t([1]), t([0]), t([0]), t([4]), t([1]), t([0]), t([1]), r2t, None,
                        [9], [0], [1])
    assert _kv_layout(long)[1].tolist() == list(range(100, 109))
