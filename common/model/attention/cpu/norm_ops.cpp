// RMSNorm in one op call instead of torch's chain of seven (square, mean = sum + div, add eps, rsqrt, two muls,
// and the copy that keeps the input intact), and the residual add before it fused in:
//
// rms_norm(x, weight, eps): x [R, H] or [T, N, H] (any leading strides, unit last stride), a new contiguous tensor
//   out = T(T(x * rsqrt(mean(x^2) + eps)) * weight), computed in float32 with HF's roundings: normalized in float32,
//   rounded to x's dtype, then scaled by the weight (x's dtype or float32) and rounded again
//   (common/model/norm.py's rms_norm is the reference; the mean's summation order differs, so float32 results agree
//   to a few ulps, not bitwise).
// add_rms_norm_(residual, x, weight, eps): residual += x in place (rounded to residual's dtype, as add_ rounds),
//   then rms_norm(residual): a decoder layer's residual add and the next norm, one pass over the row.
//
// A decode step of the small model ran each norm as ~100 us of torch dispatch over 64 rows of 512 floats (17 norms
// a step, ~1.7 ms of a 38 ms step); one call here is a few microseconds.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

// Rows per parallel task: at least this many elements each, so a decode batch's norm (64 rows of a few thousand
// floats) runs on the calling thread instead of waking the OpenMP team for microseconds of work.
constexpr int64_t kElementsPerTask = 1 << 16;
constexpr int kLanes = 16;  // independent partial sums: one 512-bit (or two 256-bit) vector the compiler keeps

template <typename T>
inline float sum_of_squares(const T* x, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const float v = static_cast<float>(x[i + l]);
      acc[l] += v * v;
    }
  }
  float total = 0.f;
  for (int l = 0; l < kLanes; ++l) total += acc[l];
  for (; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    total += v * v;
  }
  return total;
}

// out = T(T(x * scale) * w): the two roundings of HF's `weight * (x * rsqrt(var + eps)).to(dtype)`.
template <typename T, typename W>
inline void scale_row(const T* x, const W* w, float scale, T* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float normed = static_cast<float>(static_cast<T>(static_cast<float>(x[i]) * scale));
    out[i] = static_cast<T>(normed * static_cast<float>(w[i]));
  }
}

template <typename T, typename W>
inline void norm_row(const T* x, const W* w, float eps, T* out, int64_t n) {
  const float mean = sum_of_squares(x, n) / static_cast<float>(n);
  scale_row(x, w, 1.f / std::sqrt(mean + eps), out, n);
}

template <typename T>
inline void add_row(T* residual, const T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) residual[i] = static_cast<T>(static_cast<float>(residual[i]) + static_cast<float>(x[i]));
}

template <typename F>
void dispatch(at::ScalarType dtype, at::ScalarType weight, const char* op, const F& f) {
  TORCH_CHECK(weight == dtype || weight == at::kFloat, op, ": weight is ", weight, ", x is ", dtype,
              " (the weight must be x's dtype or float32)");
  const bool wide = weight == at::kFloat && dtype != at::kFloat;
  switch (dtype) {
    case at::kFloat: f(float{}, float{}); break;
    case at::kBFloat16: wide ? f(c10::BFloat16{}, float{}) : f(c10::BFloat16{}, c10::BFloat16{}); break;
    case at::kHalf: wide ? f(c10::Half{}, float{}) : f(c10::Half{}, c10::Half{}); break;
    default: TORCH_CHECK(false, op, " supports float32, bfloat16 and float16, not ", dtype);
  }
}

void check_weight(const at::Tensor& x, const at::Tensor& weight, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(-1), op,
              ": weight must be a contiguous [", x.size(-1), "] vector, not ", weight.sizes());
}

// Rows of x: [R, H] or [T, N, H] with a unit last stride; row r of a 3-D x is (r / N, r % N).
struct Rows {
  int64_t count, inner, outer_stride, inner_stride;
  explicit Rows(const at::Tensor& x)
      : count(x.dim() == 3 ? x.size(0) * x.size(1) : x.size(0)),
        inner(x.dim() == 3 ? x.size(1) : 1),
        outer_stride(x.stride(0)),
        inner_stride(x.dim() == 3 ? x.stride(1) : 0) {}
  int64_t offset(int64_t r) const { return (r / inner) * outer_stride + (r % inner) * inner_stride; }
};

int64_t grain(int64_t hidden) { return std::max<int64_t>(1, kElementsPerTask / std::max<int64_t>(hidden, 1)); }

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK((x.dim() == 2 || x.dim() == 3) && x.stride(-1) == 1, "rms_norm: x must be [R, H] or [T, N, H] with a "
              "unit last stride, not ", x.sizes(), " strides ", x.strides());
  check_weight(x, weight, "rms_norm");
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t hidden = x.size(-1);
  const Rows rows(x);
  if (out.numel() == 0) return out;
  dispatch(x.scalar_type(), weight.scalar_type(), "rms_norm", [&](auto tag, auto wtag) {
    using T = decltype(tag);
    using W = decltype(wtag);
    const T* src = x.data_ptr<T>();
    const W* w = weight.data_ptr<W>();
    T* dst = out.data_ptr<T>();
    at::parallel_for(0, rows.count, grain(hidden), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) norm_row(src + rows.offset(r), w, float(eps), dst + r * hidden, hidden);
    });
  });
  return out;
}

at::Tensor add_rms_norm_(at::Tensor residual, const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous(), "add_rms_norm_: residual must be a contiguous "
              "[R, H] tensor, not ", residual.sizes(), " strides ", residual.strides());
  TORCH_CHECK(x.sizes() == residual.sizes() && x.stride(-1) == 1 && x.scalar_type() == residual.scalar_type(),
              "add_rms_norm_: x must be ", residual.sizes(), " ", residual.scalar_type(),
              " with a unit last stride, not ", x.sizes(), " ", x.scalar_type(), " strides ", x.strides());
  TORCH_CHECK(x.device().is_cpu(), "add_rms_norm_: CPU tensors only");
  check_weight(residual, weight, "add_rms_norm_");
  at::Tensor out = at::empty(residual.sizes(), residual.options());
  const int64_t hidden = residual.size(1), x_stride = x.stride(0);
  if (out.numel() == 0) return out;
  dispatch(residual.scalar_type(), weight.scalar_type(), "add_rms_norm_", [&](auto tag, auto wtag) {
    using T = decltype(tag);
    using W = decltype(wtag);
    T* res = residual.data_ptr<T>();
    const T* src = x.data_ptr<T>();
    const W* w = weight.data_ptr<W>();
    T* dst = out.data_ptr<T>();
    at::parallel_for(0, residual.size(0), grain(hidden), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        add_row(res + r * hidden, src + r * x_stride, hidden);
        norm_row(res + r * hidden, w, float(eps), dst + r * hidden, hidden);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) residual, Tensor x, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
}
