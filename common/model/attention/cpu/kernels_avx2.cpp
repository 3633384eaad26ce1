// AVX2 kernels of the `cpu` attention backend (declared in kernels.h, chosen at run time by paged_attention.cpp
// where the CPU has AVX2, FMA and F16C but no AVX-512: most AMD EPYCs, older Xeons, laptops).
//
// The layout follows kernels_avx512.cpp with 8-float vectors and 16 registers: bf16 widens by a 16-bit shift, fp16
// by vcvtph2ps, FP8 through fp16 (e5m2 is fp16's top byte; e4m3fn's bits move into fp16's fields and 2^8 fixes the
// exponent bias), and every product accumulates in fp32 FMAs. AVX2 has no masked 16-bit loads, so a head dim that
// is no multiple of 8 reads its last vector through a zeroed buffer. Compiled under a target pragma, so the library
// loads on any x86-64 and these functions only run where cpu_has_avx2() says so.

#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#if TANDEM_X86_KERNELS
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
// The `#pragma GCC unroll 8` on loops over register arrays (a[C][W], ...): unrolled early, GCC keeps the arrays in
// registers; otherwise it stores every accumulator to the stack on each iteration.

namespace tandem_cpu {
namespace avx2 {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kDecodeBlock = 128;  // keys scored per online-softmax step in decode
constexpr int64_t kBlock = 64;         // keys per extend step
constexpr int64_t kTile = 4;           // extend rows per register tile
constexpr int kScoreHeads = 8;         // decode: query heads scored per pass over a key (8 accumulators)

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {  // bf16 is fp32's top half: widen, shift, done
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const c10::Float8_e5m2* p) {
  const __m128i bytes = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(_mm_slli_epi16(bytes, 8));
}
// e4m3fn s eeee mmm -> fp16 s 0eeee mmm0000000, times 2^8 (as kernels_avx512.cpp: sign-extend, shift left 7, clear
// bit 14). Never NaN here: the pool clamps its writes.
inline __m256 load8(const c10::Float8_e4m3fn* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i shifted = _mm_slli_epi16(_mm_cvtepi8_epi16(bytes), 7);
  const __m128i half = _mm_and_si128(shifted, _mm_set1_epi16(static_cast<int16_t>(0xBFFF)));
  return _mm256_mul_ps(_mm256_cvtph_ps(half), _mm256_set1_ps(256.f));
}

// The first min(n, 8) values at p, zero past n.
template <typename T>
inline __m256 load8(const T* p, int64_t n) {
  if (n >= 8) return load8(p);
  alignas(32) unsigned char buf[8 * sizeof(T)] = {};
  std::memcpy(buf, p, n * sizeof(T));
  return load8(reinterpret_cast<const T*>(buf));
}

// Lanes [0, n) of p, the rest `fill`.
inline __m256i lane_mask(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(n, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline __m256 load_lanes(const float* p, int64_t n, float fill) {
  if (n >= 8) return _mm256_loadu_ps(p);
  const __m256i mask = lane_mask(n);
  return _mm256_blendv_ps(_mm256_set1_ps(fill), _mm256_maskload_ps(p, mask), _mm256_castsi256_ps(mask));
}
inline void store_lanes(float* p, int64_t n, __m256 v) {
  if (n >= 8) {
    _mm256_storeu_ps(p, v);
  } else {
    _mm256_maskstore_ps(p, lane_mask(n), v);
  }
}

// The first n <= 8 lanes of v into p, rounded as static_cast<T> rounds (the portable loops' own conversion).
template <typename T>
inline void store8(T* p, int64_t n, __m256 v) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  for (int64_t i = 0; i < std::min<int64_t>(n, 8); ++i) p[i] = static_cast<T>(lanes[i]);
}
inline void store8(float* p, int64_t n, __m256 v) { store_lanes(p, n, v); }

inline float hmax(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}
inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

// Lane i of the result is the sum of the 8 lanes of v[i] (v: 8 x 8 floats).
inline __m256 reduce8(const float* v) {
  __m256 h[4];
  for (int i = 0; i < 4; ++i) h[i] = _mm256_hadd_ps(_mm256_loadu_ps(v + 16 * i), _mm256_loadu_ps(v + 16 * i + 8));
  const __m256 lo = _mm256_hadd_ps(h[0], h[1]), hi = _mm256_hadd_ps(h[2], h[3]);  // 128-bit halves: lanes 0-3, 4-7
  return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

// exp(x) for x <= 0, as the portable loops compute it: x = n ln2 + r, Cephes' polynomial, 2^n in the exponent bits.
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// One online-softmax step of a row: scores s[0, n) become probabilities; the running max m, denominator l and the
// accumulator acc [nv vectors] are rescaled when the max moves.
inline void softmax_step(float* s, int64_t n, float& m, float& l, float* acc, int64_t nv) {
  __m256 vmax = _mm256_set1_ps(kNegInf);
  for (int64_t i = 0; i < n; i += 8) vmax = _mm256_max_ps(vmax, load_lanes(s + i, n - i, kNegInf));
  const float m_new = std::max(m, hmax(vmax));
  if (m != m_new) {
    const float alpha = m == kNegInf ? 0.f : std::exp(m - m_new);
    l *= alpha;
    const __m256 a = _mm256_set1_ps(alpha);
    for (int64_t i = 0; i < nv; ++i) _mm256_storeu_ps(acc + 8 * i, _mm256_mul_ps(a, _mm256_loadu_ps(acc + 8 * i)));
    m = m_new;
  }
  const __m256 vm = _mm256_set1_ps(m_new);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    // A lane past n reads -inf: exp gives exp(-87), so it is zeroed before the sum and never stored.
    __m256 e = exp_nonpositive(_mm256_sub_ps(load_lanes(s + i, n - i, kNegInf), vm));
    if (n - i < 8) e = _mm256_and_ps(e, _mm256_castsi256_ps(lane_mask(n - i)));
    store_lanes(s + i, n - i, e);
    sum = _mm256_add_ps(sum, e);
  }
  l += hsum(sum);
}

template <int kLocality>  // 3: into L1 (T0), 2: into L2 (T1)
inline void prefetch_row(const void* row, int64_t bytes) {
  const char* p = static_cast<const char*>(row);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, kLocality);
}

// ---- decode -------------------------------------------------------------------------------------------------------

// Scores of keys [n0, n0 + nb) for the C query heads hq0.. of KV head h: each key vector is converted once and meets
// the C heads' q rows (in L1), one accumulator per (key, head) in registers; up to 4 heads take 2 keys per step, so
// 8 independent FMA chains hide the FMA latency and each q load serves two keys. Every 8 keys a transpose-and-add
// turns the [C, 8 keys, 8 lanes] partial sums into 8 scores per head. The block's first `warm` rows were trickled
// into L2 while the previous block computed; past them the first pass of a block reads whole pool rows (prefetched
// kAhead ahead into L2, the V rows too for the P.V pass); later heads find them in L2. Every key trickles a slice
// of the rows after the block.
template <typename KV, int C>
void score_pass(const PagedKV<KV>& kv, const int64_t* slots, int64_t n0, int64_t nb, int64_t end, int64_t h,
                const float* q0, int64_t head_dim, bool first_pass, int64_t row_bytes, float* partial,
                float* scores, int64_t warm, Trickle<KV>& trickle) {
  constexpr int64_t kAhead = 16;
  constexpr int kKeys = C <= 4 ? 2 : 1;
  const int64_t nv = (head_dim + 7) / 8, dp = nv * 8, head_bytes = dp * int64_t(sizeof(KV));
  auto step = [&](auto keys_tag, int64_t n) {
    constexpr int K = decltype(keys_tag)::value;
    const KV* key[K];
    for (int j = 0; j < K; ++j) {
      if (n0 + n + j + kAhead < end) {
        const int64_t ahead = slots[n0 + n + j + kAhead] * kv.row_stride;
        if (first_pass && n + j + kAhead >= warm) {
          prefetch_row<2>(kv.k + ahead, row_bytes);
          prefetch_row<2>(kv.v + ahead, row_bytes);
        }
        prefetch_row<3>(kv.k + ahead + h * kv.head_stride, head_bytes);
      }
      trickle.step();
      key[j] = kv.k + slots[n0 + n + j] * kv.row_stride + h * kv.head_stride;
    }
    __m256 s[K][C];
#pragma GCC unroll 8
    for (int j = 0; j < K; ++j) {
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) s[j][c] = _mm256_setzero_ps();
    }
    for (int64_t i = 0; i < nv; ++i) {  // only the last vector may be partial: its branch stays out of the loop
      __m256 k[K];
#pragma GCC unroll 8
      for (int j = 0; j < K; ++j) k[j] = i < nv - 1 ? load8(key[j] + 8 * i) : load8(key[j] + 8 * i, head_dim - 8 * i);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        const __m256 q = _mm256_loadu_ps(q0 + c * dp + 8 * i);
#pragma GCC unroll 8
        for (int j = 0; j < K; ++j) s[j][c] = _mm256_fmadd_ps(q, k[j], s[j][c]);
      }
    }
#pragma GCC unroll 8
    for (int j = 0; j < K; ++j) {
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) _mm256_storeu_ps(partial + (c * 8 + (n + j) % 8) * 8, s[j][c]);
    }
    const int64_t last = n + K - 1;  // steps of 2 start at even n: a group of 8 never ends mid-step
    if (last % 8 == 7 || last == nb - 1) {  // lanes past nb hold stale sums: scores past nb are never read
      const int64_t first = last - last % 8;
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) _mm256_storeu_ps(scores + c * kDecodeBlock + first, reduce8(partial + c * 64));
    }
  };
  int64_t n = 0;
  for (; n + kKeys <= nb; n += kKeys) step(std::integral_constant<int, kKeys>{}, n);
  if (n < nb) step(std::integral_constant<int, 1>{}, n);
}

// Scores of keys [n0, n0 + nb) for every query head [Hq, kDecodeBlock], kScoreHeads heads of a KV head per pass.
template <typename KV>
void decode_scores(const PagedKV<KV>& kv, const int64_t* slots, int64_t n0, int64_t nb, int64_t end,
                   const float* qf, int64_t num_heads, int64_t group, int64_t head_dim, float* partial,
                   float* scores, int64_t warm, Trickle<KV>& trickle) {
  const int64_t dp = (head_dim + 7) / 8 * 8, kv_heads = num_heads / group;
  const int64_t row_bytes = kv_heads * kv.head_stride * int64_t(sizeof(KV));
  for (int64_t h = 0; h < kv_heads; ++h) {
    for (int64_t c0 = 0; c0 < group; c0 += kScoreHeads) {
      const int64_t hq0 = h * group + c0;
      const bool first = h == 0 && c0 == 0;
      auto pass = [&](auto heads) {
        score_pass<KV, decltype(heads)::value>(kv, slots, n0, nb, end, h, qf + hq0 * dp, head_dim, first, row_bytes,
                                               partial + hq0 * 64, scores + hq0 * kDecodeBlock, warm, trickle);
      };
      switch (std::min<int64_t>(kScoreHeads, group - c0)) {
        case 1: pass(std::integral_constant<int, 1>{}); break;
        case 2: pass(std::integral_constant<int, 2>{}); break;
        case 3: pass(std::integral_constant<int, 3>{}); break;
        case 4: pass(std::integral_constant<int, 4>{}); break;
        case 5: pass(std::integral_constant<int, 5>{}); break;
        case 6: pass(std::integral_constant<int, 6>{}); break;
        case 7: pass(std::integral_constant<int, 7>{}); break;
        default: pass(std::integral_constant<int, 8>{}); break;
      }
    }
  }
}

// acc [C heads, W vectors from i0] += p . V rows of the block, the accumulators in registers across the block and
// each value vector converted once for the C heads. kTail: the last of the W vectors ends past head_dim.
template <typename KV, int C, int W, bool kTail>
void values_pass_loop(const PagedKV<KV>& kv, const int64_t* rows, int64_t nb, int64_t h, int64_t i0,
                      int64_t head_dim, const float* p, float* acc, int64_t dp, Trickle<KV>& trickle) {
  __m256 a[C][W];
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c) {
    #pragma GCC unroll 8
    for (int w = 0; w < W; ++w) a[c][w] = _mm256_loadu_ps(acc + c * dp + 8 * (i0 + w));
  }
  for (int64_t n = 0; n < nb; ++n) {
    const KV* v = kv.v + rows[n] * kv.row_stride + h * kv.head_stride + 8 * i0;
    trickle.step();
    __m256 x[W];
    #pragma GCC unroll 8
    for (int w = 0; w < W; ++w) {
      x[w] = kTail && w == W - 1 ? load8(v + 8 * w, head_dim - 8 * (i0 + w)) : load8(v + 8 * w);
    }
    #pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m256 pb = _mm256_broadcast_ss(p + c * kDecodeBlock + n);
      #pragma GCC unroll 8
      for (int w = 0; w < W; ++w) a[c][w] = _mm256_fmadd_ps(pb, x[w], a[c][w]);
    }
  }
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c) {
    #pragma GCC unroll 8
    for (int w = 0; w < W; ++w) _mm256_storeu_ps(acc + c * dp + 8 * (i0 + w), a[c][w]);
  }
}

template <typename KV, int C, int W>
void values_pass(const PagedKV<KV>& kv, const int64_t* rows, int64_t nb, int64_t h, int64_t i0, int64_t head_dim,
                 const float* p, float* acc, int64_t dp, Trickle<KV>& trickle) {
  if (head_dim >= 8 * (i0 + W)) {
    values_pass_loop<KV, C, W, false>(kv, rows, nb, h, i0, head_dim, p, acc, dp, trickle);
  } else {
    values_pass_loop<KV, C, W, true>(kv, rows, nb, h, i0, head_dim, p, acc, dp, trickle);
  }
}

// The C heads' P.V over the whole head dim: 2 vectors per pass for 3-4 heads, 4 for 1-2 (8 accumulators either way).
template <typename KV, int C>
void values_heads(const PagedKV<KV>& kv, const int64_t* rows, int64_t nb, int64_t h, int64_t head_dim,
                  const float* p, float* acc, Trickle<KV>& t) {
  constexpr int kW = C >= 3 ? 2 : 4;
  const int64_t nv = (head_dim + 7) / 8, dp = nv * 8;
  int64_t i0 = 0;
  for (; i0 + kW <= nv; i0 += kW) values_pass<KV, C, kW>(kv, rows, nb, h, i0, head_dim, p, acc, dp, t);
  switch (nv - i0) {
    case 3: if constexpr (kW > 3) values_pass<KV, C, 3>(kv, rows, nb, h, i0, head_dim, p, acc, dp, t); break;
    case 2: if constexpr (kW > 2) values_pass<KV, C, 2>(kv, rows, nb, h, i0, head_dim, p, acc, dp, t); break;
    case 1: values_pass<KV, C, 1>(kv, rows, nb, h, i0, head_dim, p, acc, dp, t); break;
    default: break;
  }
}

// acc [Hq, dp] += p [Hq, nb] . V rows of the block, up to 4 query heads of a KV head per pass.
template <typename KV>
void decode_values(const PagedKV<KV>& kv, const int64_t* slots, int64_t n0, int64_t nb, const float* p,
                   int64_t num_heads, int64_t group, int64_t head_dim, float* acc, Trickle<KV>& t) {
  const int64_t dp = (head_dim + 7) / 8 * 8, kv_heads = num_heads / group;
  for (int64_t h = 0; h < kv_heads; ++h) {
    for (int64_t c0 = 0; c0 < group; c0 += 4) {
      const int64_t hq0 = h * group + c0;
      const float* ph = p + hq0 * kDecodeBlock;
      float* ah = acc + hq0 * dp;
      switch (std::min<int64_t>(4, group - c0)) {
        case 1: values_heads<KV, 1>(kv, slots + n0, nb, h, head_dim, ph, ah, t); break;
        case 2: values_heads<KV, 2>(kv, slots + n0, nb, h, head_dim, ph, ah, t); break;
        case 3: values_heads<KV, 3>(kv, slots + n0, nb, h, head_dim, ph, ah, t); break;
        default: values_heads<KV, 4>(kv, slots + n0, nb, h, head_dim, ph, ah, t); break;
      }
    }
  }
}

// ---- extend -------------------------------------------------------------------------------------------------------

// Transposes 8 rows of 8 floats in registers (column c of the input becomes r[c]).
inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {  // u[4i+k], 128-bit half L: column 4L+k of rows 4i..4i+3
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int k = 0; k < 4; ++k) {
    r[k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x20);
    r[4 + k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x31);
  }
}

// One block of nb <= kBlock keys of KV head `head` in fp32: keys_t [head_dim, kBlock] (transposed, zero past nb)
// for the score tiles, values [kBlock, dp] for the P.V tiles.
template <typename KV>
void load_block(const PagedKV<KV>& kv, const int64_t* slots, int64_t nb, int64_t head, int64_t head_dim,
                float* keys_t, float* values) {
  const int64_t nv = (head_dim + 7) / 8, dp = nv * 8;
  for (int64_t n8 = 0; n8 < kBlock; n8 += 8) {
    for (int64_t c = 0; c < nv; ++c) {
      __m256 r[8];
      for (int64_t i = 0; i < 8; ++i) {
        r[i] = n8 + i < nb ? load8(kv.k + slots[n8 + i] * kv.row_stride + head * kv.head_stride + 8 * c, head_dim - 8 * c)
                           : _mm256_setzero_ps();
      }
      transpose8(r);
      for (int64_t k = 0; k < 8 && 8 * c + k < head_dim; ++k) _mm256_storeu_ps(keys_t + (8 * c + k) * kBlock + n8, r[k]);
    }
  }
  for (int64_t n = 0; n < nb; ++n) {
    const KV* row = kv.v + slots[n] * kv.row_stride + head * kv.head_stride;
    for (int64_t c = 0; c < nv; ++c) _mm256_storeu_ps(values + n * dp + 8 * c, load8(row + 8 * c, head_dim - 8 * c));
  }
}

// s [kTile, 8 * W keys] = q [kTile, dp] . keys_t [head_dim, 8 * W keys]: 4 x W accumulators, W key loads and 4
// broadcasts per dimension.
template <int W>
void score_tile(const float* q, int64_t q_stride, const float* keys_t, int64_t head_dim, float* s) {
  __m256 c[kTile][W];
  for (auto& row : c) for (auto& v : row) v = _mm256_setzero_ps();
  for (int64_t d = 0; d < head_dim; ++d) {
    __m256 k[W];
    #pragma GCC unroll 8
    for (int j = 0; j < W; ++j) k[j] = _mm256_loadu_ps(keys_t + d * kBlock + 8 * j);
    #pragma GCC unroll 8
    for (int r = 0; r < kTile; ++r) {
      const __m256 qb = _mm256_broadcast_ss(q + r * q_stride + d);
      #pragma GCC unroll 8
      for (int j = 0; j < W; ++j) c[r][j] = _mm256_fmadd_ps(qb, k[j], c[r][j]);
    }
  }
  #pragma GCC unroll 8
  for (int r = 0; r < kTile; ++r) for (int j = 0; j < W; ++j) _mm256_storeu_ps(s + r * kBlock + 8 * j, c[r][j]);
}

// The tile's scores for its first `keys` keys, 24 at a time (12 accumulators), then what is left.
inline void score_tile_upto(int64_t keys, const float* q, int64_t q_stride, const float* keys_t, int64_t head_dim,
                            float* s) {
  int64_t j = 0;
  for (; j + 24 <= keys; j += 24) score_tile<3>(q, q_stride, keys_t + j, head_dim, s + j);
  switch ((keys - j + 7) / 8) {  // 0 .. 3
    case 3: score_tile<3>(q, q_stride, keys_t + j, head_dim, s + j); break;
    case 2: score_tile<2>(q, q_stride, keys_t + j, head_dim, s + j); break;
    case 1: score_tile<1>(q, q_stride, keys_t + j, head_dim, s + j); break;
    default: break;
  }
}

// acc [kTile, W vectors] += p [kTile, n] . values [n, W vectors] (columns of a wider row, strides in floats).
template <int W>
void pv_chunk(const float* p, int64_t n, const float* values, int64_t v_stride, float* acc, int64_t a_stride) {
  __m256 c[kTile][W];
  #pragma GCC unroll 8
  for (int r = 0; r < kTile; ++r) for (int w = 0; w < W; ++w) c[r][w] = _mm256_loadu_ps(acc + r * a_stride + 8 * w);
  for (int64_t i = 0; i < n; ++i) {
    __m256 v[W];
    #pragma GCC unroll 8
    for (int w = 0; w < W; ++w) v[w] = _mm256_loadu_ps(values + i * v_stride + 8 * w);
    #pragma GCC unroll 8
    for (int r = 0; r < kTile; ++r) {
      const __m256 pb = _mm256_broadcast_ss(p + r * kBlock + i);
      #pragma GCC unroll 8
      for (int w = 0; w < W; ++w) c[r][w] = _mm256_fmadd_ps(pb, v[w], c[r][w]);
    }
  }
  #pragma GCC unroll 8
  for (int r = 0; r < kTile; ++r) for (int w = 0; w < W; ++w) _mm256_storeu_ps(acc + r * a_stride + 8 * w, c[r][w]);
}

inline void pv_tile(const float* p, int64_t n, const float* values, int64_t nv, float* acc) {
  const int64_t dp = nv * 8;
  int64_t c = 0;
  for (; c + 3 <= nv; c += 3) pv_chunk<3>(p, n, values + 8 * c, dp, acc + 8 * c, dp);
  switch (nv - c) {
    case 2: pv_chunk<2>(p, n, values + 8 * c, dp, acc + 8 * c, dp); break;
    case 1: pv_chunk<1>(p, n, values + 8 * c, dp, acc + 8 * c, dp); break;
    default: break;
  }
}

}  // namespace

template <typename T, typename KV>
int64_t decode_split(const PagedKV<KV>& kv, const int64_t* slots, int64_t start, int64_t end, QueryView<T> q,
                     float sm_scale, int64_t num_heads, int64_t group, int64_t head_dim, float* scratch, Partial out,
                     int64_t warm, NextKeys after) {
  const int64_t nv = (head_dim + 7) / 8, dp = nv * 8;
  float* qf = scratch;                          // [Hq, dp], scaled, zero past head_dim
  float* acc = qf + num_heads * dp;             // [Hq, dp]
  float* scores = acc + num_heads * dp;         // [Hq, kDecodeBlock]
  float* partial = scores + num_heads * kDecodeBlock;  // [Hq, 8, 8]
  const __m256 scale = _mm256_set1_ps(sm_scale);
  for (int64_t hq = 0; hq < num_heads; ++hq) {
    for (int64_t i = 0; i < nv; ++i) {
      _mm256_storeu_ps(qf + hq * dp + 8 * i, _mm256_mul_ps(load8(q.q + hq * q.head_stride + 8 * i, head_dim - 8 * i), scale));
    }
  }
  std::fill(acc, acc + num_heads * dp, 0.f);
  std::fill(out.m, out.m + num_heads, kNegInf);
  std::fill(out.l, out.l + num_heads, 0.f);
  Trickle<KV> trickle;
  for (int64_t n0 = start; n0 < end; n0 += kDecodeBlock) {
    const int64_t nb = std::min(kDecodeBlock, end - n0);
    trickle_next(trickle, kv, num_heads / group, head_dim, slots, n0 + nb, end, after, nb);
    decode_scores(kv, slots, n0, nb, end, qf, num_heads, group, head_dim, partial, scores, warm, trickle);
    for (int64_t hq = 0; hq < num_heads; ++hq) {
      softmax_step(scores + hq * kDecodeBlock, nb, out.m[hq], out.l[hq], acc + hq * dp, nv);
    }
    decode_values(kv, slots, n0, nb, scores, num_heads, group, head_dim, acc, trickle);
    trickle.finish();
    warm = trickle.rows();
  }
  for (int64_t hq = 0; hq < num_heads; ++hq) std::memcpy(out.acc + hq * head_dim, acc + hq * dp, head_dim * 4);
  return start < end ? warm : 0;  // an empty split trickled nothing for the next
}

// Rows r = j * group + g (token j, head g); token j sits at first_pos + j and sees keys [0, first_pos + j]. Rows are
// padded to whole tiles; a pad row repeats the last real row's visibility and is never written out.
template <typename T, typename KV>
void extend_item(const PagedKV<KV>& kv, const int64_t* slots, int64_t head, int64_t first_pos, int64_t tokens,
                 QueryView<T> q, float sm_scale, float v_scale, int64_t group, int64_t head_dim, T* out,
                 int64_t out_row_stride, float* scratch) {
  const int64_t nv = (head_dim + 7) / 8, dp = nv * 8;
  const int64_t rows = tokens * group, rows_p = round_up(rows, kTile);
  float* qf = scratch;                   // [rows_p, dp]
  float* acc = qf + rows_p * dp;         // [rows_p, dp]
  float* scores = acc + rows_p * dp;     // [rows_p, kBlock]
  float* m = scores + rows_p * kBlock;   // [rows_p]
  float* l = m + rows_p;                 // [rows_p]
  float* keys_t = l + rows_p;            // [dp, kBlock]
  float* values = keys_t + dp * kBlock;  // [kBlock, dp]
  const __m256 scale = _mm256_set1_ps(sm_scale);
  std::fill(qf, qf + rows_p * dp, 0.f);
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = q.q + (r / group) * q.row_stride + (r % group) * q.head_stride;
    for (int64_t c = 0; c < nv; ++c) {
      _mm256_storeu_ps(qf + r * dp + 8 * c, _mm256_mul_ps(load8(src + 8 * c, head_dim - 8 * c), scale));
    }
  }
  std::fill(acc, acc + rows_p * dp, 0.f);
  std::fill(m, m + rows_p, kNegInf);
  std::fill(l, l + rows_p, 0.f);
  const int64_t kv_end = first_pos + tokens;
  for (int64_t n0 = 0; n0 < kv_end; n0 += kBlock) {
    const int64_t nb = std::min(kBlock, kv_end - n0);
    load_block(kv, slots + n0, nb, head, head_dim, keys_t, values);
    auto visible = [&](int64_t r) { return std::min(nb, first_pos + std::min(r, rows - 1) / group + 1 - n0); };
    for (int64_t r0 = 0; r0 < rows_p; r0 += kTile) {
      const int64_t tile_visible = visible(r0 + kTile - 1);  // rows see more keys as r grows
      if (tile_visible <= 0) continue;
      float* s = scores + r0 * kBlock;
      score_tile_upto(tile_visible, qf + r0 * dp, dp, keys_t, head_dim, s);
      for (int64_t r = r0; r < r0 + kTile; ++r) {
        const int64_t vis = std::max<int64_t>(0, visible(r));
        if (vis > 0) softmax_step(scores + r * kBlock, vis, m[r], l[r], acc + r * dp, nv);
        std::fill(scores + r * kBlock + vis, scores + r * kBlock + tile_visible, 0.f);  // masked: no weight
      }
      pv_tile(s, tile_visible, values, nv, acc + r0 * dp);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m256 inv = _mm256_set1_ps(v_scale / l[r]);  // key 0 is visible to every row, so l > 0
    T* dst = out + (r / group) * out_row_stride + (r % group) * head_dim;
    for (int64_t c = 0; c < nv; ++c) store8(dst + 8 * c, head_dim - 8 * c, _mm256_mul_ps(inv, _mm256_loadu_ps(acc + r * dp + 8 * c)));
  }
}

#define TANDEM_INSTANTIATE_KV(T, KV)                                                                                  \
  template int64_t decode_split<T, KV>(const PagedKV<KV>&, const int64_t*, int64_t, int64_t, QueryView<T>, float,     \
                                       int64_t, int64_t, int64_t, float*, Partial, int64_t, NextKeys);               \
  template void extend_item<T, KV>(const PagedKV<KV>&, const int64_t*, int64_t, int64_t, int64_t, QueryView<T>,      \
                                   float, float, int64_t, int64_t, T*, int64_t, float*);
#define TANDEM_INSTANTIATE(T)                  \
  TANDEM_INSTANTIATE_KV(T, T)                  \
  TANDEM_INSTANTIATE_KV(T, c10::Float8_e4m3fn) \
  TANDEM_INSTANTIATE_KV(T, c10::Float8_e5m2)
TANDEM_INSTANTIATE(float)
TANDEM_INSTANTIATE_KV(float, c10::BFloat16)  // --kv-cache-dtype bfloat16/float16 under a float32 model
TANDEM_INSTANTIATE_KV(float, c10::Half)
TANDEM_INSTANTIATE(c10::BFloat16)
TANDEM_INSTANTIATE(c10::Half)
#undef TANDEM_INSTANTIATE
#undef TANDEM_INSTANTIATE_KV

}  // namespace avx2
}  // namespace tandem_cpu

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace tandem_cpu {

bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

}  // namespace tandem_cpu

#else  // not x86-64 GCC/Clang: paged_attention.cpp never calls the AVX2 kernels

namespace tandem_cpu {
bool cpu_has_avx2() { return false; }
}  // namespace tandem_cpu

#endif

namespace tandem_cpu {
namespace avx2 {

// The sizes match the layouts at the top of decode_split (block 128, 8 x 8 partials) and extend_item (block 64,
// tiles of 4).
int64_t decode_scratch(int64_t num_heads, int64_t head_dim) {
  const int64_t dp = (head_dim + 7) / 8 * 8;
  return num_heads * (2 * dp + 128 + 64);
}

int64_t extend_scratch(int64_t tokens, int64_t group, int64_t head_dim) {
  const int64_t dp = (head_dim + 7) / 8 * 8, rows = (tokens * group + 3) / 4 * 4;
  return rows * (2 * dp + 64 + 2) + 2 * dp * 64;
}

}  // namespace avx2
}  // namespace tandem_cpu
