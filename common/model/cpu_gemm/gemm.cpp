// float32 GEMM  out[M, N] = x[M, K] @ weight[N, K]^T (+ bias): a register-blocked micro-kernel over a weight
// packed once into panels of NR columns, [ceil(N / NR)][K][NR] (the last panel zero-padded), parallel over
// (block of rows, panel) pairs.
// Two variants, both built where the CPU has them and picked by the packed weight's panel width:
// AVX-512, 12 x 32 register tiles (24 zmm accumulators); AVX2+FMA, 6 x 16 (12 ymm accumulators).
// The panels may hold bfloat16 or float16 weights (2 bytes a weight, what a 16-bit checkpoint holds): the
// micro-kernel widens them in registers as they stream in (exact), so the arithmetic, and every output bit, is
// the float32 GEMM's over the widened weight, for half the weight bytes, on CPUs with no bf16 dot product.
// Quantized panels (4-bit, int8 or float8_e4m3fn codes: GGUF's Q4/Q8_0/Q6_K types, AWQ/GPTQ, FP8 checkpoints,
// online int8/fp8; a scale and maybe an offset per group of input columns) are turned into float32 weights the same
// way, one fused multiply-add each (packed_quant_linear).
// (Widening a block once into an L1 buffer for all the row blocks measured slower: the buffer pass and the
// multiply no longer overlap the weight's stream from memory.)
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

// SLEEF's 1-ulp vector exp as libtorch_cpu exports it: the one torch's vectorized silu and our silu_and_mul
// (attention/cpu/mlp_ops.cpp) call, so the fused activation below gives their bits.
#if defined(__AVX512F__)
extern "C" __m512 Sleef_expf16_u10(__m512);
#endif
#if defined(__AVX2__) && defined(__FMA__)
extern "C" __m256 Sleef_expf8_u10(__m256);
#endif

// probe.cpp
std::vector<int64_t> fma_widths();
at::Tensor fma_probe(int64_t iters, int64_t width, int64_t threads);

namespace {

// K is walked in blocks of kKc so a block of one panel (kKc x NR floats) stays in L1 across the row blocks;
// M in blocks of at most kMc rows, so the rows a thread multiplies stay in L2 across the panels it takes.
constexpr int64_t kKc = 256;
constexpr int64_t kMc = 192;
// The first row tile of each K block brings the panel in from memory while later tiles find it in L1; it prefetches
// the panel kPrefetchRows rows (of NR weights) ahead into L1, which its own loads would otherwise wait for: the
// linears of a decode step, each weight cold, ran 5-10 % faster with it (bitwise the same; docs/performance-history.md
// section 29).
constexpr int64_t kPrefetchRows = 64;

#if defined(__AVX512F__)
struct Avx512 {
  static constexpr int kNr = 32, kMr = 12, kLanes = 16;
  using Vec = __m512;
  static Vec zero() { return _mm512_setzero_ps(); }
  static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  static Vec load(const at::BFloat16* p) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
  static Vec load(const at::Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
  static Vec broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  // silu(x) = x / (1 + exp(-x)), mlp_ops.cpp's vector loop
  static Vec silu(Vec x) {
    const Vec e = Sleef_expf16_u10(_mm512_castsi512_ps(
        _mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32(static_cast<int>(0x80000000u)))));
    return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e));
  }
  static Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
  // A row of a 4-bit panel: 16 bytes, byte j holding column j (low nibble) and column j + 16 (high), as codes.
  static constexpr int kMrQuant = 8;  // the quantized kernel's row tile: 16 accumulators, scales and offsets beside
  static void nibbles(const uint8_t* p, Vec& lo, Vec& hi) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), mask = _mm_set1_epi8(0x0F);
    lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, mask)));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask)));
  }
  // A row of an 8-bit panel: 32 signed codes, columns 0-15 then 16-31.
  static void int8s(const int8_t* p, Vec& lo, Vec& hi) {
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  }
  // 32 float8_e4m3fn codes as 2^-8 times their values (the packed scales carry the 2^8): e4m3fn s eeee mmm is
  // fp16 s 0eeee mmm0000000 (sign-extended to 16 bits, shifted left 7, bit 14 cleared) at 2^-8 of its value,
  // subnormals included. A checkpoint's weights hold no NaN.
  static Vec fp8_half(const uint8_t* p) {
    const __m256i shifted = _mm256_slli_epi16(
        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 7);
    return _mm512_cvtph_ps(_mm256_and_si256(shifted, _mm256_set1_epi16(static_cast<int16_t>(0xBFFF))));
  }
  static void fp8s(const uint8_t* p, Vec& lo, Vec& hi) {
    lo = fp8_half(p);
    hi = fp8_half(p + 16);
  }
};
#endif

#if defined(__AVX2__) && defined(__FMA__)
struct Avx2 {
  static constexpr int kNr = 16, kMr = 6, kLanes = 8;
  using Vec = __m256;
  static Vec zero() { return _mm256_setzero_ps(); }
  static Vec load(const float* p) { return _mm256_loadu_ps(p); }
  static Vec load(const at::BFloat16* p) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  }
  static Vec load(const at::Half* p) {
#if defined(__F16C__)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
    float wide[kLanes];
    for (int i = 0; i < kLanes; ++i) wide[i] = float(p[i]);
    return _mm256_loadu_ps(wide);
#endif
  }
  static void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
  static Vec broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  static Vec silu(Vec x) {
    const Vec e = Sleef_expf8_u10(_mm256_xor_ps(x, _mm256_set1_ps(-0.f)));
    return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), e));
  }
  static Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
  static constexpr int kMrQuant = 4;  // 8 accumulators: with the scales, offsets and codes, the 16 ymm registers
  static void nibbles(const uint8_t* p, Vec& lo, Vec& hi) {  // 8 bytes: columns j (low nibble) and j + 8 (high)
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)), mask = _mm_set1_epi8(0x0F);
    lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(bytes, mask)));
    hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask)));
  }
  static void int8s(const int8_t* p, Vec& lo, Vec& hi) {  // 16 signed codes: columns 0-7 then 8-15
    lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
  }
  static Vec fp8_half(const uint8_t* p) {  // 8 float8_e4m3fn codes at 2^-8 of their values (as Avx512's)
#if defined(__F16C__)
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    const __m128i shifted = _mm_slli_epi16(_mm_cvtepi8_epi16(bytes), 7);
    return _mm256_cvtph_ps(_mm_and_si128(shifted, _mm_set1_epi16(static_cast<int16_t>(0xBFFF))));
#else
    float wide[kLanes];
    for (int i = 0; i < kLanes; ++i) {
      wide[i] = static_cast<float>(c10::Float8_e4m3fn(p[i], c10::Float8_e4m3fn::from_bits())) * (1.f / 256.f);
    }
    return _mm256_loadu_ps(wide);
#endif
  }
  static void fp8s(const uint8_t* p, Vec& lo, Vec& hi) {
    lo = fp8_half(p);
    hi = fp8_half(p + 8);
  }
};
#endif

// tile[MR][NR] (+)= x[MR rows, 0:kc] @ panel[0:kc][NR]; `accumulate` adds to what the tile holds. A 16-bit panel
// is widened in registers as it is loaded (exactly: every float16 and bfloat16 is a float32). kPrefetch: the tile
// that streams the block in from memory (see kPrefetchRows); a prefetch past the packed weight's end is harmless.
template <class Isa, class W, int MR, bool kPrefetch>
void micro_kernel(const float* x, int64_t ldx, const W* panel, int64_t kc, float* tile, bool accumulate) {
  constexpr int kNr = Isa::kNr, kLanes = Isa::kLanes, kVecs = kNr / kLanes;
  typename Isa::Vec acc[MR][kVecs];
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < kVecs; ++v) acc[r][v] = accumulate ? Isa::load(tile + r * kNr + v * kLanes) : Isa::zero();
  for (int64_t k = 0; k < kc; ++k) {
    typename Isa::Vec b[kVecs];
    if constexpr (kPrefetch) {
      constexpr int kLine = 64 / int(sizeof(W));  // weights a cache line holds
#pragma GCC unroll 4
      for (int l = 0; l < (kNr + kLine - 1) / kLine; ++l) {
        _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kPrefetchRows) * kNr + l * kLine), _MM_HINT_T0);
      }
    }
#pragma GCC unroll 4
    for (int v = 0; v < kVecs; ++v) b[v] = Isa::load(panel + k * kNr + v * kLanes);
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
      typename Isa::Vec a = Isa::broadcast(x + r * ldx + k);
#pragma GCC unroll 4
      for (int v = 0; v < kVecs; ++v) acc[r][v] = Isa::fma(a, b[v], acc[r][v]);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < kVecs; ++v) Isa::store(tile + r * kNr + v * kLanes, acc[r][v]);
}

template <class W>
using Kernel = void (*)(const float*, int64_t, const W*, int64_t, float*, bool);

template <class Isa, class W, bool kPrefetch, int... Rows>
constexpr std::array<Kernel<W>, sizeof...(Rows)> kernels_by_rows(std::integer_sequence<int, Rows...>) {
  return {&micro_kernel<Isa, W, Rows + 1, kPrefetch>...};
}

// Rows [0, m) of x times one panel, summed in `scratch` ([m][NR] floats): K blocks outer, row blocks inner, so each
// block of the panel is loaded into L1 once for all the rows.
template <class Isa, class W>
void panel_sums(const float* x, int64_t m, int64_t k, const W* panel, float* scratch) {
  constexpr int kNr = Isa::kNr, kMr = Isa::kMr;
  static constexpr auto by_rows = kernels_by_rows<Isa, W, false>(std::make_integer_sequence<int, kMr>{});
  static constexpr auto streaming = kernels_by_rows<Isa, W, true>(std::make_integer_sequence<int, kMr>{});
  for (int64_t k0 = 0; k0 < k; k0 += kKc) {
    const int64_t kc = std::min(kKc, k - k0);
    for (int64_t m0 = 0; m0 < m; m0 += kMr) {
      const int64_t rows = std::min<int64_t>(kMr, m - m0);
      (m0 == 0 ? streaming : by_rows)[rows - 1](x + m0 * k + k0, k, panel + k0 * kNr, kc, scratch + m0 * kNr,
                                                k0 > 0);
    }
  }
}

// Rows [0, m) of a panel's sums ([m][NR] in `scratch`) into output columns [n0, n0 + cols) of `out` (+ bias).
template <int kNr>
void write_panel(const float* scratch, int64_t m, const float* bias, float* out, int64_t n, int64_t n0,
                 int64_t cols) {
  for (int64_t r = 0; r < m; ++r) {
    float* dst = out + r * n + n0;
    const float* src = scratch + r * kNr;
    if (bias != nullptr) {
      for (int64_t c = 0; c < cols; ++c) dst[c] = src[c] + bias[n0 + c];
    } else {
      std::memcpy(dst, src, cols * sizeof(float));
    }
  }
}

// panel_sums, written to output columns [n0, n0 + cols) of `out` (+ bias).
template <class Isa, class W>
void panel_product(const float* x, int64_t m, int64_t k, const W* panel, const float* bias, float* out,
                   int64_t n, int64_t n0, int64_t cols, float* scratch) {
  panel_sums<Isa, W>(x, m, k, panel, scratch);
  write_panel<Isa::kNr>(scratch, m, bias, out, n, n0, cols);
}

// Work items are (block of rows, panel) pairs, row-block major, so a thread's consecutive items share rows. The
// blocks are as even as the rows allow (at most kMc each): the threads take equal runs of items, so a short last
// block left one thread a quarter of the rows at 256 (192 + 64), 1.4x slower, until they were.
template <class Isa, class W>
void linear(const float* x, int64_t m, int64_t k, const W* packed, int64_t panels, const float* bias,
            float* out, int64_t n) {
  constexpr int kNr = Isa::kNr;
  const int64_t row_blocks = (m + kMc - 1) / kMc, mc = (m + row_blocks - 1) / row_blocks;
  at::parallel_for(0, row_blocks * panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(mc * kNr);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t m0 = item / panels * mc, p = item % panels, n0 = p * kNr;
      panel_product<Isa, W>(x + m0 * k, std::min(mc, m - m0), k, packed + p * k * kNr, bias, out + m0 * n, n,
                            n0, std::min<int64_t>(kNr, n - n0), scratch.data());
    }
  });
}

// ---- Quantized weights: codes q with a scale s and an offset z per group of `group` input columns, w = q * s + z.
// 4-bit codes (GGUF's Q4_0 / Q4_1 / Q4_K, AWQ, GPTQ: q in 0..15), signed 8-bit ones (Q8_0, Q6_K, online int8) or
// float8_e4m3fn ones (FP8 checkpoints, online fp8; their 2^8 folded into the scales). A panel of NR columns holds
// its codes [K][row bytes] (4-bit: NR / 2 bytes a row, byte j holding column j in its low nibble and j + NR / 2 in
// its high one; 8-bit: NR bytes) and, per group (the last one may be short), NR scales then NR offsets
// ([ceil(K / group)][2][NR] floats), or the scales alone where every offset is zero ([..][1][NR]).
// The micro-kernel turns a row of codes into float32 weights in registers (one fused multiply-add with the group's
// scale and offset) and multiplies as the float32 kernel does: the weight streams in at half a byte or a byte a
// weight plus a scale (and an offset) a group, and no full-precision copy is ever made. (torch's
// _weight_int4pack_mm_for_cpu has no vector path for float32 rows, ~2 GFLOP/s; docs/quantization.md.)
enum CodeKind : int { kInt4 = 0, kInt8 = 1, kFp8 = 2 };

template <class Isa, int kKind>
struct Codes {
  using T = std::conditional_t<kKind == kInt8, int8_t, uint8_t>;
  static constexpr int kRowBytes = kKind == kInt4 ? Isa::kNr / 2 : Isa::kNr;
  static void load(const T* p, typename Isa::Vec& lo, typename Isa::Vec& hi) {
    if constexpr (kKind == kInt4) {
      Isa::nibbles(p, lo, hi);
    } else if constexpr (kKind == kInt8) {
      Isa::int8s(p, lo, hi);
    } else {
      Isa::fp8s(p, lo, hi);
    }
  }
};

template <class Isa, int kKind, class S, bool kOffsets, int MR, bool kPrefetch>
void quant_micro_kernel(const float* x, int64_t ldx, const void* panel_codes, const void* panel_sz, int64_t k0,
                        int64_t kc, int64_t group, float* tile, bool accumulate) {
  using C = Codes<Isa, kKind>;
  constexpr int kNr = Isa::kNr, kLanes = Isa::kLanes, kBytes = C::kRowBytes;
  static_assert(kNr == 2 * kLanes, "a row of codes is two vectors");
  const auto* codes = static_cast<const typename C::T*>(panel_codes);
  const auto* sz = static_cast<const S*>(panel_sz);
  typename Isa::Vec acc[MR][2];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < 2; ++v) acc[r][v] = accumulate ? Isa::load(tile + r * kNr + v * kLanes) : Isa::zero();
  for (int64_t k = 0; k < kc;) {
    const int64_t g = (k0 + k) / group, stop = std::min(kc, (g + 1) * group - k0);
    const S* gsz = sz + g * (kOffsets ? 2 : 1) * kNr;
    const typename Isa::Vec s0 = Isa::load(gsz), s1 = Isa::load(gsz + kLanes);
    const typename Isa::Vec z0 = kOffsets ? Isa::load(gsz + kNr) : Isa::zero();
    const typename Isa::Vec z1 = kOffsets ? Isa::load(gsz + kNr + kLanes) : Isa::zero();
    for (; k < stop; ++k) {
      if constexpr (kPrefetch) {
        if ((k * kBytes) % 64 == 0) {
          const auto* ahead = codes + (k + kPrefetchRows * 64 / kBytes) * kBytes;
          _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
        }
      }
      typename Isa::Vec b0, b1;
      C::load(codes + k * kBytes, b0, b1);
      if constexpr (kOffsets) {
        b0 = Isa::fma(b0, s0, z0);
        b1 = Isa::fma(b1, s1, z1);
      } else {  // q * s rounded once, as the fused multiply-add with a zero offset would round it
        b0 = Isa::mul(b0, s0);
        b1 = Isa::mul(b1, s1);
      }
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const typename Isa::Vec a = Isa::broadcast(x + r * ldx + k);
        acc[r][0] = Isa::fma(a, b0, acc[r][0]);
        acc[r][1] = Isa::fma(a, b1, acc[r][1]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < 2; ++v) Isa::store(tile + r * kNr + v * kLanes, acc[r][v]);
}

using QuantKernel = void (*)(const float*, int64_t, const void*, const void*, int64_t, int64_t, int64_t, float*,
                             bool);

template <class Isa, int kKind, class S, bool kOffsets, bool kPrefetch, int... Rows>
constexpr std::array<QuantKernel, sizeof...(Rows)> quant_kernels_by_rows(std::integer_sequence<int, Rows...>) {
  return {&quant_micro_kernel<Isa, kKind, S, kOffsets, Rows + 1, kPrefetch>...};
}

// panel_sums over one quantized panel (its codes and its groups' scales and offsets).
template <class Isa, int kKind, class S, bool kOffsets>
void quant_panel_sums(const float* x, int64_t m, int64_t k, const uint8_t* codes, const S* sz, int64_t group,
                      float* scratch) {
  constexpr int kNr = Isa::kNr, kMr = Isa::kMrQuant, kBytes = Codes<Isa, kKind>::kRowBytes;
  static constexpr auto by_rows =
      quant_kernels_by_rows<Isa, kKind, S, kOffsets, false>(std::make_integer_sequence<int, kMr>{});
  static constexpr auto streaming =
      quant_kernels_by_rows<Isa, kKind, S, kOffsets, true>(std::make_integer_sequence<int, kMr>{});
  for (int64_t k0 = 0; k0 < k; k0 += kKc) {
    const int64_t kc = std::min(kKc, k - k0);
    for (int64_t m0 = 0; m0 < m; m0 += kMr) {
      const int64_t rows = std::min<int64_t>(kMr, m - m0);
      (m0 == 0 ? streaming : by_rows)[rows - 1](x + m0 * k + k0, k, codes + k0 * kBytes, sz, k0, kc, group,
                                                scratch + m0 * kNr, k0 > 0);
    }
  }
}

// linear() over quantized panels.
template <class Isa, int kKind, class S, bool kOffsets>
void quant_linear(const float* x, int64_t m, int64_t k, const uint8_t* codes, const S* sz, int64_t panels,
                  int64_t group, const float* bias, float* out, int64_t n) {
  constexpr int kNr = Isa::kNr;
  const int64_t row_blocks = (m + kMc - 1) / kMc, mc = (m + row_blocks - 1) / row_blocks;
  const int64_t panel_codes = k * Codes<Isa, kKind>::kRowBytes;
  const int64_t panel_sz = (k + group - 1) / group * (kOffsets ? 2 : 1) * kNr;
  at::parallel_for(0, row_blocks * panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(mc * kNr);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t m0 = item / panels * mc, p = item % panels, rows = std::min(mc, m - m0);
      quant_panel_sums<Isa, kKind, S, kOffsets>(x + m0 * k, rows, k, codes + p * panel_codes, sz + p * panel_sz,
                                                group, scratch.data());
      write_panel<kNr>(scratch.data(), rows, bias, out + m0 * n, n, p * kNr, std::min<int64_t>(kNr, n - p * kNr));
    }
  });
}

template <class Isa, class S, bool kOffsets>
void quant_linear_codes(const at::Tensor& x2, int64_t m, int64_t k, const at::Tensor& codes, const S* sz,
                        int64_t panels, int64_t group, const float* bias, at::Tensor& out, int64_t n) {
  const auto* c = static_cast<const uint8_t*>(codes.data_ptr());
  const float* x = x2.data_ptr<float>();
  if (codes.scalar_type() == at::kByte) {
    quant_linear<Isa, kInt4, S, kOffsets>(x, m, k, c, sz, panels, group, bias, out.data_ptr<float>(), n);
  } else if (codes.scalar_type() == at::kChar) {
    quant_linear<Isa, kInt8, S, kOffsets>(x, m, k, c, sz, panels, group, bias, out.data_ptr<float>(), n);
  } else {
    quant_linear<Isa, kFp8, S, kOffsets>(x, m, k, c, sz, panels, group, bias, out.data_ptr<float>(), n);
  }
}

// The scales and offsets in float32, or in bfloat16 (a bfloat16 model's: widened in registers, exact).
template <class Isa>
void quant_linear_any(const at::Tensor& x2, int64_t m, int64_t k, const at::Tensor& codes, const at::Tensor& sz,
                      int64_t panels, int64_t group, const float* bias, at::Tensor& out, int64_t n) {
  const bool offsets = sz.size(2) == 2;
  if (sz.scalar_type() == at::kFloat) {
    (offsets ? quant_linear_codes<Isa, float, true> : quant_linear_codes<Isa, float, false>)(
        x2, m, k, codes, sz.data_ptr<float>(), panels, group, bias, out, n);
  } else {
    (offsets ? quant_linear_codes<Isa, at::BFloat16, true> : quant_linear_codes<Isa, at::BFloat16, false>)(
        x2, m, k, codes, sz.data_ptr<at::BFloat16>(), panels, group, bias, out, n);
  }
}

// The SwiGLU MLP's first half in one pass: act[M, I] = T(T(silu(T(gate))) * T(up)) where [gate | up] = x @ W.T and
// W [2I, K] packs gate's rows then up's (I a multiple of NR, so each half is whole panels). Each work item multiplies
// a block of rows by gate panel p and up panel p + I / NR into two scratches and activates them there: the
// [M, 2I] product is never written out and read back (it is the largest tensor of a forward: 12 MiB of a 1024-row
// prefill of the small model). The arithmetic is packed_linear's, then mlp_ops.cpp's silu_and_mul rounding to T
// (the model's dtype; identity for float32) in its order, with the same vector exp: bitwise the two ops.
template <class Isa, class W, class T>
void gate_up_silu(const float* x, int64_t m, int64_t k, const W* packed, int64_t panels, T* out, int64_t inter) {
  constexpr int kNr = Isa::kNr, kLanes = Isa::kLanes;
  const int64_t half = panels / 2;
  const int64_t row_blocks = (m + kMc - 1) / kMc, mc = (m + row_blocks - 1) / row_blocks;
  at::parallel_for(0, row_blocks * half, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> gate(mc * kNr), up(mc * kNr);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t m0 = item / half * mc, p = item % half, rows = std::min(mc, m - m0);
      panel_sums<Isa, W>(x + m0 * k, rows, k, packed + p * k * kNr, gate.data());
      panel_sums<Isa, W>(x + m0 * k, rows, k, packed + (p + half) * k * kNr, up.data());
      for (int64_t r = 0; r < rows; ++r) {
        float* g = gate.data() + r * kNr;
        float* u = up.data() + r * kNr;
        T* dst = out + (m0 + r) * inter + p * kNr;
        if constexpr (std::is_same_v<T, float>) {
          for (int v = 0; v < kNr / kLanes; ++v) {
            Isa::store(dst + v * kLanes, Isa::mul(Isa::silu(Isa::load(g + v * kLanes)), Isa::load(u + v * kLanes)));
          }
        } else {  // the linear's output rounded to T, silu's, then the product's (silu_and_mul over a T tensor)
          for (int c = 0; c < kNr; ++c) g[c] = static_cast<float>(static_cast<T>(g[c]));
          for (int v = 0; v < kNr / kLanes; ++v) Isa::store(g + v * kLanes, Isa::silu(Isa::load(g + v * kLanes)));
          for (int c = 0; c < kNr; ++c) {
            dst[c] = static_cast<T>(static_cast<float>(static_cast<T>(g[c])) *
                                    static_cast<float>(static_cast<T>(u[c])));
          }
        }
      }
    }
  });
}

template <class Isa, class W>
void gate_up_silu_any(const float* x, int64_t m, int64_t k, const W* packed, int64_t panels, at::Tensor& out,
                      int64_t inter) {
  switch (out.scalar_type()) {
    case at::kFloat: gate_up_silu<Isa>(x, m, k, packed, panels, out.data_ptr<float>(), inter); break;
    case at::kBFloat16: gate_up_silu<Isa>(x, m, k, packed, panels, out.data_ptr<at::BFloat16>(), inter); break;
    case at::kHalf: gate_up_silu<Isa>(x, m, k, packed, panels, out.data_ptr<at::Half>(), inter); break;
    default: TORCH_CHECK(false, "packed_gate_up_silu: a float32, bfloat16 or float16 output, not ", out.scalar_type());
  }
}

template <class Isa>
void gate_up_silu_panels(const at::Tensor& x2, int64_t m, int64_t k, const at::Tensor& packed, int64_t panels,
                         at::Tensor& out, int64_t inter) {
  const float* xp = x2.data_ptr<float>();
  switch (packed.scalar_type()) {
    case at::kFloat: gate_up_silu_any<Isa>(xp, m, k, packed.data_ptr<float>(), panels, out, inter); break;
    case at::kBFloat16: gate_up_silu_any<Isa>(xp, m, k, packed.data_ptr<at::BFloat16>(), panels, out, inter); break;
    case at::kHalf: gate_up_silu_any<Isa>(xp, m, k, packed.data_ptr<at::Half>(), panels, out, inter); break;
    default: TORCH_CHECK(false, "packed_gate_up_silu: float32, bfloat16 or float16 panels, not ",
                         packed.scalar_type());
  }
}

template <class Isa>
void linear_any(const at::Tensor& x2, int64_t m, int64_t k, const at::Tensor& packed, int64_t panels,
                const float* bias, at::Tensor& out, int64_t n) {
  const float* xp = x2.data_ptr<float>();
  float* op = out.data_ptr<float>();
  switch (packed.scalar_type()) {
    case at::kFloat: linear<Isa>(xp, m, k, packed.data_ptr<float>(), panels, bias, op, n); break;
    case at::kBFloat16: linear<Isa>(xp, m, k, packed.data_ptr<at::BFloat16>(), panels, bias, op, n); break;
    case at::kHalf: linear<Isa>(xp, m, k, packed.data_ptr<at::Half>(), panels, bias, op, n); break;
    default: TORCH_CHECK(false, "packed_linear: float32, bfloat16 or float16 panels, not ", packed.scalar_type());
  }
}

}  // namespace

// Panel widths this build has a kernel for, widest first: 32 (AVX-512), 16 (AVX2+FMA); empty on other CPUs.
std::vector<int64_t> gemm_panel_widths() {
  std::vector<int64_t> widths;
#if defined(__AVX512F__)
  widths.push_back(Avx512::kNr);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  widths.push_back(Avx2::kNr);
#endif
  return widths;
}

// weight [N, K] float32, bfloat16 or float16 -> panels [ceil(N / width), K, width] of the same dtype, zero-padded
// past N.
at::Tensor pack_weight(const at::Tensor& weight, int64_t width) {
  const auto widths = gemm_panel_widths();
  TORCH_CHECK(std::find(widths.begin(), widths.end(), width) != widths.end(),
              "pack_weight: no kernel of panel width ", width, " was built on this CPU");
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(weight.dim() == 2 && (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf),
              "pack_weight: a 2-D float32, bfloat16 or float16 weight, not ", weight.dim(), "-D ", dtype);
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + width - 1) / width;
  at::Tensor padded = at::zeros({panels * width, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  return padded.view({panels, width, k}).transpose(1, 2).contiguous();
}

namespace {

// The frame the float32 and quantized linears share: x [.., K] float32 as [M, K] rows, a new [.., n] result, the
// bias (N floats or none) checked; `run(isa, x2, m, bias, out)` multiplies on the variant whose panels are `width`
// wide (Avx512{} or Avx2{}), refused where this CPU has no such variant.
template <class F>
at::Tensor panel_linear(const char* op, const at::Tensor& x, int64_t k, int64_t n, int64_t panels, int64_t width,
                        const c10::optional<at::Tensor>& bias, const F& run) {
  TORCH_CHECK(x.size(-1) == k, op, ": x has ", x.size(-1), " columns, the weight ", k);
  TORCH_CHECK(n > (panels - 1) * width && n <= panels * width, op, ": n does not match the panels");
  const at::Tensor x2 = x.reshape({-1, k}).contiguous();
  const int64_t m = x2.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  at::Tensor out = at::empty({m, n}, x.options());
  at::Tensor bias_f;
  const float* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    bias_f = bias->contiguous();
    TORCH_CHECK(bias_f.scalar_type() == at::kFloat && bias_f.numel() == n, op, ": a bias of N floats");
    bias_ptr = bias_f.data_ptr<float>();
  }
  if (m == 0) return out.view(out_shape);
  bool ran = false;
#if defined(__AVX512F__)
  if (width == Avx512::kNr) {
    run(Avx512{}, x2, m, bias_ptr, out);
    ran = true;
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (width == Avx2::kNr) {
    run(Avx2{}, x2, m, bias_ptr, out);
    ran = true;
  }
#endif
  TORCH_CHECK(ran, op, ": no kernel of panel width ", width, " was built on this CPU");
  return out.view(out_shape);
}

}  // namespace

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                         const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "packed_linear: float32 rows (a 16-bit weight's too), not ",
              x.scalar_type());
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous(), "packed_linear: not a packed weight");
  const int64_t panels = packed.size(0), k = packed.size(1), width = packed.size(2);
  return panel_linear("packed_linear", x, k, n, panels, width, bias,
                      [&](auto isa, const at::Tensor& x2, int64_t m, const float* bias_ptr, at::Tensor& out) {
                        linear_any<decltype(isa)>(x2, m, k, packed, panels, bias_ptr, out, n);
                      });
}

// x [.., K] float32 times quantized panels: codes [P, K, W / 2] uint8 (4-bit), or [P, K, W] int8 or float8_e4m3fn,
// and sz [P, ceil(K / group), 2 or 1, W] float32 or bfloat16 (scales, then any offsets; pack_int4 / pack_int8 /
// pack_fp8 in __init__.py lay them out), W the panel width of a variant built here. Returns [.., n].
at::Tensor packed_quant_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sz, int64_t n,
                               int64_t group, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "packed_quant_linear: float32 rows, not ", x.scalar_type());
  const bool nibbles = codes.scalar_type() == at::kByte;
  TORCH_CHECK(codes.dim() == 3 && codes.is_contiguous() &&
                  (nibbles || codes.scalar_type() == at::kChar || codes.scalar_type() == at::kFloat8_e4m3fn),
              "packed_quant_linear: codes must be contiguous uint8 [panels, K, width / 2] (4-bit), or int8 or "
              "float8_e4m3fn [panels, K, width]");
  const int64_t panels = codes.size(0), k = codes.size(1), width = nibbles ? 2 * codes.size(2) : codes.size(2);
  TORCH_CHECK(group > 0, "packed_quant_linear: a group of ", group, " columns");
  TORCH_CHECK(sz.dim() == 4 && sz.is_contiguous() &&
                  (sz.scalar_type() == at::kFloat || sz.scalar_type() == at::kBFloat16) && sz.size(0) == panels &&
                  sz.size(1) == (k + group - 1) / group && (sz.size(2) == 1 || sz.size(2) == 2) &&
                  sz.size(3) == width,
              "packed_quant_linear: sz must be contiguous float32 or bfloat16 [panels, ceil(K / group), 2, width] "
              "(scales and offsets) or [.., 1, width] (scales)");
  return panel_linear("packed_quant_linear", x, k, n, panels, width, bias,
                      [&](auto isa, const at::Tensor& x2, int64_t m, const float* bias_ptr, at::Tensor& out) {
                        quant_linear_any<decltype(isa)>(x2, m, k, codes, sz, panels, group, bias_ptr, out, n);
                      });
}

// act [.., I] in out_dtype from x [.., K] float32 and the panels of the fused [gate; up] weight [2I, K]; I must be a
// multiple of the panel width.
at::Tensor packed_gate_up_silu(const at::Tensor& x, const at::Tensor& packed, int64_t inter,
                               c10::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "packed_gate_up_silu: float32 rows (a 16-bit weight's too), not ",
              x.scalar_type());
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous(), "packed_gate_up_silu: not a packed weight");
  const int64_t panels = packed.size(0), k = packed.size(1), width = packed.size(2);
  TORCH_CHECK(x.size(-1) == k, "packed_gate_up_silu: x has ", x.size(-1), " columns, the weight ", k);
  TORCH_CHECK(inter > 0 && inter % width == 0 && 2 * inter == panels * width, "packed_gate_up_silu: the weight's ",
              panels * width, " rows are not gate and up of ", inter, " each in whole panels of ", width);
  const at::Tensor x2 = x.reshape({-1, k}).contiguous();
  const int64_t m = x2.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = inter;
  at::Tensor out = at::empty({m, inter}, x.options().dtype(out_dtype.value_or(at::kFloat)));
  if (m == 0) return out.view(out_shape);
  bool ran = false;
#if defined(__AVX512F__)
  if (width == Avx512::kNr) {
    gate_up_silu_panels<Avx512>(x2, m, k, packed, panels, out, inter);
    ran = true;
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (width == Avx2::kNr) {
    gate_up_silu_panels<Avx2>(x2, m, k, packed, panels, out, inter);
    ran = true;
  }
#endif
  TORCH_CHECK(ran, "packed_gate_up_silu: no kernel of panel width ", width, " was built on this CPU");
  return out.view(out_shape);
}

namespace {

// One MoE layer's experts over a float32 batch, in the order of Experts._grouped (common/model/moe.py): each local
// expert in turn gathers its (token, k) pairs in (token, k) order, runs gate/up with SiLU·up in one pass and the down
// projection over our kernel's float32 panels, scales each row by its routing weight, and adds it into its token's
// row of the result (zeros first); a token's contributions are added expert by expert, as index_add_ adds them.
// dst += src, a rounded add of two rounded values (kept out of line so the compiler cannot contract the product
// that made src into a fused multiply-add: _grouped multiplies, rounds, then adds).
__attribute__((noinline)) void add_row(float* dst, const float* src, int64_t n) {
  for (int64_t c = 0; c < n; ++c) dst[c] += src[c];
}

template <class Isa>
void moe_experts_isa(const float* x, int64_t tokens, int64_t hidden, const int64_t* ids, const float* weights,
                     int64_t top_k, at::TensorList w13, at::TensorList w2, int64_t inter, float* out) {
  const int64_t experts = static_cast<int64_t>(w13.size());
  std::vector<std::vector<int64_t>> pairs(experts);  // each expert's (token, k) pairs, in order
  for (int64_t pair = 0; pair < tokens * top_k; ++pair) {
    if (ids[pair] >= 0) pairs[ids[pair]].push_back(pair);
  }
  std::vector<float> h, act, down;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t count = static_cast<int64_t>(pairs[e].size());
    if (count == 0) continue;
    h.resize(count * hidden);
    act.resize(count * inter);
    down.resize(count * hidden);
    for (int64_t r = 0; r < count; ++r) {
      std::memcpy(h.data() + r * hidden, x + pairs[e][r] / top_k * hidden, hidden * sizeof(float));
    }
    gate_up_silu<Isa, float, float>(h.data(), count, hidden, w13[e].data_ptr<float>(), w13[e].size(0), act.data(),
                                    inter);
    linear<Isa, float>(act.data(), count, inter, w2[e].data_ptr<float>(), w2[e].size(0), nullptr, down.data(),
                       hidden);
    for (int64_t r = 0; r < count; ++r) {
      float* row = down.data() + r * hidden;
      const float weight = weights[pairs[e][r]];
      for (int64_t c = 0; c < hidden; ++c) row[c] *= weight;
      add_row(out + pairs[e][r] / top_k * hidden, row, hidden);
    }
  }
}

}  // namespace

// x [T, H] float32; local_ids [T, k] int64 (-1: an expert held elsewhere); weights [T, k] float32; w13[e] the panels
// of expert e's [2I, H] gate/up weight, w2[e] of its [H, I] down weight, float32, one panel width. Returns [T, H].
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& local_ids, const at::Tensor& weights,
                       at::TensorList w13, at::TensorList w2, int64_t inter) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "moe_experts: float32 rows [T, H], not ",
              x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(local_ids.dim() == 2 && local_ids.size(0) == x.size(0) && local_ids.scalar_type() == at::kLong,
              "moe_experts: local_ids must be int64 [T, k]");
  TORCH_CHECK(weights.sizes() == local_ids.sizes() && weights.scalar_type() == at::kFloat,
              "moe_experts: weights must be float32 shaped like local_ids");
  TORCH_CHECK(!w13.empty() && w13.size() == w2.size(), "moe_experts: one w13 and one w2 an expert");
  const int64_t tokens = x.size(0), hidden = x.size(1), top_k = local_ids.size(1);
  const int64_t width = w13[0].dim() == 3 ? w13[0].size(2) : 0;
  for (size_t e = 0; e < w13.size(); ++e) {
    TORCH_CHECK(w13[e].dim() == 3 && w13[e].is_contiguous() && w13[e].scalar_type() == at::kFloat &&
                    w13[e].size(1) == hidden && w13[e].size(2) == width && w13[e].size(0) * width == 2 * inter &&
                    inter % width == 0,
                "moe_experts: w13[", e, "] is not float32 panels of a [2 x ", inter, ", ", hidden, "] weight");
    TORCH_CHECK(w2[e].dim() == 3 && w2[e].is_contiguous() && w2[e].scalar_type() == at::kFloat &&
                    w2[e].size(1) == inter && w2[e].size(2) == width && w2[e].size(0) * width >= hidden &&
                    (w2[e].size(0) - 1) * width < hidden,
                "moe_experts: w2[", e, "] is not float32 panels of a [", hidden, ", ", inter, "] weight");
  }
  const at::Tensor xc = x.contiguous(), ids = local_ids.contiguous(), wc = weights.contiguous();
  TORCH_CHECK(ids.numel() == 0 || ids.max().item<int64_t>() < static_cast<int64_t>(w13.size()),
              "moe_experts: a local id past the ", w13.size(), " experts");
  at::Tensor out = at::zeros({tokens, hidden}, x.options());
  bool ran = false;
#if defined(__AVX512F__)
  if (width == Avx512::kNr) {
    moe_experts_isa<Avx512>(xc.data_ptr<float>(), tokens, hidden, ids.data_ptr<int64_t>(), wc.data_ptr<float>(),
                            top_k, w13, w2, inter, out.data_ptr<float>());
    ran = true;
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (width == Avx2::kNr) {
    moe_experts_isa<Avx2>(xc.data_ptr<float>(), tokens, hidden, ids.data_ptr<int64_t>(), wc.data_ptr<float>(), top_k,
                          w13, w2, inter, out.data_ptr<float>());
    ran = true;
  }
#endif
  TORCH_CHECK(ran, "moe_experts: no kernel of panel width ", width, " was built on this CPU");
  return out;
}

TORCH_LIBRARY(tandem_gemm, m) {
  m.def("fma_widths() -> int[]", &fma_widths);
  m.def("fma_probe(int iters, int width, int threads) -> Tensor", &fma_probe);
  m.def("gemm_panel_widths() -> int[]", &gemm_panel_widths);
  m.def("pack_weight(Tensor weight, int width) -> Tensor", &pack_weight);
  // CPU kernels (not catch-all ones), so torch.compile can take the fakes __init__.py registers for them
  m.def("packed_linear(Tensor x, Tensor packed, int n, Tensor? bias=None) -> Tensor");
  m.def("packed_quant_linear(Tensor x, Tensor codes, Tensor sz, int n, int group, Tensor? bias=None) -> Tensor");
  m.def("packed_gate_up_silu(Tensor x, Tensor packed, int inter, ScalarType? out_dtype=None) -> Tensor",
        &packed_gate_up_silu);
  m.def("moe_experts(Tensor x, Tensor local_ids, Tensor weights, Tensor[] w13, Tensor[] w2, int inter) -> Tensor",
        &moe_experts);
}

TORCH_LIBRARY_IMPL(tandem_gemm, CPU, m) {
  m.impl("packed_linear", &packed_linear);
  m.impl("packed_quant_linear", &packed_quant_linear);
}
