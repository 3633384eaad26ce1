// The machine's float32 FMA peak: every thread runs independent FMA chains on the widest vector unit built here.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <chrono>
#include <vector>

namespace {

// Enough independent chains to cover FMA latency (4 cycles) times FMA ports (2) with room to spare.
#ifdef __AVX512F__
constexpr int kChains512 = 16;

float chains_avx512(int64_t iters) {
  __m512 acc[kChains512];
  for (int i = 0; i < kChains512; ++i) acc[i] = _mm512_set1_ps(1.0f + 1e-3f * i);
  const __m512 mul = _mm512_set1_ps(0.9999999f), add = _mm512_set1_ps(1e-7f);
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 16
    for (int i = 0; i < kChains512; ++i) acc[i] = _mm512_fmadd_ps(acc[i], mul, add);
  }
  __m512 sum = acc[0];
  for (int i = 1; i < kChains512; ++i) sum = _mm512_add_ps(sum, acc[i]);
  return _mm512_reduce_add_ps(sum);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
constexpr int kChains256 = 12;  // 16 ymm registers: 12 chains and the two constants

float chains_avx2(int64_t iters) {
  __m256 acc[kChains256];
  for (int i = 0; i < kChains256; ++i) acc[i] = _mm256_set1_ps(1.0f + 1e-3f * i);
  const __m256 mul = _mm256_set1_ps(0.9999999f), add = _mm256_set1_ps(1e-7f);
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < kChains256; ++i) acc[i] = _mm256_fmadd_ps(acc[i], mul, add);
  }
  __m256 sum = acc[0];
  for (int i = 1; i < kChains256; ++i) sum = _mm256_add_ps(sum, acc[i]);
  float lanes[8];
  _mm256_storeu_ps(lanes, sum);
  return lanes[0] + lanes[1] + lanes[2] + lanes[3] + lanes[4] + lanes[5] + lanes[6] + lanes[7];
}
#endif

}  // namespace

// Vector widths (floats) this build can probe: 16 (AVX-512), 8 (AVX2+FMA); empty on other CPUs.
std::vector<int64_t> fma_widths() {
  std::vector<int64_t> widths;
#ifdef __AVX512F__
  widths.push_back(16);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  widths.push_back(8);
#endif
  return widths;
}

// Runs `iters` FMA rounds on each of `threads` threads at vector width `width`; returns [flops, seconds].
at::Tensor fma_probe(int64_t iters, int64_t width, int64_t threads) {
  TORCH_CHECK(threads >= 1, "fma_probe: threads must be >= 1");
  std::vector<float> sink(threads, 0.0f);
  int chains = 0;
#ifdef __AVX512F__
  if (width == 16) chains = kChains512;
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (width == 8) chains = kChains256;
#endif
  TORCH_CHECK(chains > 0, "fma_probe: vector width ", width, " was not built on this CPU");
  auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
#ifdef __AVX512F__
      if (width == 16) sink[t] = chains_avx512(iters);
#endif
#if defined(__AVX2__) && defined(__FMA__)
      if (width == 8) sink[t] = chains_avx2(iters);
#endif
    }
  });
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  float total = 0.0f;
  for (float s : sink) total += s;
  TORCH_CHECK(total == total, "fma_probe: the chains overflowed");  // also keeps the chains alive
  double flops = 2.0 * chains * width * static_cast<double>(iters) * threads;
  return at::tensor({flops, seconds}, at::kDouble);
}
