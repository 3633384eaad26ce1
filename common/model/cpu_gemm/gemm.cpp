// float32 GEMM  out[M, N] = x[M, K] @ weight[N, K]^T (+ bias): a register-blocked micro-kernel over a weight
// packed once into panels of NR columns, [ceil(N / NR)][K][NR] (the last panel zero-padded), parallel over panels.
// Two variants, both built where the CPU has them and picked by the packed weight's panel width:
// AVX-512, 12 x 32 register tiles (24 zmm accumulators); AVX2+FMA, 6 x 16 (12 ymm accumulators).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>
#include <vector>

// probe.cpp
std::vector<int64_t> fma_widths();
at::Tensor fma_probe(int64_t iters, int64_t width, int64_t threads);

namespace {

// K is walked in blocks of kKc so a block of one panel (kKc x NR floats) stays in L1 across the row blocks.
constexpr int64_t kKc = 256;

#if defined(__AVX512F__)
struct Avx512 {
  static constexpr int kNr = 32, kMr = 12, kLanes = 16;
  using Vec = __m512;
  static Vec zero() { return _mm512_setzero_ps(); }
  static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
  static Vec broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
};
#endif

#if defined(__AVX2__) && defined(__FMA__)
struct Avx2 {
  static constexpr int kNr = 16, kMr = 6, kLanes = 8;
  using Vec = __m256;
  static Vec zero() { return _mm256_setzero_ps(); }
  static Vec load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
  static Vec broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
};
#endif

// tile[MR][NR] (+)= x[MR rows, 0:kc] @ panel[0:kc][NR]; `accumulate` adds to what the tile holds.
template <class Isa, int MR>
void micro_kernel(const float* x, int64_t ldx, const float* panel, int64_t kc, float* tile, bool accumulate) {
  constexpr int kNr = Isa::kNr, kLanes = Isa::kLanes, kVecs = kNr / kLanes;
  typename Isa::Vec acc[MR][kVecs];
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < kVecs; ++v) acc[r][v] = accumulate ? Isa::load(tile + r * kNr + v * kLanes) : Isa::zero();
  for (int64_t k = 0; k < kc; ++k) {
    typename Isa::Vec b[kVecs];
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

using Kernel = void (*)(const float*, int64_t, const float*, int64_t, float*, bool);

template <class Isa, int... Rows>
constexpr std::array<Kernel, sizeof...(Rows)> kernels_by_rows(std::integer_sequence<int, Rows...>) {
  return {&micro_kernel<Isa, Rows + 1>...};
}

// Every row of x times one panel (output columns [n0, n0 + cols)), summed in `scratch` ([m][NR] floats): K blocks
// outer, row blocks inner, so each block of the panel is loaded into L1 once for all the rows.
template <class Isa>
void panel_product(const float* x, int64_t m, int64_t k, const float* panel, const float* bias, float* out,
                   int64_t n, int64_t n0, int64_t cols, float* scratch) {
  constexpr int kNr = Isa::kNr, kMr = Isa::kMr;
  static constexpr auto by_rows = kernels_by_rows<Isa>(std::make_integer_sequence<int, kMr>{});
  for (int64_t k0 = 0; k0 < k; k0 += kKc) {
    const int64_t kc = std::min(kKc, k - k0);
    for (int64_t m0 = 0; m0 < m; m0 += kMr) {
      const int64_t rows = std::min<int64_t>(kMr, m - m0);
      by_rows[rows - 1](x + m0 * k + k0, k, panel + k0 * kNr, kc, scratch + m0 * kNr, k0 > 0);
    }
  }
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

template <class Isa>
void linear(const float* x, int64_t m, int64_t k, const float* packed, int64_t panels, const float* bias,
            float* out, int64_t n) {
  constexpr int kNr = Isa::kNr;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(m * kNr);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * kNr;
      panel_product<Isa>(x, m, k, packed + p * k * kNr, bias, out, n, n0, std::min<int64_t>(kNr, n - n0),
                         scratch.data());
    }
  });
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

// weight [N, K] float32 -> panels [ceil(N / width), K, width], zero-padded past N.
at::Tensor pack_weight(const at::Tensor& weight, int64_t width) {
  const auto widths = gemm_panel_widths();
  TORCH_CHECK(std::find(widths.begin(), widths.end(), width) != widths.end(),
              "pack_weight: no kernel of panel width ", width, " was built on this CPU");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "pack_weight: a 2-D float32 weight");
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + width - 1) / width;
  at::Tensor padded = at::zeros({panels * width, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  return padded.view({panels, width, k}).transpose(1, 2).contiguous();
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                         const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat, "packed_linear: float32 only");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous(), "packed_linear: not a packed weight");
  const int64_t panels = packed.size(0), k = packed.size(1), width = packed.size(2);
  TORCH_CHECK(x.size(-1) == k, "packed_linear: x has ", x.size(-1), " columns, the weight ", k);
  TORCH_CHECK(n > (panels - 1) * width && n <= panels * width, "packed_linear: n does not match the panels");
  const at::Tensor x2 = x.reshape({-1, k}).contiguous();
  const int64_t m = x2.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  at::Tensor out = at::empty({m, n}, x.options());
  at::Tensor bias_f;
  const float* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    bias_f = bias->contiguous();
    TORCH_CHECK(bias_f.scalar_type() == at::kFloat && bias_f.numel() == n, "packed_linear: a bias of N floats");
    bias_ptr = bias_f.data_ptr<float>();
  }
  if (m == 0) return out.view(out_shape);
  bool ran = false;
#if defined(__AVX512F__)
  if (width == Avx512::kNr) {
    linear<Avx512>(x2.data_ptr<float>(), m, k, packed.data_ptr<float>(), panels, bias_ptr, out.data_ptr<float>(), n);
    ran = true;
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (width == Avx2::kNr) {
    linear<Avx2>(x2.data_ptr<float>(), m, k, packed.data_ptr<float>(), panels, bias_ptr, out.data_ptr<float>(), n);
    ran = true;
  }
#endif
  TORCH_CHECK(ran, "packed_linear: no kernel of panel width ", width, " was built on this CPU");
  return out.view(out_shape);
}

TORCH_LIBRARY(tandem_gemm, m) {
  m.def("fma_widths() -> int[]", &fma_widths);
  m.def("fma_probe(int iters, int width, int threads) -> Tensor", &fma_probe);
  m.def("gemm_panel_widths() -> int[]", &gemm_panel_widths);
  m.def("pack_weight(Tensor weight, int width) -> Tensor", &pack_weight);
  m.def("packed_linear(Tensor x, Tensor packed, int n, Tensor? bias=None) -> Tensor", &packed_linear);
}
