"""The cpu backend's C++ paged attention ops against the torch backend, layer by layer, and their build's errors."""

from __future__ import annotations

import logging
import os
import re
import threading

import pytest
import torch

from tandem.common.config import cpu_compiler
from tandem.common.cpuinfo import cpu_flags
from tandem.common.memory.kv_pool import MHATokenToKVPool
from tandem.common.memory.req_to_token import ReqToTokenPool
from tandem.common.model.attention import cpu as cpu_kernels
from tandem.common.model.attention.cpu_backend import CpuAttentionBackend
from tandem.common.model.attention.torch_backend import TorchAttentionBackend
from tandem.common.model.forward_batch import ForwardMode
from tests.common.model.conftest import assert_matches_torch_on_fp8_pool, paged_forward_batch


def _cpu_runs(isa: str) -> bool:
    needs = {"avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"}, "avx2": {"avx2", "fma", "f16c"}}
    return needs[isa] <= cpu_flags()


@pytest.fixture(params=["auto", "avx2", "portable"])
def kernel_isa(request):
    """Runs a test with the kernels the CPU picks (AVX-512 where it has it), the AVX2 ones and the portable loops."""
    if request.param == "avx2" and not _cpu_runs("avx2"):
        pytest.skip("this CPU has no AVX2 + FMA + F16C")
    ops = cpu_kernels.load_ops()
    yield ops.set_kernel_isa(request.param)
    ops.set_kernel_isa("auto")


def _compare(mode, prefix, ext, page_size, num_heads, kv_heads, head_dim, dtype):
    gen = torch.Generator().manual_seed(sum(prefix) * 31 + sum(ext) + page_size)
    lens = [p + e for p, e in zip(prefix, ext)]
    pool = MHATokenToKVPool(max(4096, 2 * (sum(lens) + page_size * len(lens))), page_size, dtype, 1, kv_heads, head_dim)
    req_pool = ReqToTokenPool(len(prefix), max(1024, max(lens)))
    fb = paged_forward_batch(mode, prefix, ext, page_size, pool, req_pool, gen)
    tokens = sum(ext)
    q = torch.randn(tokens, num_heads, head_dim, generator=gen).to(dtype)
    # k/v as the model hands them over: strided views of one fused projection.
    kv = torch.randn(tokens, 2 * kv_heads * head_dim, generator=gen).to(dtype)
    k = kv[:, :kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    v = kv[:, kv_heads * head_dim:].view(tokens, kv_heads, head_dim)
    outputs = []
    for backend in (TorchAttentionBackend("cpu"), CpuAttentionBackend("cpu")):
        backend.init_forward_metadata(fb)
        outputs.append(backend.forward(q, k, v, 0, fb))
    expected, got = outputs
    assert got.shape == (tokens, num_heads * head_dim) and got.dtype == dtype
    # The torch backend rounds bf16 scores and probabilities to bf16; the C++ ops keep them in float32.
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("page_size,num_heads,kv_heads,head_dim,dtype", [
    (1, 4, 4, 16, torch.float32),     # MHA, page size 1
    (16, 8, 2, 24, torch.float32),    # GQA 4, a head dim that is no multiple of the vector width
    (16, 8, 4, 64, torch.bfloat16),   # the small preset's shape
    (1, 6, 2, 32, torch.bfloat16),    # GQA 3 in bfloat16, page size 1
    (16, 4, 1, 128, torch.float16),   # MQA, float16, head dim 128
    (7, 16, 2, 80, torch.bfloat16),   # GQA 8, odd page size, five vectors (one P.V chunk of 4, one of 1)
    (3, 2, 2, 100, torch.float16),    # GQA 1, a masked last vector of 4 lanes
    (16, 8, 8, 72, torch.float32),    # head dim 72: a masked tail on float32
    (16, 4, 2, 160, torch.bfloat16),  # past the vector kernels' 128: the portable loops run either way
    (16, 12, 2, 64, torch.float32),   # GQA 6: q heads in register chunks of 4, then a partial chunk of 2
    (16, 8, 1, 128, torch.float32),   # GQA 8 at head dim 128: four register chunks of 2 q heads
])
def test_decode_matches_torch_backend(kernel_isa, page_size, num_heads, kv_heads, head_dim, dtype):
    lens = [1, 5, 40, 17, 300, 129]  # sequence lengths after this step: ragged, some across key blocks
    _compare(ForwardMode.DECODE, [n - 1 for n in lens], [1] * len(lens), page_size, num_heads, kv_heads, head_dim,
             dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_split_k_matches_torch_backend(kernel_isa, dtype):
    """One long request and two KV heads cannot fill the threads: the op splits each sequence and merges."""
    assert cpu_kernels.load_ops() is not None and torch.get_num_threads() >= 1
    _compare(ForwardMode.DECODE, [900], [1], 16, 4, 2, 64, dtype)
    _compare(ForwardMode.DECODE, [2999, 40], [1, 1], 5, 8, 2, 48, dtype)  # odd pages, 3 vectors, uneven lengths


@pytest.mark.parametrize("page_size,num_heads,kv_heads,head_dim,dtype,prefix,ext", [
    (1, 4, 4, 16, torch.float32, [0], [70]),                  # plain prefill: three row blocks, two key blocks
    (16, 8, 2, 24, torch.float32, [0, 9, 33], [5, 40, 1]),    # ragged, GQA, mixed prefixes
    (16, 8, 4, 64, torch.bfloat16, [0, 0], [37, 128]),        # the small preset's shape, no prefix
    (1, 6, 2, 32, torch.bfloat16, [100, 0, 3], [20, 7, 66]),  # a prefix across key blocks, page size 1
    (16, 4, 1, 128, torch.float32, [200], [8]),               # MQA: a short chunk after a long cached prefix
    (16, 4, 2, 32, torch.float16, [17], [33]),                # float16
    (7, 16, 2, 80, torch.bfloat16, [130], [45]),              # GQA 8 (rows past a tile), odd pages, 5 vectors
    (3, 4, 4, 100, torch.float32, [65, 0], [3, 70]),          # GQA 1, a masked tail, blocks cut mid-way
    (16, 8, 4, 64, torch.bfloat16, [1000], [40]),             # a long cached prefix: 16 key blocks
])
def test_extend_matches_torch_backend(kernel_isa, page_size, num_heads, kv_heads, head_dim, dtype, prefix, ext):
    _compare(ForwardMode.EXTEND, prefix, ext, page_size, num_heads, kv_heads, head_dim, dtype)


def _compare_fp8(mode, prefix, ext, head_dim, kv_dtype, dtype, scales):
    """The ops on an FP8 pool (or a 16-bit one under float32 queries) against the torch backend reading the same
    pool (same bytes, same scales)."""
    page_size, num_heads, kv_heads = 16, 8, 2
    gen = torch.Generator().manual_seed(sum(prefix) * 7 + sum(ext) + head_dim)
    lens = [p + e for p, e in zip(prefix, ext)]
    scaled = {"k_scales": [scales[0]], "v_scales": [scales[1]]} if kv_dtype.itemsize == 1 else {}
    pool = MHATokenToKVPool(4096, page_size, kv_dtype, 1, kv_heads, head_dim, **scaled)
    fb = paged_forward_batch(mode, prefix, ext, page_size, pool, ReqToTokenPool(len(prefix), max(1024, max(lens))),
                             gen)
    assert_matches_torch_on_fp8_pool(CpuAttentionBackend("cpu"), fb, pool, sum(ext), num_heads, kv_heads, head_dim, dtype,
                                     kv_dtype, scales, gen)


@pytest.mark.parametrize("head_dim,kv_dtype,dtype,scales", [
    (64, torch.float8_e4m3fn, torch.float32, (1.0, 1.0)),
    (64, torch.float8_e4m3fn, torch.bfloat16, (0.05, 0.1)),   # bf16 queries: no paired bf16 loads on an FP8 pool
    (24, torch.float8_e5m2, torch.float32, (0.5, 2.0)),       # a masked tail vector
    (128, torch.float8_e5m2, torch.float16, (0.1, 0.1)),
    (160, torch.float8_e4m3fn, torch.float32, (0.25, 0.5)),   # past the vector kernels: portable either way
])
def test_fp8_pool_matches_torch_backend(kernel_isa, head_dim, kv_dtype, dtype, scales):
    lens = [1, 5, 40, 17, 300, 129]
    _compare_fp8(ForwardMode.DECODE, [n - 1 for n in lens], [1] * len(lens), head_dim, kv_dtype, dtype, scales)
    _compare_fp8(ForwardMode.EXTEND, [0, 9, 33, 70], [70, 40, 1, 5], head_dim, kv_dtype, dtype, scales)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
def test_a_16bit_pool_under_float32_queries_matches_torch_backend(kernel_isa, kv_dtype):
    """--kv-cache-dtype bfloat16/float16 under a float32 model: the ops read the 16-bit pool with float32 queries,
    as the torch backend does after widening the rows (the new tokens rounded on the way in)."""
    lens = [1, 5, 40, 17, 300, 129]
    for head_dim in (64, 24, 160):  # 24: a masked tail vector; 160: past the vector kernels
        _compare_fp8(ForwardMode.DECODE, [n - 1 for n in lens], [1] * len(lens), head_dim, kv_dtype, torch.float32,
                     (1.0, 1.0))
        _compare_fp8(ForwardMode.EXTEND, [0, 9, 33, 70], [70, 40, 1, 5], head_dim, kv_dtype, torch.float32, (1.0, 1.0))


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_every_fp8_code_reads_as_torch_converts_it(kernel_isa, kv_dtype):
    """One key, so the output is its value row times v_scale: each of the 256 byte codes (NaN / inf ones set to 0)
    must read as torch's own conversion, subnormals and signs included."""
    ops = cpu_kernels.load_ops()
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(kv_dtype)
    codes = torch.where(codes.float().isfinite(), codes.float(), 0.0).to(kv_dtype)
    v_buf = codes.view(1, 2, 128).repeat(2, 1, 1)
    k_buf = torch.zeros_like(v_buf)
    out = ops.decode_attention(torch.randn(1, 2, 128), k_buf, v_buf, torch.tensor([[1, 0]]), torch.tensor([0]),
                               torch.tensor([1]), 0.1, 1.0, 0.5)
    assert torch.equal(out.view(256), codes.float() * 0.5)


def test_decode_padding_row_without_kv_gives_zeros():
    """A graph bucket may pad the batch with rows of seq_len 0: their output is 0, not NaN, and real rows hold."""
    ops = cpu_kernels.load_ops()
    gen = torch.Generator().manual_seed(3)
    k_buf, v_buf = torch.randn(2, 32, 2, 16, generator=gen)
    req_to_token = torch.arange(64).view(2, 32)
    q = torch.randn(2, 4, 16, generator=gen)
    out = ops.decode_attention(q, k_buf, v_buf, req_to_token, torch.tensor([0, 1]), torch.tensor([5, 0]), 0.25)
    assert torch.equal(out[1], torch.zeros(4, 16))
    keys, values = k_buf[:5].repeat_interleave(2, dim=1), v_buf[:5].repeat_interleave(2, dim=1)  # GQA 2
    probs = torch.softmax(torch.einsum("hd,lhd->hl", q[0], keys) / 4.0, dim=-1)
    torch.testing.assert_close(out[0], torch.einsum("hl,lhd->hd", probs, values), atol=2e-5, rtol=2e-5)


def test_ops_are_traceable_opaque_ops():
    """Schema and fake (meta) implementations agree with the kernels, so torch.compile can trace around them."""
    ops = cpu_kernels.load_ops()
    k_buf, v_buf = torch.randn(2, 40, 2, 16)
    req_to_token = torch.arange(40).view(2, 20)
    rows = torch.tensor([1, 0])
    torch.library.opcheck(ops.decode_attention, (torch.randn(2, 4, 16), k_buf, v_buf, req_to_token, rows,
                                                 torch.tensor([7, 20]), 0.25),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(ops.extend_attention, (torch.randn(9, 4, 16), k_buf, v_buf, req_to_token, rows,
                                                 torch.tensor([3, 0]), torch.tensor([4, 5]), 0.25),
                          test_utils=("test_schema", "test_faketensor"))


def test_bad_input_names_the_problem():
    ops = cpu_kernels.load_ops()
    k_buf = torch.zeros(8, 2, 16)
    with pytest.raises(RuntimeError, match="share q's dtype, one FP8 dtype, or"):
        ops.decode_attention(torch.zeros(1, 4, 16, dtype=torch.bfloat16), k_buf, k_buf, torch.zeros(1, 8).long(),
                             torch.tensor([0]), torch.tensor([3]), 0.25)
    half = k_buf.to(torch.float16)  # a 16-bit pool is read by float32 queries, not by bf16 ones
    with pytest.raises(RuntimeError, match="share q's dtype, one FP8 dtype, or"):
        ops.decode_attention(torch.zeros(1, 4, 16, dtype=torch.bfloat16), half, half, torch.zeros(1, 8).long(),
                             torch.tensor([0]), torch.tensor([3]), 0.25)
    with pytest.raises(RuntimeError, match="extend_seq_lens sum to 3 tokens but q has 4"):
        ops.extend_attention(torch.zeros(4, 4, 16), k_buf, k_buf, torch.zeros(1, 8).long(), torch.tensor([0]),
                             torch.tensor([0]), torch.tensor([3]), 0.25)


def test_missing_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-c++-compiler")
    reason = cpu_kernels.compiler_missing_reason()
    assert reason is not None and "'no-such-c++-compiler'" in reason and "--attention-backend torch" in reason


@pytest.mark.e2e
def test_compile_error_names_the_compiler_and_its_message(monkeypatch, tmp_path):
    """A source that does not compile: the error carries the compiler's name and its diagnostic, no fallback."""
    broken = tmp_path / "broken.cpp"
    broken.write_text("#include <torch/library.h>\nint broken() { return undeclared_name; }\n")
    monkeypatch.setattr(cpu_kernels, "SOURCES", (broken,))
    monkeypatch.setattr(cpu_kernels, "_loaded", False)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    with pytest.raises(cpu_kernels.CpuKernelBuildError, match=rf"(?s)kernels with {re.escape(repr(cpu_compiler()))} failed.*undeclared_name"):
        cpu_kernels.load_ops()


@pytest.mark.e2e
def test_a_lock_left_by_a_killed_build_does_not_hang_later_loads(monkeypatch, tmp_path):
    """torch's `lock` file from a build whose process died: the next load removes it under its flock and builds."""
    source = tmp_path / "probe.cpp"
    source.write_text("int tandem_probe() { return 1; }\n")
    monkeypatch.setattr(cpu_kernels, "SOURCES", (source,))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    directory = cpu_kernels.build_directory()
    directory.mkdir(parents=True)
    (directory / "lock").touch()
    outcome = []
    loader = threading.Thread(target=lambda: outcome.append(cpu_kernels._build_and_load()), daemon=True)
    loader.start()
    loader.join(timeout=120)
    assert not loader.is_alive(), "the load waited on the stale lock"
    assert outcome == [None] and not (directory / "lock").exists()
    assert (directory / f"{directory.name}.so").exists()
    assert (directory / "src" / "probe.cpp").read_bytes() == source.read_bytes()  # compiled from its own copy


def _paged_inputs(dtype, kv_heads=2, head_dim=72, page_size=5, lens=(1, 33, 200, 513)):
    """A pool of random K/V holding `lens` requests on shuffled pages."""
    gen = torch.Generator().manual_seed(11)
    pages = [-(-n // page_size) for n in lens]
    k_buf, v_buf = torch.randn(2, (sum(pages) + 1) * page_size, kv_heads, head_dim, generator=gen).to(dtype)
    order = (torch.randperm(sum(pages), generator=gen) + 1).tolist()
    req_to_token = torch.zeros(len(lens), max(pages) * page_size, dtype=torch.int64)
    for row, count in enumerate(pages):
        taken, order = order[:count], order[count:]
        req_to_token[row, :count * page_size] = (torch.tensor(taken)[:, None] * page_size +
                                                 torch.arange(page_size)).view(-1)
    return gen, k_buf, v_buf, req_to_token, torch.arange(len(lens)), torch.tensor(lens)


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_heads,kv_heads,head_dim,page_size", [
    (8, 2, 72, 5),     # GQA 4, a masked last vector (8 lanes of 16, 1 vector of 8)
    (16, 2, 128, 1),   # GQA 8 (the AVX2 score pass's 8 heads at once), page size 1, the largest head dim
    (3, 3, 20, 16),    # MHA, a 4-lane tail, odd head count
    (12, 1, 64, 7),    # MQA 12: 8 + 4 heads per score pass, odd page size
])
def test_vector_and_portable_kernels_agree(isa, kv_dtype, dtype, num_heads, kv_heads, head_dim, page_size):
    """Where the CPU has them, the AVX-512 and AVX2 kernels give the portable loops' result on every pool dtype
    (float32 accumulation in all; only the order of additions and exp's last bit differ); elsewhere asking for
    them is a clear error."""
    _vector_against_portable(isa, kv_dtype, dtype, num_heads, kv_heads, head_dim, page_size)


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_heads,kv_heads,head_dim,page_size", [(8, 2, 72, 5), (12, 1, 64, 7)])
def test_vector_and_portable_kernels_agree_on_a_16bit_pool_under_float32_queries(isa, kv_dtype, num_heads, kv_heads,
                                                                                  head_dim, page_size):
    """--kv-cache-dtype bfloat16/float16 under a float32 model: float32 queries over a 16-bit pool."""
    _vector_against_portable(isa, kv_dtype, torch.float32, num_heads, kv_heads, head_dim, page_size)


def _vector_against_portable(isa, kv_dtype, dtype, num_heads, kv_heads, head_dim, page_size):
    ops = cpu_kernels.load_ops()
    if not _cpu_runs(isa):
        with pytest.raises(RuntimeError, match=f"no {'AVX-512' if isa == 'avx512' else 'AVX2'}"):
            ops.set_kernel_isa(isa)
        return
    gen, k_buf, v_buf, req_to_token, rows, lens = _paged_inputs(dtype, kv_heads, head_dim, page_size)
    if kv_dtype is not None:
        k_buf, v_buf = (k_buf.float() * 4).to(kv_dtype), (v_buf.float() * 4).to(kv_dtype)
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype)
    ext_lens = torch.tensor([1, 20, 64, 7])
    q_ext = torch.randn(int(ext_lens.sum()), num_heads, head_dim, generator=gen).to(dtype)
    results = {}
    try:
        for kernels in (isa, "portable"):
            assert ops.set_kernel_isa(kernels) == kernels
            results[kernels] = (ops.decode_attention(q, k_buf, v_buf, req_to_token, rows, lens, 0.1, 0.5, 0.25),
                                ops.extend_attention(q_ext, k_buf, v_buf, req_to_token, rows, lens - ext_lens,
                                                     ext_lens, 0.1, 0.5, 0.25))
    finally:
        ops.set_kernel_isa("auto")
    tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16/fp16: one rounding of the output may land 1 ulp apart
    for vector, portable in zip(results[isa], results["portable"]):
        assert vector.dtype == dtype
        torch.testing.assert_close(vector.float(), portable.float(), atol=tol, rtol=tol)


def test_set_kernel_isa_rejects_unknown_names():
    ops = cpu_kernels.load_ops()
    with pytest.raises(RuntimeError, match="auto, avx512, avx2 or portable"):
        ops.set_kernel_isa("sse2")
    assert ops.set_kernel_isa("auto") in ("avx512", "avx2", "portable")


def test_auto_picks_the_widest_kernels_this_cpu_has():
    """auto: AVX-512 where /proc/cpuinfo lists F/BW/VL/DQ, else AVX2 + FMA + F16C, else the portable loops; each set
    the CPU has can be forced, and kernel_isa() reports what the ops run."""
    ops = cpu_kernels.load_ops()
    expected = "avx512" if _cpu_runs("avx512") else "avx2" if _cpu_runs("avx2") else "portable"
    try:
        assert ops.set_kernel_isa("auto") == expected and ops.kernel_isa() == expected
        for isa in ("avx512", "avx2"):
            if _cpu_runs(isa):
                assert ops.set_kernel_isa(isa) == isa and ops.kernel_isa() == isa
        assert ops.set_kernel_isa("portable") == "portable" and ops.kernel_isa() == "portable"
    finally:
        ops.set_kernel_isa("auto")


def test_the_backend_logs_the_kernels_it_runs(caplog):
    ops = cpu_kernels.load_ops()
    try:
        ops.set_kernel_isa("portable")
        with caplog.at_level(logging.INFO, logger="tandem.common.model.attention.cpu_backend"):
            CpuAttentionBackend("cpu")
    finally:
        ops.set_kernel_isa("auto")
    assert any(r.getMessage().startswith("cpu attention: portable kernels") for r in caplog.records), caplog.text


def test_kernel_march_comes_from_the_environment(monkeypatch):
    """TANDEM_CPU_KERNEL_MARCH=haswell builds an AVX2-only library of its own (own directory); junk is refused."""
    monkeypatch.delenv(cpu_kernels.MARCH_ENV, raising=False)
    native = cpu_kernels.build_directory()
    assert "-march=native" in cpu_kernels.cflags()
    monkeypatch.setenv(cpu_kernels.MARCH_ENV, "haswell")
    assert "-march=haswell" in cpu_kernels.cflags() and cpu_kernels.build_directory() != native
    monkeypatch.setenv(cpu_kernels.MARCH_ENV, "haswell -O0")
    with pytest.raises(cpu_kernels.CpuKernelBuildError, match="TANDEM_CPU_KERNEL_MARCH='haswell -O0' is no -march"):
        cpu_kernels.cflags()


def test_the_gemm_build_follows_the_same_march_and_every_copy_of_the_sources_shares_one_build(monkeypatch,
                                                                                             tmp_path):
    """One knob for every C++ op of Tandem: the GEMM kernels' build (cpp_build) takes TANDEM_CPU_KERNEL_MARCH too.
    The build is keyed by the sources' names and contents, not their folder: a copy of them (a wheel's install) or
    a symlink to their checkout (a baseline tree in `tandem bench report`) loads the build already there; a changed
    source gets its own."""
    from tandem.common.model import cpp_build, cpu_gemm

    monkeypatch.delenv(cpu_kernels.MARCH_ENV, raising=False)
    native = cpp_build.build_directory("tandem_cpu_gemm", cpu_gemm.SOURCES)
    link, copy = tmp_path / "checkout", tmp_path / "site-packages"
    link.symlink_to(cpu_gemm.SOURCES[0].parent, target_is_directory=True)
    copy.mkdir()
    for source in cpu_gemm.SOURCES:
        (copy / source.name).write_bytes(source.read_bytes())
    assert cpp_build.build_directory("tandem_cpu_gemm", [link / s.name for s in cpu_gemm.SOURCES]) == native
    assert cpp_build.build_directory("tandem_cpu_gemm", [copy / s.name for s in cpu_gemm.SOURCES]) == native
    (copy / "probe.cpp").write_text((copy / "probe.cpp").read_text() + "\n// changed\n")
    assert cpp_build.build_directory("tandem_cpu_gemm", [copy / s.name for s in cpu_gemm.SOURCES]) != native
    monkeypatch.setenv(cpu_kernels.MARCH_ENV, "haswell")
    assert "-march=haswell" in cpp_build.cflags()
    assert cpp_build.build_directory("tandem_cpu_gemm", cpu_gemm.SOURCES) != native
    monkeypatch.setenv(cpu_kernels.MARCH_ENV, "native;rm")
    with pytest.raises(cpp_build.CppBuildError, match="TANDEM_CPU_KERNEL_MARCH='native;rm' is no -march"):
        cpp_build.build_and_load("tandem_probe", cpu_gemm.SOURCES, "a probe")


def test_the_kernel_set_comes_from_the_environment(monkeypatch):
    """TANDEM_CPU_KERNEL_ISA forces the kernels a process runs (what `tandem bench offline` on an AVX-512 machine
    needs to time an AVX2-only CPU's); a set the CPU lacks or a junk name is refused, naming the variable."""
    ops = cpu_kernels.load_ops()
    best = ops.set_kernel_isa("auto")
    try:
        monkeypatch.setenv(cpu_kernels.ISA_ENV, "portable")
        cpu_kernels._choose_kernels()
        assert ops.kernel_isa() == "portable"
        monkeypatch.setenv(cpu_kernels.ISA_ENV, "sse9")
        with pytest.raises(cpu_kernels.CpuKernelBuildError, match="TANDEM_CPU_KERNEL_ISA='sse9': set_kernel_isa "
                                                                  "takes auto, avx512, avx2 or portable"):
            cpu_kernels._choose_kernels()
        if not torch.cpu._is_avx512_supported():
            monkeypatch.setenv(cpu_kernels.ISA_ENV, "avx512")
            with pytest.raises(cpu_kernels.CpuKernelBuildError, match="has no AVX-512"):
                cpu_kernels._choose_kernels()
        monkeypatch.setenv(cpu_kernels.ISA_ENV, "auto")
        cpu_kernels._choose_kernels()
        assert ops.kernel_isa() == best
    finally:
        ops.set_kernel_isa("auto")


_BASELINE_ROPE = """
import torch
from tandem.common.model.attention import cpu as cpu_kernels
from tandem.common.model.rope import apply_rope_

assert "-march=x86-64" in cpu_kernels.cflags()
ops = cpu_kernels.load_ops()
gen = torch.Generator().manual_seed(11)
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    info = torch.finfo(dtype)
    specials = torch.tensor([float("nan"), float("inf"), info.max, info.tiny / 4, 0.0, -0.0, 1.0 + info.eps / 2])
    x = torch.cat([torch.randn(40, 4, 32, generator=gen), specials[torch.randint(7, (9, 4, 32), generator=gen)]])
    table = torch.cat([torch.randn(40, 16, generator=gen), specials[torch.randint(7, (9, 16), generator=gen)]])
    x, cos, sin = x.to(dtype), table.to(dtype), table.flip(-1).to(dtype)
    expected, got = x.clone(), x.clone()
    apply_rope_(expected, cos[:, None], sin[:, None])
    ops.rope_(got, cos, sin)
    assert torch.equal(got.isnan(), expected.isnan()), dtype
    inf = float("inf")
    assert torch.equal(got.nan_to_num(0.0, inf, -inf), expected.nan_to_num(0.0, inf, -inf)), dtype
print("baseline rope ok")
"""


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_a_baseline_x86_64_build_runs_the_generic_loops_as_torch_does():
    """The kernels built for a baseline x86-64 CPU (TANDEM_CPU_KERNEL_MARCH=x86-64: no AVX2, no F16C) compile, and
    their generic RoPE loops (float16 without F16C's conversions, bfloat16's written-out rounding) give the torch
    rope's values: the paths a native build on any CPU Tandem has met never compiles."""
    import subprocess
    import sys

    env = {**os.environ, cpu_kernels.MARCH_ENV: "x86-64"}
    proc = subprocess.run([sys.executable, "-c", _BASELINE_ROPE], capture_output=True, text=True, timeout=560,
                          env=env)
    assert proc.returncode == 0 and "baseline rope ok" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.e2e
def test_a_first_build_says_it_is_compiling_and_then_how_long_it_took(monkeypatch, tmp_path, caplog):
    """At the default log level (warning): one line before the compiler runs (what `tandem up`'s progress line looks
    for) and one with the time it took; a later load in the built directory says nothing."""
    from tandem.common.launcher.up import COMPILED_KERNELS, COMPILING_KERNELS

    source = tmp_path / "probe.cpp"
    source.write_text("int tandem_probe() { return 1; }\n")
    monkeypatch.setattr(cpu_kernels, "SOURCES", (source,))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    caplog.set_level(logging.WARNING, logger=cpu_kernels.logger.name)
    cpu_kernels._build_and_load()
    said = [r.getMessage() for r in caplog.records if r.name == cpu_kernels.logger.name]
    assert len(said) == 2
    assert said[0].startswith(f"{COMPILING_KERNELS} (once, up to about {cpu_kernels.COMPILE_ESTIMATE_S} s) in ")
    assert re.fullmatch(rf"{COMPILED_KERNELS} in \d+\.\d s; later processes reuse the build", said[1])
    caplog.clear()
    cpu_kernels._build_and_load()
    assert not [r for r in caplog.records if r.name == cpu_kernels.logger.name]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 70, 600])  # 600: split over the threads
def test_rope_op_is_the_torch_rope_bitwise(dtype, tokens):
    """On the strided q/k heads of a fused projection (the model's call) and on a contiguous tensor (qk-norm's)."""
    from tandem.common.model.rope import apply_rope_

    ops = cpu_kernels.load_ops()
    gen = torch.Generator().manual_seed(tokens)
    heads, kv_heads, dim = 6, 2, 64
    qkv = (torch.randn(tokens, heads + 2 * kv_heads, dim, generator=gen) * 3).to(dtype)
    freqs = torch.randn(tokens, dim // 2, generator=gen) * 50
    cos, sin = freqs.cos().to(dtype)[:, None], freqs.sin().to(dtype)[:, None]
    expected = qkv.clone()
    apply_rope_(expected[:, :heads + kv_heads], cos, sin)
    got = qkv.clone()
    ops.rope_(got[:, :heads + kv_heads], cos, sin)
    assert torch.equal(got, expected)  # v heads untouched too
    alone = qkv[:, :heads].contiguous()
    ops.rope_(alone, cos[:, 0], sin[:, 0])  # [T, D/2] tables as well
    assert torch.equal(alone, expected[:, :heads])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rope_op_rounds_the_edges_as_torch_does(dtype):
    """NaN, ±inf, overflow to inf, subnormals and values at a rounding tie: the same values as the torch rope (a NaN
    where torch has one; bfloat16's own rounding is written out in the op, without c10::BFloat16, and float16's
    goes through F16C's conversions where the CPU has them)."""
    from tandem.common.model.rope import apply_rope_

    ops = cpu_kernels.load_ops()
    info = torch.finfo(dtype)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), info.max, -info.max, info.tiny / 4, 0.0, -0.0,
                             1.0 + info.eps / 2, 3.0, -2.5, 1e-3], dtype=torch.float32)
    gen = torch.Generator().manual_seed(5)
    x = specials[torch.randint(len(specials), (9, 4, 32), generator=gen)].to(dtype)
    table = specials[torch.randint(len(specials), (9, 16), generator=gen)]
    cos, sin = table.to(dtype), table.flip(-1).to(dtype)
    expected, got = x.clone(), x.clone()
    apply_rope_(expected, cos[:, None], sin[:, None])
    ops.rope_(got, cos, sin)
    assert torch.equal(got.isnan(), expected.isnan())
    inf = float("inf")
    assert torch.equal(got.nan_to_num(0.0, inf, -inf), expected.nan_to_num(0.0, inf, -inf))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("tokens", [67, 2100])  # 2100: split over the threads
def test_store_kv_writes_what_index_put_writes(dtype, tokens):
    ops = cpu_kernels.load_ops()
    gen = torch.Generator().manual_seed(3)
    kv_heads, dim = 4, 32
    kv = torch.randn(tokens, 2 * kv_heads * dim, generator=gen).to(dtype)
    k = kv[:, :kv_heads * dim].view(tokens, kv_heads, dim)  # strided rows, as the model hands them over
    v = kv[:, kv_heads * dim:].view(tokens, kv_heads, dim)
    loc = torch.randperm(3000, generator=gen)[:tokens]
    buffers = [torch.zeros(3000, kv_heads, dim, dtype=dtype) for _ in range(4)]
    buffers[0][loc], buffers[1][loc] = k, v
    ops.store_kv(buffers[2], buffers[3], loc, k, v)
    assert torch.equal(buffers[2].view(torch.uint8), buffers[0].view(torch.uint8))
    assert torch.equal(buffers[3].view(torch.uint8), buffers[1].view(torch.uint8))


def test_rope_and_store_kv_name_bad_input():
    ops = cpu_kernels.load_ops()
    buf = torch.zeros(8, 2, 16)
    rows = torch.zeros(2, 2, 16)
    with pytest.raises(RuntimeError, match=r"loc\[1\] = 8 is outside the pool's 8 rows"):
        ops.store_kv(buf, buf.clone(), torch.tensor([0, 8]), rows, rows)
    with pytest.raises(RuntimeError, match="k is BFloat16, its buffer Float"):
        ops.store_kv(buf, buf.clone(), torch.tensor([0, 1]), rows.bfloat16(), rows)
    with pytest.raises(RuntimeError, match="row must be contiguous"):
        ops.store_kv(buf, buf.clone(), torch.tensor([0, 1]), torch.zeros(2, 16, 2).transpose(1, 2), rows)
    with pytest.raises(RuntimeError, match=r"cos must be \[T, D/2\]"):
        ops.rope_(torch.zeros(3, 2, 16), torch.zeros(3, 16), torch.zeros(3, 8))
    with pytest.raises(RuntimeError, match="even D of unit stride"):
        ops.rope_(torch.zeros(3, 2, 15), torch.zeros(3, 7), torch.zeros(3, 7))


def test_rope_and_store_kv_are_traceable():
    ops = cpu_kernels.load_ops()
    torch.library.opcheck(ops.rope_, (torch.randn(3, 4, 16), torch.randn(3, 1, 8), torch.randn(3, 1, 8)),
                          test_utils=("test_schema", "test_faketensor"))
    buf = torch.zeros(8, 2, 16)
    torch.library.opcheck(ops.store_kv, (buf, buf.clone(), torch.tensor([5, 2]), torch.randn(2, 2, 16),
                                         torch.randn(2, 2, 16)), test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 64, 700])  # 700 x 200: split over the threads
def test_norm_ops_match_the_torch_norm(dtype, rows):
    """rms_norm on a [R, H] tensor and on strided [T, N, D] heads (qk-norm's call), add_rms_norm_ on the residual
    stream: the residual bitwise torch's add_, the norms within the dtype's rounding of norm.py's (their sum of
    squares adds in another order); a float32 weight under a 16-bit x as well."""
    from tandem.common.model import norm

    ops = cpu_kernels.load_ops()
    # Two roundings to the dtype (the normalized row, then its product with the weight) each may land one ulp apart.
    tolerance = {"rtol": 2 * torch.finfo(dtype).eps, "atol": 1e-5} if dtype == torch.float16 else {}
    gen = torch.Generator().manual_seed(rows)
    hidden = 200  # not a multiple of the kernel's 16 lanes: the tail loop runs too
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-6), norm.rms_norm(x, weight, 1e-6), **tolerance)
    torch.testing.assert_close(ops.rms_norm(x, weight.float(), 1e-5), norm.rms_norm(x, weight.float(), 1e-5), **tolerance)
    heads = (torch.randn(rows, 6, 32, generator=gen) * 2).to(dtype)[:, 1:5]  # strided rows, as q of a fused qkv
    got = ops.rms_norm(heads, weight[:32], 1e-6)
    assert got.is_contiguous() and got.shape == heads.shape
    torch.testing.assert_close(got, norm.rms_norm(heads, weight[:32], 1e-6), **tolerance)
    update = (torch.randn(rows, 2 * hidden, generator=gen)).to(dtype)[:, :hidden]  # an o_proj row of a wider output
    ours, theirs = x.clone(), x.clone()
    got = ops.add_rms_norm_(ours, update, weight, 1e-6)
    expected = norm.add_rms_norm_(theirs, update, weight, 1e-6)
    assert torch.equal(ours, theirs)
    torch.testing.assert_close(got, expected, **tolerance)


def test_norm_ops_name_bad_input():
    ops = cpu_kernels.load_ops()
    with pytest.raises(RuntimeError, match=r"rms_norm: weight must be a contiguous \[16\] vector"):
        ops.rms_norm(torch.zeros(3, 16), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="weight is BFloat16, x is Float"):
        ops.rms_norm(torch.zeros(3, 16), torch.ones(16, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(RuntimeError, match="unit last stride"):
        ops.rms_norm(torch.zeros(16, 3).t(), torch.ones(16), 1e-6)
    with pytest.raises(RuntimeError, match="supports float32, bfloat16 and float16"):
        ops.rms_norm(torch.zeros(3, 16, dtype=torch.float64), torch.ones(16, dtype=torch.float64), 1e-6)
    with pytest.raises(RuntimeError, match="add_rms_norm_: x must be"):
        ops.add_rms_norm_(torch.zeros(3, 16), torch.zeros(2, 16), torch.ones(16), 1e-6)
    with pytest.raises(RuntimeError, match="residual must be a contiguous"):
        ops.add_rms_norm_(torch.zeros(16, 3).t(), torch.zeros(3, 16), torch.ones(16), 1e-6)


def test_norm_ops_are_traceable():
    ops = cpu_kernels.load_ops()
    torch.library.opcheck(ops.rms_norm, (torch.randn(3, 16), torch.rand(16), 1e-6),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(ops.add_rms_norm_, (torch.randn(3, 16), torch.randn(3, 16), torch.rand(16), 1e-6),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,inter", [(1, 1), (64, 1536), (3, 37), (300, 260)])  # 37: a scalar tail on every path
def test_silu_and_mul_is_the_torch_activation(kernel_isa, dtype, rows, inter):
    """silu(gate) * up with torch's roundings, on each kernel path: float32 within ulps of torch's (exp is SLEEF's
    in both vector loops and std::exp in the portable one, where torch's vector loop runs SLEEF's), bitwise where the
    path's vectors cover the row as torch's do; 16-bit dtypes round both ulp-apart silus the same way here."""
    from tandem.common.model import activation

    ops = cpu_kernels.load_ops()
    gen = torch.Generator().manual_seed(rows * inter)
    # A strided [R, 2I] view (a wider row), as rows picked out of a fused output; scale 6 reaches exp's extremes.
    gate_up = (torch.randn(rows, 2 * inter + 5, generator=gen) * 6).to(dtype)[:, : 2 * inter]
    got = ops.silu_and_mul(gate_up)
    expected = activation.silu_and_mul(gate_up)
    assert got.shape == (rows, inter) and got.is_contiguous() and got.dtype == dtype
    if dtype == torch.float32:
        # An ulp of silu, then the product's own rounding: a few float32 eps relative at most.
        torch.testing.assert_close(got, expected, rtol=4 * torch.finfo(dtype).eps, atol=1e-30)
        if kernel_isa != "portable" and inter % 32 == 0:
            assert torch.equal(got, expected)
    else:  # one ulp of the float32 silu can flip a 16-bit rounding
        torch.testing.assert_close(got, expected, rtol=torch.finfo(dtype).eps, atol=1e-30)
    edge = torch.tensor([[0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 104.0, -104.0, float("inf"), float("-inf"),
                          float("nan"), 3.0] * 2], dtype=dtype)
    torch.testing.assert_close(ops.silu_and_mul(edge), activation.silu_and_mul(edge), equal_nan=True)


def test_silu_and_mul_names_bad_input():
    ops = cpu_kernels.load_ops()
    with pytest.raises(RuntimeError, match=r"silu_and_mul: gate_up must be \[R, 2I\]"):
        ops.silu_and_mul(torch.zeros(3, 7))
    with pytest.raises(RuntimeError, match="unit last stride"):
        ops.silu_and_mul(torch.zeros(8, 3).t())
    with pytest.raises(RuntimeError, match=r"gate_up must be \[R, 2I\]"):
        ops.silu_and_mul(torch.zeros(2, 3, 8))
    with pytest.raises(RuntimeError, match="supports float32, bfloat16 and float16"):
        ops.silu_and_mul(torch.zeros(3, 8, dtype=torch.float64))
    torch.library.opcheck(ops.silu_and_mul, (torch.randn(3, 16),), test_utils=("test_schema", "test_faketensor"))


def test_the_cpu_backend_runs_the_mlp_activation_through_its_op(monkeypatch):
    """A dense MLP built with the cpu backend calls its silu_and_mul (the same output as the torch backend's MLP);
    the model's layers hand their backend to the MLP."""
    from tandem.common.model.moe import MLP

    backend = CpuAttentionBackend()
    calls = []
    monkeypatch.setattr(backend, "ops", type("Ops", (), {
        "silu_and_mul": lambda self, x: calls.append(tuple(x.shape)) or cpu_kernels.load_ops().silu_and_mul(x)})())
    ours, theirs = MLP(32, 48, backend), MLP(32, 48, TorchAttentionBackend())
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(5, 32)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-6, atol=1e-6)
    assert calls == [(5, 96)]


def test_the_cpu_backend_runs_the_model_norms_through_its_ops(monkeypatch):
    """A decoder layer's norms reach the backend's kernels (the residual add fused into the second); the torch
    backend keeps norm.py's ops."""
    from tandem.common.model.llama import RMSNorm

    backend = CpuAttentionBackend()
    calls = []
    monkeypatch.setattr(backend, "ops", type("Ops", (), {
        "rms_norm": lambda self, *a: calls.append("rms_norm") or cpu_kernels.load_ops().rms_norm(*a),
        "add_rms_norm_": lambda self, *a: calls.append("add") or cpu_kernels.load_ops().add_rms_norm_(*a)})())
    layer_norm = RMSNorm(32, 1e-6, backend)
    x, residual = torch.randn(4, 32), torch.randn(4, 32)
    layer_norm(x)
    layer_norm.add_and_norm_(residual, x)
    assert calls == ["rms_norm", "add"]
    RMSNorm(32, 1e-6, TorchAttentionBackend())(x)
    assert calls == ["rms_norm", "add"]
