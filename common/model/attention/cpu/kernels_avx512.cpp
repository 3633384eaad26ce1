// AVX-512 kernels of the `cpu` attention backend (declared in kernels.h, chosen at run time by paged_attention.cpp).
//
// This CPU family may lack avx512_bf16 and AMX, so bf16 is widened by zero-extending to 32 bits and shifting left 16
// (exact), fp16 by vcvtph2ps, FP8 through fp16 (e5m2 is fp16's top byte; e4m3fn's bits move into fp16's fields and
// 2^8 fixes the exponent bias, subnormals included), and all products accumulate in fp32 FMAs. The code is compiled under a target pragma
// (no -mavx512f for the whole library), so the library loads anywhere and these functions only run where
// cpu_has_avx512() says so. Only headers are included before the pragma: any inline code of theirs stays portable.

#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#if TANDEM_X86_KERNELS
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
#endif

namespace tandem_cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kDecodeBlock = 128;  // keys scored per online-softmax step in decode
constexpr int64_t kBlock = 64;         // keys per extend step: 4 vectors of scores per row
constexpr int64_t kTile = 4;           // extend rows per register tile

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
inline __mmask16 tail_mask(int64_t remaining) {
  return remaining >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << remaining) - 1);
}

inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {  // bf16 is fp32's top half: widen, shift, done
  const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p, __mmask16 m) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)); }
inline __m512 load16(const c10::Float8_e5m2* p, __mmask16 m) {
  const __m256i bytes = _mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(m, p));
  return _mm512_cvtph_ps(_mm256_slli_epi16(bytes, 8));
}
// e4m3fn s eeee mmm -> fp16 s 0eeee mmm0000000, times 2^8. Sign-extended to 16 bits and shifted left 7, the byte
// lands as s s eeee mmm0000000: clearing bit 14 leaves the fp16 bits. Never NaN here: the pool clamps its writes.
inline __m512 load16(const c10::Float8_e4m3fn* p, __mmask16 m) {
  const __m256i shifted = _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_maskz_loadu_epi8(m, p)), 7);
  const __m256i half = _mm256_and_si256(shifted, _mm256_set1_epi16(static_cast<int16_t>(0xBFFF)));
  return _mm512_mul_ps(_mm512_cvtph_ps(half), _mm512_set1_ps(256.f));
}

inline void store16(float* p, __mmask16 m, __m512 v) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(c10::BFloat16* p, __mmask16 m, __m512 v) {  // round to nearest even, NaN stays NaN (as c10)
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  rounded = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), rounded, _mm512_set1_epi32(0x7FC0));
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(rounded));
}
inline void store16(c10::Half* p, __mmask16 m, __m512 v) {
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// exp(x) for x <= 0: x = n ln2 + r, exp(r) by Cephes' polynomial (about 1 ulp), times 2^n by vscalefps.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// One online-softmax step of a row: scores s[0, n) become probabilities; the running max m, denominator l and the
// accumulator acc [nv vectors] are rescaled when the max moves.
inline void softmax_step(float* s, int64_t n, float& m, float& l, float* acc, int nv) {
  __m512 vmax = _mm512_set1_ps(kNegInf);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = tail_mask(n - i);
    vmax = _mm512_mask_max_ps(vmax, mask, vmax, _mm512_maskz_loadu_ps(mask, s + i));
  }
  const float m_new = std::max(m, _mm512_reduce_max_ps(vmax));
  if (m != m_new) {
    const float alpha = m == kNegInf ? 0.f : std::exp(m - m_new);
    l *= alpha;
    const __m512 a = _mm512_set1_ps(alpha);
    for (int i = 0; i < nv; ++i) _mm512_storeu_ps(acc + 16 * i, _mm512_mul_ps(a, _mm512_loadu_ps(acc + 16 * i)));
    m = m_new;
  }
  const __m512 vm = _mm512_set1_ps(m_new);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = tail_mask(n - i);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + i), vm));
    _mm512_mask_storeu_ps(s + i, mask, e);
    sum = _mm512_mask_add_ps(sum, mask, sum, e);
  }
  l += _mm512_reduce_add_ps(sum);
}

template <int kLocality>  // 3: into L1 (T0), 2: into L2 (T1)
inline void prefetch_row(const void* row, int64_t bytes) {
  const char* p = static_cast<const char*>(row);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, kLocality);
}

// ---- decode -------------------------------------------------------------------------------------------------------

// The NV vectors of one head's row, in the kernel's lane order. Paired (bf16, head dim a multiple of 32): each
// 512-bit load holds 32 values; the even positions (shifted up 16) form one vector and the odd ones (low half
// cleared) the next, two cheap ALU ops per 32 values and no cross-lane shuffle. A dot product does not care about
// lane order as long as q is loaded the same way; the P.V accumulator is put back in order once at the end.
template <typename T, int NV, bool kPaired>
inline void load_head(const T* p, __mmask16 last, __m512* out) {
  if constexpr (kPaired) {
    for (int j = 0; j < NV / 2; ++j) {
      const __m512i x = _mm512_loadu_si512(p + 32 * j);
      out[2 * j] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
      out[2 * j + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
    }
  } else {
    for (int i = 0; i < NV; ++i) out[i] = load16(p + 16 * i, i == NV - 1 ? last : __mmask16(0xFFFF));
  }
}

// Lane i of the result is the sum of the 16 lanes of v[i] (v: 16 x 16 floats): a transpose-and-add tree, about
// two shuffles per sum where a horizontal reduction per vector takes four.
inline __m512 reduce16(const float* v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i) {  // w[i], 128-bit lane L: [a0+a2, b0+b2, a1+a3, b1+b3] of rows 2i, 2i+1
    const __m512 a = _mm512_loadu_ps(v + 32 * i), b = _mm512_loadu_ps(v + 32 * i + 16);
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  for (int i = 0; i < 4; ++i) {  // x[i], lane L, element k: the sum of lane L of row 4i+k
    const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
    x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 y0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x44), _mm512_shuffle_f32x4(x[0], x[1], 0xEE));
  const __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x44), _mm512_shuffle_f32x4(x[2], x[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, 0x88), _mm512_shuffle_f32x4(y0, y1, 0xDD));
}

// Query heads of one KV head whose q (or P.V accumulator) vectors stay in registers at once: kChunk * NV <= 16 of
// the 32 zmm registers, the rest for the key/value vectors and partial sums.
template <int NV>
constexpr int chunk_heads() {
  return NV >= 16 ? 1 : (16 / NV > 8 ? 8 : 16 / NV);
}

// Scores of keys [n0, n0 + nb) for every query head. Per KV head and chunk of its query heads, q sits in registers
// while the block's keys stream past: one load of each key vector serves the chunk, one FMA chain per (key, head)
// into partial [Hq, 16, 16], then 16 keys' sums at once. The block's first `warm` rows were trickled into L2 while
// the previous block computed; past them the first KV head's pass reads whole pool rows (prefetched kAhead ahead
// into L2, the V rows too for the P.V pass). Later heads find the block's rows in L2. Every key step trickles a
// slice of the rows after the block.
template <typename KV, int NV, bool kPaired>
void decode_scores(const PagedKV<KV>& kv, const int64_t* slots, int64_t n0, int64_t nb, int64_t end,
                   const float* qf, int64_t num_heads, int64_t group, __mmask16 last, float* partial,
                   float* scores, int64_t warm, Trickle<KV>& trickle) {
  constexpr int64_t kDp = NV * 16;
  constexpr int kC = chunk_heads<NV>();
  constexpr int64_t kAhead = 16;
  const int64_t kv_heads = num_heads / group, row_bytes = kv_heads * kv.head_stride * int64_t(sizeof(KV));
  const int64_t head_bytes = kDp * int64_t(sizeof(KV));
  for (int64_t h = 0; h < kv_heads; ++h) {
    for (int64_t c0 = 0; c0 < group; c0 += kC) {
      const int64_t count = std::min<int64_t>(kC, group - c0), hq0 = h * group + c0;
      // Every loop over the chunk's heads runs to kC, unrolled, with the count as a guard: the arrays then live in
      // registers (a loop bounded by `count` itself made GCC keep them on the stack, a store and a load per FMA).
      __m512 qv[kC][NV];
#pragma GCC unroll 16
      for (int c = 0; c < kC; ++c) {
#pragma GCC unroll 16
        for (int i = 0; i < NV; ++i) qv[c][i] = c < count ? _mm512_loadu_ps(qf + (hq0 + c) * kDp + 16 * i) : _mm512_setzero_ps();
      }
      const bool first_pass = h == 0 && c0 == 0;
      for (int64_t n = 0; n < nb; ++n) {
        if (n0 + n + kAhead < end) {
          const int64_t ahead = slots[n0 + n + kAhead] * kv.row_stride;
          if (first_pass && n + kAhead >= warm) {
            prefetch_row<2>(kv.k + ahead, row_bytes);
            prefetch_row<2>(kv.v + ahead, row_bytes);
          }
          prefetch_row<3>(kv.k + ahead + h * kv.head_stride, head_bytes);
        }
        trickle.step();
        __m512 key[NV];
        load_head<KV, NV, kPaired>(kv.k + slots[n0 + n] * kv.row_stride + h * kv.head_stride, last, key);
#pragma GCC unroll 16
        for (int c = 0; c < kC; ++c) {
          if (c >= count) break;
          __m512 s = _mm512_mul_ps(qv[c][0], key[0]);
#pragma GCC unroll 16
          for (int i = 1; i < NV; ++i) s = _mm512_fmadd_ps(qv[c][i], key[i], s);
          _mm512_storeu_ps(partial + ((hq0 + c) * 16 + n % 16) * 16, s);
        }
        if (n % 16 == 15 || n == nb - 1) {
          const int64_t first = n - n % 16;
          for (int64_t c = 0; c < count; ++c) {
            _mm512_mask_storeu_ps(scores + (hq0 + c) * kDecodeBlock + first, tail_mask(n + 1 - first),
                                  reduce16(partial + (hq0 + c) * 256));
          }
        }
      }
    }
  }
}

// acc [Hq, Dp] += p [Hq, nb] . V rows of the block: per KV head and chunk of its query heads the accumulators stay
// in registers across the block, each value vector loaded once for the chunk (the rows are in L2 by now).
template <typename KV, int NV, bool kPaired>
void decode_values(const PagedKV<KV>& kv, const int64_t* slots, int64_t n0, int64_t nb, const float* scores,
                   int64_t num_heads, int64_t group, __mmask16 last, float* acc, Trickle<KV>& trickle) {
  constexpr int64_t kDp = NV * 16;
  constexpr int kC = chunk_heads<NV>();
  const int64_t kv_heads = num_heads / group, head_bytes = kDp * int64_t(sizeof(KV));
  for (int64_t h = 0; h < kv_heads; ++h) {
    for (int64_t c0 = 0; c0 < group; c0 += kC) {
      const int64_t count = std::min<int64_t>(kC, group - c0), hq0 = h * group + c0;
      __m512 av[kC][NV];  // as in decode_scores: loops to kC, unrolled, guarded by the count
#pragma GCC unroll 16
      for (int c = 0; c < kC; ++c) {
#pragma GCC unroll 16
        for (int i = 0; i < NV; ++i) av[c][i] = c < count ? _mm512_loadu_ps(acc + (hq0 + c) * kDp + 16 * i) : _mm512_setzero_ps();
      }
      for (int64_t n = 0; n < nb; ++n) {
        if (n + 8 < nb) prefetch_row<3>(kv.v + slots[n0 + n + 8] * kv.row_stride + h * kv.head_stride, head_bytes);
        trickle.step();
        __m512 value[NV];
        load_head<KV, NV, kPaired>(kv.v + slots[n0 + n] * kv.row_stride + h * kv.head_stride, last, value);
#pragma GCC unroll 16
        for (int c = 0; c < kC; ++c) {
          if (c >= count) break;
          const __m512 p = _mm512_set1_ps(scores[(hq0 + c) * kDecodeBlock + n]);
#pragma GCC unroll 16
          for (int i = 0; i < NV; ++i) av[c][i] = _mm512_fmadd_ps(p, value[i], av[c][i]);
        }
      }
#pragma GCC unroll 16
      for (int c = 0; c < kC; ++c) {
        if (c >= count) break;
#pragma GCC unroll 16
        for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc + (hq0 + c) * kDp + 16 * i, av[c][i]);
      }
    }
  }
}

template <typename T, typename KV, int NV, bool kPaired>
int64_t decode_split_nv(const PagedKV<KV>& kv, const int64_t* slots, int64_t start, int64_t end, QueryView<T> q,
                        float sm_scale, int64_t num_heads, int64_t group, int64_t head_dim, float* scratch,
                        Partial out, int64_t warm, NextKeys after) {
  constexpr int64_t kDp = NV * 16;
  const __mmask16 last = tail_mask(head_dim - (NV - 1) * 16);
  float* qf = scratch;                           // [Hq, Dp], scaled, zero past head_dim, in load_head's order
  float* acc = qf + num_heads * kDp;             // [Hq, Dp], in load_head's order
  float* scores = acc + num_heads * kDp;         // [Hq, kDecodeBlock]
  float* partial = scores + num_heads * kDecodeBlock;  // [Hq, 16, 16]
  const __m512 scale = _mm512_set1_ps(sm_scale);
  for (int64_t hq = 0; hq < num_heads; ++hq) {
    __m512 x[NV];
    load_head<T, NV, kPaired>(q.q + hq * q.head_stride, last, x);
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(qf + hq * kDp + 16 * i, _mm512_mul_ps(x[i], scale));
  }
  std::fill(acc, acc + num_heads * kDp, 0.f);
  std::fill(out.m, out.m + num_heads, kNegInf);
  std::fill(out.l, out.l + num_heads, 0.f);
  Trickle<KV> trickle;
  for (int64_t n0 = start; n0 < end; n0 += kDecodeBlock) {
    const int64_t nb = std::min(kDecodeBlock, end - n0);
    trickle_next(trickle, kv, num_heads / group, head_dim, slots, n0 + nb, end, after, nb);
    decode_scores<KV, NV, kPaired>(kv, slots, n0, nb, end, qf, num_heads, group, last, partial, scores, warm,
                                   trickle);
    for (int64_t hq = 0; hq < num_heads; ++hq) {
      softmax_step(scores + hq * kDecodeBlock, nb, out.m[hq], out.l[hq], acc + hq * kDp, NV);
    }
    decode_values<KV, NV, kPaired>(kv, slots, n0, nb, scores, num_heads, group, last, acc, trickle);
    trickle.finish();
    warm = trickle.rows();
  }
  for (int64_t hq = 0; hq < num_heads; ++hq) {
    float* a = acc + hq * kDp;
    if constexpr (kPaired) {  // interleave each (even, odd) pair back into positions 32j .. 32j + 31
      const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
      const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
      for (int j = 0; j < NV / 2; ++j) {
        const __m512 even = _mm512_loadu_ps(a + 32 * j), odd = _mm512_loadu_ps(a + 32 * j + 16);
        _mm512_storeu_ps(out.acc + hq * head_dim + 32 * j, _mm512_permutex2var_ps(even, lo, odd));
        _mm512_storeu_ps(out.acc + hq * head_dim + 32 * j + 16, _mm512_permutex2var_ps(even, hi, odd));
      }
    } else {
      std::memcpy(out.acc + hq * head_dim, a, head_dim * 4);
    }
  }
  return start < end ? warm : 0;  // an empty split trickled nothing for the next
}

// ---- extend -------------------------------------------------------------------------------------------------------

// Transposes 16 rows of 16 floats in registers (column c of the input becomes r[c]).
inline void transpose16(__m512 r[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i+k], 128-bit lane L: column 4L+k of rows 4i..4i+3
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int k = 0; k < 4; ++k) {  // a 4 x 4 transpose of 128-bit lanes
    const __m512 v0 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0x44), v1 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0xEE);
    const __m512 v2 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0x44);
    const __m512 v3 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0xEE);
    r[k] = _mm512_shuffle_f32x4(v0, v2, 0x88);
    r[4 + k] = _mm512_shuffle_f32x4(v0, v2, 0xDD);
    r[8 + k] = _mm512_shuffle_f32x4(v1, v3, 0x88);
    r[12 + k] = _mm512_shuffle_f32x4(v1, v3, 0xDD);
  }
}

// One block of nb <= kBlock keys of KV head `head` in fp32: keys_t [head_dim, kBlock] (transposed, zero past nb)
// for the score tile, values [kBlock, Dp] for the P.V tile.
template <typename KV, int NV>
void load_block(const PagedKV<KV>& kv, const int64_t* slots, int64_t nb, int64_t head, int64_t head_dim,
                float* keys_t, float* values) {
  constexpr int64_t kDp = NV * 16;
  for (int64_t n16 = 0; n16 < kBlock; n16 += 16) {
    for (int c = 0; c < NV; ++c) {
      const __mmask16 mask = tail_mask(head_dim - 16 * c);
      __m512 r[16];
      for (int64_t i = 0; i < 16; ++i) {
        r[i] = n16 + i < nb ? load16(kv.k + slots[n16 + i] * kv.row_stride + head * kv.head_stride + 16 * c, mask)
                            : _mm512_setzero_ps();
      }
      transpose16(r);
      for (int64_t k = 0; k < 16 && 16 * c + k < head_dim; ++k) _mm512_storeu_ps(keys_t + (16 * c + k) * kBlock + n16, r[k]);
    }
  }
  for (int64_t n = 0; n < nb; ++n) {
    const KV* row = kv.v + slots[n] * kv.row_stride + head * kv.head_stride;
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(values + n * kDp + 16 * c, load16(row + 16 * c, tail_mask(head_dim - 16 * c)));
  }
}

// s [kTile, 16 KV] = q [kTile, Dp] . keys_t [head_dim, 16 KV] (the first KV vectors of kBlock keys): up to 16
// accumulators, KV key loads and 4 broadcasts per dimension. A tile that sees only part of a block (the causal
// diagonal, a short last block) scores only the vectors it sees.
template <int KV>
void score_tile(const float* q, int64_t q_stride, const float* keys_t, int64_t head_dim, float* s) {
  __m512 c[kTile][KV];
  for (auto& row : c) for (auto& v : row) v = _mm512_setzero_ps();
  for (int64_t d = 0; d < head_dim; ++d) {
    __m512 k[KV];
    for (int j = 0; j < KV; ++j) k[j] = _mm512_loadu_ps(keys_t + d * kBlock + 16 * j);
    for (int r = 0; r < kTile; ++r) {
      const __m512 qb = _mm512_set1_ps(q[r * q_stride + d]);
      for (int j = 0; j < KV; ++j) c[r][j] = _mm512_fmadd_ps(qb, k[j], c[r][j]);
    }
  }
  for (int r = 0; r < kTile; ++r) for (int j = 0; j < KV; ++j) _mm512_storeu_ps(s + r * kBlock + 16 * j, c[r][j]);
}

inline void score_tile_upto(int64_t keys, const float* q, int64_t q_stride, const float* keys_t, int64_t head_dim,
                            float* s) {
  switch ((keys + 15) / 16) {
    case 1: score_tile<1>(q, q_stride, keys_t, head_dim, s); break;
    case 2: score_tile<2>(q, q_stride, keys_t, head_dim, s); break;
    case 3: score_tile<3>(q, q_stride, keys_t, head_dim, s); break;
    default: score_tile<4>(q, q_stride, keys_t, head_dim, s); break;
  }
}

// acc [kTile, W vectors] += p [kTile, n] . values [n, W vectors] (columns of a wider row, strides in floats).
template <int W>
void pv_chunk(const float* p, int64_t n, const float* values, int64_t v_stride, float* acc, int64_t a_stride) {
  __m512 c[kTile][W];
  for (int r = 0; r < kTile; ++r) for (int w = 0; w < W; ++w) c[r][w] = _mm512_loadu_ps(acc + r * a_stride + 16 * w);
  for (int64_t i = 0; i < n; ++i) {
    __m512 v[W];
    for (int w = 0; w < W; ++w) v[w] = _mm512_loadu_ps(values + i * v_stride + 16 * w);
    for (int r = 0; r < kTile; ++r) {
      const __m512 pb = _mm512_set1_ps(p[r * kBlock + i]);
      for (int w = 0; w < W; ++w) c[r][w] = _mm512_fmadd_ps(pb, v[w], c[r][w]);
    }
  }
  for (int r = 0; r < kTile; ++r) for (int w = 0; w < W; ++w) _mm512_storeu_ps(acc + r * a_stride + 16 * w, c[r][w]);
}

template <int NV>
void pv_tile(const float* p, int64_t n, const float* values, float* acc) {
  constexpr int64_t kDp = NV * 16;
  for (int c = 0; c < NV; c += 4) {
    const float* v = values + 16 * c;
    float* a = acc + 16 * c;
    switch (std::min(4, NV - c)) {
      case 4: pv_chunk<4>(p, n, v, kDp, a, kDp); break;
      case 3: pv_chunk<3>(p, n, v, kDp, a, kDp); break;
      case 2: pv_chunk<2>(p, n, v, kDp, a, kDp); break;
      default: pv_chunk<1>(p, n, v, kDp, a, kDp); break;
    }
  }
}

// Rows r = j * group + g (token j, head g); token j sits at first_pos + j and sees keys [0, first_pos + j]. Rows are
// padded to whole tiles; a pad row repeats the last real row's visibility and is never written out.
template <typename T, typename KV, int NV>
void extend_item_nv(const PagedKV<KV>& kv, const int64_t* slots, int64_t head, int64_t first_pos, int64_t tokens,
                    QueryView<T> q, float sm_scale, float v_scale, int64_t group, int64_t head_dim, T* out, int64_t out_row_stride,
                    float* scratch) {
  constexpr int64_t kDp = NV * 16;
  const int64_t rows = tokens * group, rows_p = round_up(rows, kTile);
  float* qf = scratch;                    // [rows_p, Dp]
  float* acc = qf + rows_p * kDp;         // [rows_p, Dp]
  float* scores = acc + rows_p * kDp;     // [rows_p, kBlock]
  float* m = scores + rows_p * kBlock;    // [rows_p]
  float* l = m + rows_p;                  // [rows_p]
  float* keys_t = l + rows_p;             // [Dp, kBlock]
  float* values = keys_t + kDp * kBlock;  // [kBlock, Dp]
  const __m512 scale = _mm512_set1_ps(sm_scale);
  std::fill(qf, qf + rows_p * kDp, 0.f);
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = q.q + (r / group) * q.row_stride + (r % group) * q.head_stride;
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(qf + r * kDp + 16 * c, _mm512_mul_ps(load16(src + 16 * c, tail_mask(head_dim - 16 * c)), scale));
  }
  std::fill(acc, acc + rows_p * kDp, 0.f);
  std::fill(m, m + rows_p, kNegInf);
  std::fill(l, l + rows_p, 0.f);
  const int64_t kv_end = first_pos + tokens;
  for (int64_t n0 = 0; n0 < kv_end; n0 += kBlock) {
    const int64_t nb = std::min(kBlock, kv_end - n0);
    load_block<KV, NV>(kv, slots + n0, nb, head, head_dim, keys_t, values);
    auto visible = [&](int64_t r) { return std::min(nb, first_pos + std::min(r, rows - 1) / group + 1 - n0); };
    for (int64_t r0 = 0; r0 < rows_p; r0 += kTile) {
      const int64_t tile_visible = visible(r0 + kTile - 1);  // rows see more keys as r grows
      if (tile_visible <= 0) continue;
      float* s = scores + r0 * kBlock;
      score_tile_upto(tile_visible, qf + r0 * kDp, kDp, keys_t, head_dim, s);
      for (int64_t r = r0; r < r0 + kTile; ++r) {
        const int64_t vis = std::max<int64_t>(0, visible(r));
        if (vis > 0) softmax_step(scores + r * kBlock, vis, m[r], l[r], acc + r * kDp, NV);
        std::fill(scores + r * kBlock + vis, scores + r * kBlock + tile_visible, 0.f);  // masked: no weight
      }
      pv_tile<NV>(s, tile_visible, values, acc + r0 * kDp);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(v_scale / l[r]);  // key 0 is visible to every row, so l > 0
    T* dst = out + (r / group) * out_row_stride + (r % group) * head_dim;
    for (int c = 0; c < NV; ++c) store16(dst + 16 * c, tail_mask(head_dim - 16 * c), _mm512_mul_ps(inv, _mm512_loadu_ps(acc + r * kDp + 16 * c)));
  }
}

// Calls f(std::integral_constant<int, NV>) for the head dim's vector count, 1 .. 8.
template <typename F>
void dispatch_vectors(int64_t head_dim, const F& f) {
  switch ((head_dim + 15) / 16) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

}  // namespace

template <typename T, typename KV>
int64_t vector_decode_split(const PagedKV<KV>& kv, const int64_t* slots, int64_t start, int64_t end, QueryView<T> q,
                            float sm_scale, int64_t num_heads, int64_t group, int64_t head_dim, float* scratch,
                            Partial out, int64_t warm, NextKeys after) {
  int64_t trickled = 0;
  dispatch_vectors(head_dim, [&](auto nv) {
    constexpr int kNV = decltype(nv)::value;
    if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<KV, T> && kNV % 2 == 0) {
      if (head_dim == kNV * 16) {
        trickled = decode_split_nv<T, KV, kNV, true>(kv, slots, start, end, q, sm_scale, num_heads, group, head_dim,
                                                     scratch, out, warm, after);
        return;
      }
    }
    trickled = decode_split_nv<T, KV, kNV, false>(kv, slots, start, end, q, sm_scale, num_heads, group, head_dim,
                                                  scratch, out, warm, after);
  });
  return trickled;
}

template <typename T, typename KV>
void vector_extend_item(const PagedKV<KV>& kv, const int64_t* slots, int64_t head, int64_t first_pos, int64_t tokens,
                        QueryView<T> q, float sm_scale, float v_scale, int64_t group, int64_t head_dim, T* out,
                        int64_t out_row_stride, float* scratch) {
  dispatch_vectors(head_dim, [&](auto nv) {
    extend_item_nv<T, KV, decltype(nv)::value>(kv, slots, head, first_pos, tokens, q, sm_scale, v_scale, group,
                                                head_dim, out, out_row_stride, scratch);
  });
}

#define TANDEM_INSTANTIATE_KV(T, KV)                                                                                  \
  template int64_t vector_decode_split<T, KV>(const PagedKV<KV>&, const int64_t*, int64_t, int64_t, QueryView<T>,    \
                                              float, int64_t, int64_t, int64_t, float*, Partial, int64_t, NextKeys);  \
  template void vector_extend_item<T, KV>(const PagedKV<KV>&, const int64_t*, int64_t, int64_t, int64_t,              \
                                          QueryView<T>, float, float, int64_t, int64_t, T*, int64_t, float*);
#define TANDEM_INSTANTIATE(T)             \
  TANDEM_INSTANTIATE_KV(T, T)             \
  TANDEM_INSTANTIATE_KV(T, c10::Float8_e4m3fn) \
  TANDEM_INSTANTIATE_KV(T, c10::Float8_e5m2)
TANDEM_INSTANTIATE(float)
TANDEM_INSTANTIATE_KV(float, c10::BFloat16)  // --kv-cache-dtype bfloat16/float16 under a float32 model
TANDEM_INSTANTIATE_KV(float, c10::Half)
TANDEM_INSTANTIATE(c10::BFloat16)
TANDEM_INSTANTIATE(c10::Half)
#undef TANDEM_INSTANTIATE
#undef TANDEM_INSTANTIATE_KV

}  // namespace tandem_cpu

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace tandem_cpu {

bool cpu_has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

}  // namespace tandem_cpu

#else  // not x86-64 GCC/Clang: paged_attention.cpp never calls the vector kernels

namespace tandem_cpu {
bool cpu_has_avx512() { return false; }
}  // namespace tandem_cpu

#endif

namespace tandem_cpu {

// The sizes match the layouts at the top of decode_split_nv (block 128, 16 x 16 partials) and extend_item_nv (block 64, tiles of 4).
int64_t vector_decode_scratch(int64_t num_heads, int64_t head_dim) {
  const int64_t dp = (head_dim + 15) / 16 * 16;
  return num_heads * (2 * dp + 128 + 256);
}

int64_t vector_extend_scratch(int64_t tokens, int64_t group, int64_t head_dim) {
  const int64_t dp = (head_dim + 15) / 16 * 16, rows = (tokens * group + 3) / 4 * 4;
  return rows * (2 * dp + 64 + 2) + 2 * dp * 64;
}

}  // namespace tandem_cpu
