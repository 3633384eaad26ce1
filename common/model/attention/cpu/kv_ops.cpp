// The elementwise work around the `cpu` backend's attention, one op call each instead of a chain of torch ops:
//
// rope_(x, cos, sin): rotates x [T, H, D] in place (any token and head strides, unit dim stride) by cos/sin
//   [T, D/2] (or [T, 1, D/2]), with HF's roundings exactly: x1' = x1*cos - x2*sin and x2' = x2*cos + x1*sin, each
//   product rounded to x's dtype, then the sum (common/model/rope.py's apply_rope_ is the reference, bitwise).
// store_kv(k_buffer, v_buffer, loc, k, v): copies each new token's K and V row ([kv_heads, head_dim], contiguous
//   within the token) to row loc[t] of the layer's pool buffers: what `buffer[loc] = k` does, without
//   TensorIterator's advanced-indexing set-up on a strided source.
//
// In a small model's decode step these replace 6 elementwise ops and 2 index_puts per layer, each of which cost more
// in dispatch than in arithmetic (a step of the 8-layer small model spent ~8 % of its model thread on them).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#if defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>
#endif

// HF's roundings need each product rounded on its own: no fused multiply-adds in this file's arithmetic.
#pragma GCC optimize("fp-contract=off")

namespace {

// Tokens per parallel task: a decode batch's rotation or copy takes microseconds, less than waking the OpenMP team
// (a futex wake-up per thread under OMP_WAIT_POLICY=PASSIVE), so only a prefill's thousands of tokens fan out.
constexpr int64_t kRopeTokensPerTask = 256;
constexpr int64_t kStoreTokensPerTask = 1024;

// Elements [begin, end) of one rotation in T's arithmetic: every operation computed in float and rounded to T, as
// torch's CPU kernels do.
template <typename T>
inline void rotate_scalar(T* x1, T* x2, const T* cos, const T* sin, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const float a = static_cast<float>(x1[i]);
    const float b = static_cast<float>(x2[i]);
    const float c = static_cast<float>(cos[i]);
    const float s = static_cast<float>(sin[i]);
    const float a_sin = static_cast<float>(static_cast<T>(a * s));
    const float a_cos = static_cast<float>(static_cast<T>(a * c));
    const float b_sin = static_cast<float>(static_cast<T>(b * s));
    const float b_cos = static_cast<float>(static_cast<T>(b * c));
    x1[i] = static_cast<T>(a_cos - b_sin);
    x2[i] = static_cast<T>(b_cos + a_sin);
  }
}

template <typename T>
inline void rotate_row(T* x1, T* x2, const T* cos, const T* sin, int64_t half) {
  rotate_scalar(x1, x2, cos, sin, 0, half);
}

// float needs no intermediate rounding: the plain loop, which the compiler vectorizes.
template <>
inline void rotate_row<float>(float* x1, float* x2, const float* cos, const float* sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = x1[i];
    const float b = x2[i];
    const float a_sin = a * sin[i];
    const float b_sin = b * sin[i];
    const float a_cos = a * cos[i];
    const float b_cos = b * cos[i];
    x1[i] = a_cos - b_sin;
    x2[i] = b_cos + a_sin;
  }
}

// float -> bfloat16 bits rounded to nearest even, a NaN to 0x7FC0: c10::BFloat16's conversion, written without
// branches so that the loop below vectorizes (through c10::BFloat16 it stayed scalar, 15x float32's time).
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint16_t rounded = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return f != f ? uint16_t{0x7FC0} : rounded;
}

inline float bf16_float(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

template <>
inline void rotate_row<c10::BFloat16>(c10::BFloat16* x1, c10::BFloat16* x2, const c10::BFloat16* cos,
                                      const c10::BFloat16* sin, int64_t half) {
  auto* p1 = reinterpret_cast<uint16_t*>(x1);
  auto* p2 = reinterpret_cast<uint16_t*>(x2);
  const auto* pc = reinterpret_cast<const uint16_t*>(cos);
  const auto* ps = reinterpret_cast<const uint16_t*>(sin);
  for (int64_t i = 0; i < half; ++i) {
    const float a = bf16_float(p1[i]);
    const float b = bf16_float(p2[i]);
    const float c = bf16_float(pc[i]);
    const float s = bf16_float(ps[i]);
    const float a_sin = bf16_float(bf16_bits(a * s));
    const float a_cos = bf16_float(bf16_bits(a * c));
    const float b_sin = bf16_float(bf16_bits(b * s));
    const float b_cos = bf16_float(bf16_bits(b * c));
    p1[i] = bf16_bits(a_cos - b_sin);
    p2[i] = bf16_bits(b_cos + a_sin);
  }
}

#if defined(__F16C__) && defined(__AVX__)
// float16 through F16C's conversions, eight lanes at a time (through c10::Half the loop stays scalar, 20x float32's
// time). The hardware rounds to nearest even as c10::Half does, overflow to inf and subnormals included; a NaN stays a
// NaN (its payload may differ from c10's 0x7E00). A row's last half % 8 elements take rotate_scalar.
inline __m256 round_to_half(__m256 x) {
  return _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

template <>
inline void rotate_row<c10::Half>(c10::Half* x1, c10::Half* x2, const c10::Half* cos, const c10::Half* sin,
                                  int64_t half) {
  int64_t i = 0;
  for (; i + 8 <= half; i += 8) {
    const __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x1 + i)));
    const __m256 b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x2 + i)));
    const __m256 c = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(cos + i)));
    const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sin + i)));
    const __m256 a_sin = round_to_half(_mm256_mul_ps(a, s));
    const __m256 a_cos = round_to_half(_mm256_mul_ps(a, c));
    const __m256 b_sin = round_to_half(_mm256_mul_ps(b, s));
    const __m256 b_cos = round_to_half(_mm256_mul_ps(b, c));
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(x1 + i), _mm256_cvtps_ph(_mm256_sub_ps(a_cos, b_sin), kRound));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(x2 + i), _mm256_cvtps_ph(_mm256_add_ps(b_cos, a_sin), kRound));
  }
  rotate_scalar(x1, x2, cos, sin, i, half);
}
#endif

template <typename T>
void rope_impl(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  const int64_t cos_stride = cos.stride(0), sin_stride = sin.stride(0);
  T* base = x.data_ptr<T>();
  const T* cos_base = cos.data_ptr<T>();
  const T* sin_base = sin.data_ptr<T>();
  at::parallel_for(0, tokens, kRopeTokensPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos_base + t * cos_stride;
      const T* s = sin_base + t * sin_stride;
      for (int64_t h = 0; h < heads; ++h) {
        T* row = base + t * token_stride + h * head_stride;
        rotate_row<T>(row, row + half, c, s, half);
      }
    }
  });
}

template <typename F>
void dispatch_float(at::ScalarType dtype, const char* op, const F& f) {
  switch (dtype) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, op, " supports float32, bfloat16 and float16, not ", dtype);
  }
}

// cos/sin: [T, D/2] or [T, 1, D/2] rows of unit stride.
void check_table(const at::Tensor& x, const at::Tensor& table, const char* name) {
  const bool shaped = (table.dim() == 2 || (table.dim() == 3 && table.size(1) == 1)) && table.size(0) == x.size(0) &&
                      table.size(-1) * 2 == x.size(2);
  TORCH_CHECK(shaped, "rope_: ", name, " must be [T, D/2] or [T, 1, D/2] for x of shape ", x.sizes(), ", not ",
              table.sizes());
  TORCH_CHECK(table.scalar_type() == x.scalar_type(), "rope_: ", name, " is ", table.scalar_type(), ", x is ",
              x.scalar_type());
  TORCH_CHECK(table.stride(-1) == 1, "rope_: ", name, "'s last dimension must have unit stride");
}

void rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu(), "rope_: CPU tensors only");
  TORCH_CHECK(x.dim() == 3 && x.size(2) % 2 == 0 && x.stride(2) == 1,
              "rope_: x must be [T, H, D] with an even D of unit stride, not ", x.sizes(), " strides ", x.strides());
  check_table(x, cos, "cos");
  check_table(x, sin, "sin");
  if (x.numel() == 0) return;
  dispatch_float(x.scalar_type(), "rope_", [&](auto tag) { rope_impl<decltype(tag)>(x, cos, sin); });
}

void check_rows(const at::Tensor& buffer, const at::Tensor& rows, int64_t tokens, const char* name) {
  TORCH_CHECK(rows.dim() == 3 && rows.size(0) == tokens && rows.size(1) == buffer.size(1) &&
                  rows.size(2) == buffer.size(2),
              "store_kv: ", name, " must be [T, kv_heads, head_dim] = [", tokens, ", ", buffer.size(1), ", ",
              buffer.size(2), "], not ", rows.sizes());
  TORCH_CHECK(rows.stride(2) == 1 && rows.stride(1) == rows.size(2),
              "store_kv: each token's ", name, " row must be contiguous (strides [*, head_dim, 1]), not ",
              rows.strides());
  TORCH_CHECK(rows.scalar_type() == buffer.scalar_type(), "store_kv: ", name, " is ", rows.scalar_type(),
              ", its buffer ", buffer.scalar_type());
}

void store_kv(at::Tensor k_buffer, at::Tensor v_buffer, const at::Tensor& loc, const at::Tensor& k,
              const at::Tensor& v) {
  TORCH_CHECK(k_buffer.device().is_cpu() && v_buffer.device().is_cpu() && loc.device().is_cpu() &&
                  k.device().is_cpu() && v.device().is_cpu(),
              "store_kv: CPU tensors only");
  TORCH_CHECK(k_buffer.dim() == 3 && k_buffer.is_contiguous() && v_buffer.is_contiguous() &&
                  v_buffer.sizes() == k_buffer.sizes() && v_buffer.scalar_type() == k_buffer.scalar_type(),
              "store_kv: k_buffer and v_buffer must be contiguous [rows, kv_heads, head_dim] of one dtype");
  TORCH_CHECK(loc.scalar_type() == at::kLong && loc.dim() == 1 && loc.is_contiguous(),
              "store_kv: loc must be a contiguous 1-D int64 tensor");
  const int64_t tokens = loc.size(0);
  check_rows(k_buffer, k, tokens, "k");
  check_rows(v_buffer, v, tokens, "v");
  if (tokens == 0) return;
  const int64_t rows = k_buffer.size(0);
  const int64_t* slots = loc.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < rows, "store_kv: loc[", t, "] = ", slots[t], " is outside the pool's ",
                rows, " rows");
  }
  const size_t row_bytes = static_cast<size_t>(k_buffer.size(1) * k_buffer.size(2)) * k_buffer.element_size();
  auto* k_dst = static_cast<char*>(k_buffer.data_ptr());
  auto* v_dst = static_cast<char*>(v_buffer.data_ptr());
  const auto* k_src = static_cast<const char*>(k.data_ptr());
  const auto* v_src = static_cast<const char*>(v.data_ptr());
  const int64_t k_step = k.stride(0) * k.element_size(), v_step = v.stride(0) * v.element_size();
  at::parallel_for(0, tokens, kStoreTokensPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(k_dst + slots[t] * row_bytes, k_src + t * k_step, row_bytes);
      std::memcpy(v_dst + slots[t] * row_bytes, v_src + t * v_step, row_bytes);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("store_kv(Tensor(a!) k_buffer, Tensor(b!) v_buffer, Tensor loc, Tensor k, Tensor v) -> ()");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("rope_", &rope_);
  m.impl("store_kv", &store_kv);
}
