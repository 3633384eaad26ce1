"""`tandem bench attention` on the tiny model: both backends time the same decode step and the profile splits it."""

from __future__ import annotations

import re

import pytest
import torch

from tandem.common import cli
from tandem.common.bench.attention import decode_batch, decode_step
from tandem.common.model import cpu_gemm
from tandem.common.model.loader import load_model

needs_gemm_kernel = pytest.mark.skipif(not cpu_gemm.panel_widths(),
                                       reason="our GEMM kernel needs AVX-512 or AVX2+FMA and a compiler")


@pytest.mark.e2e
def test_backends_run_the_same_decode_step(tiny_llama):
    """The benchmark compares like with like: the batch it builds gives the same logits on both backends."""
    logits = []
    for backend in ("torch", "cpu"):
        model = load_model(tiny_llama, "float32", "cpu", backend)[1]
        logits.append(decode_step(model, decode_batch(model, batch=3, context_len=37, page_size=16)))
    assert logits[0].shape == (3, model.config.vocab_size)
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("gemm", ["onednn", pytest.param("tandem", marks=needs_gemm_kernel)])
def test_prints_a_row_per_batch_and_a_profile_per_backend(tiny_llama, capsys, monkeypatch, gemm):
    monkeypatch.setenv("TANDEM_CPU_GEMM", gemm)
    argv = ["bench", "attention", "--model", tiny_llama, "--dtypes", "float32", "--batch-sizes", "2", "--rounds", "1",
            "--steps", "1", "--context-len", "20", "--num-threads", "1", "--profile"]
    threads = torch.get_num_threads()
    try:
        assert cli.main(argv) == 0
    finally:
        torch.set_num_threads(threads)  # the flag sets it process-wide
    out = capsys.readouterr().out
    assert re.search(r"^float32\s+2\s+[\d.]+ \(\s*[\d.]+\)\s+[\d.]+ \(\s*[\d.]+\)\s+[\d.]+x$", out, re.M), out
    for backend in ("torch", "cpu"):
        split = re.search(rf"profile {backend}\s+step [\d.]+ ms: attention (\d+)%, linears (\d+)%, other -?\d+%", out)
        assert split, out
        assert int(split[2]) > 0, out  # the packed linears (the op of TANDEM_CPU_GEMM's path) count as linears too


def test_cpu_kernel_columns_time_the_portable_loops_beside_the_vector_kernels(tiny_llama, capsys):
    """`--backends cpu:portable,cpu` times both kernel sets of the cpu backend in one run."""
    argv = ["bench", "attention", "--model", tiny_llama, "--dtypes", "bfloat16", "--batch-sizes", "3", "--rounds",
            "1", "--steps", "1", "--context-len", "20", "--backends", "cpu:portable,cpu"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert re.search(r"cpu:portable\s+cpu\s+speed-up$", out, re.M), out
    assert re.search(r"^bfloat16\s+3\s+[\d.]+ \(\s*[\d.]+\)\s+[\d.]+ \(\s*[\d.]+\)\s+[\d.]+x$", out, re.M), out


def test_kernels_only_for_the_cpu_backend(tiny_llama, capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "attention", "--model", tiny_llama, "--backends", "torch:portable,cpu"])
    assert "only the cpu backend takes kernels" in capsys.readouterr().err


def test_kernels_time_every_kernel_set_for_decode_and_extend(tiny_llama, capsys):
    """--kernels: one row per op with every kernel set this CPU runs side by side; decode adds the copy's GB/s."""
    from tandem.common.bench.attention_kernels import available_kernels
    from tandem.common.model.attention.cpu import load_ops

    kernels = available_kernels(load_ops())
    argv = ["bench", "attention", "--model", tiny_llama, "--kernels", "--dtypes", "float32", "--batch-sizes", "2",
            "--rounds", "1", "--steps", "1", "--context-len", "20", "--extend-len", "6", "--num-threads", "1"]
    threads = torch.get_num_threads()
    try:
        assert cli.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "extend 6 new tokens after 14 cached" in out, out
    assert re.search(r"\s+".join(kernels) + r"\s+copy GB/s", out), out
    cell = r"\s+[\d.]+ ms\s+[\d.]+"
    assert re.search(rf"^float32\s+2 decode GB/s{cell * len(kernels)}\s+[\d.]+\s+", out, re.M), out
    assert re.search(rf"^float32\s+2 extend GFLOP/s{cell * len(kernels)}\s+", out, re.M), out
    assert load_ops().kernel_isa() == kernels[-1]  # back to auto: the widest set


def test_kernels_refuse_the_step_flags(tiny_llama, capsys):
    with pytest.raises(SystemExit, match="--profile times whole decode steps"):
        cli.main(["bench", "attention", "--model", tiny_llama, "--kernels", "--profile"])
    with pytest.raises(SystemExit, match="add --kernels"):
        cli.main(["bench", "attention", "--model", tiny_llama, "--extend-len", "8"])
    with pytest.raises(SystemExit, match="--extend-len 30 must be in"):
        cli.main(["bench", "attention", "--model", tiny_llama, "--kernels", "--context-len", "20", "--extend-len",
                  "30"])
