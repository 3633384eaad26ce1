// The SwiGLU MLP's activation in one op call: silu_and_mul(gate_up) reads the fused gate/up projection's output
// [R, 2I] (gate in the first I columns, up in the last I) and returns act [R, I] = T(T(silu(gate)) * up), the
// arithmetic of torch's `F.silu(gate).mul_(up)` (common/model/activation.py's reference): silu in float32 as
// x / (1 + exp(-x)), rounded to the model's dtype, then the product rounded again. exp is SLEEF's 1-ulp vector exp,
// the one torch's own vectorized silu calls (exported by libtorch_cpu), so float32 results are torch's bitwise where
// both run the same vector width; elsewhere they agree to an ulp.
//
// torch runs it as two ops (silu out of place over the strided gate, then mul_): 44 us a layer for a decode batch of
// 64 rows of the small model on two threads, 11 us for one row; this op 35 and 4 us (the exp and the division are
// most of what is left).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels.h"

#if TANDEM_X86_KERNELS
#include <immintrin.h>

// SLEEF's vector exp, as libtorch_cpu exports it (sleef.h declares each only where the whole file is built for its
// ISA; these are called only from functions built for it).
extern "C" __attribute__((target("avx512f"))) __m512 Sleef_expf16_u10(__m512);
extern "C" __attribute__((target("avx2,fma"))) __m256 Sleef_expf8_u10(__m256);
#endif

namespace {

// Elements per parallel task: a decode batch's activation (64 x 1536) splits over two threads, a single row stays
// on the calling thread.
constexpr int64_t kElementsPerTask = 1 << 14;
constexpr int64_t kBlock = 256;  // floats converted and activated at a time (on the stack, in L1)

// s[i] = g[i] / (1 + exp(-g[i])) for i < n, the loops of torch's silu: the vector ones for whole vectors, its
// scalar one (std::exp) for the rest.
void silu_portable(const float* g, float* s, int64_t n) {
  for (int64_t i = 0; i < n; ++i) s[i] = g[i] / (1.f + std::exp(-g[i]));
}

#if TANDEM_X86_KERNELS
__attribute__((target("avx512f"))) void silu_avx512(const float* g, float* s, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(g + i);
    const __m512 e = Sleef_expf16_u10(_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), sign)));
    _mm512_storeu_ps(s + i, _mm512_div_ps(x, _mm512_add_ps(one, e)));
  }
  silu_portable(g + i, s + i, n - i);
}

__attribute__((target("avx2,fma"))) void silu_avx2(const float* g, float* s, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 e = Sleef_expf8_u10(_mm256_xor_ps(x, sign));
    _mm256_storeu_ps(s + i, _mm256_div_ps(x, _mm256_add_ps(one, e)));
  }
  silu_portable(g + i, s + i, n - i);
}
#endif

using SiluBlock = void (*)(const float*, float*, int64_t);

// The loop for the kernels set_kernel_isa chose (tandem_cpu::selected_isa: AVX-512 where the CPU has it, else AVX2,
// else the portable loop; the tests force each).
SiluBlock silu_block() {
#if TANDEM_X86_KERNELS
  switch (tandem_cpu::selected_isa()) {
    case tandem_cpu::VectorIsa::kAvx512: return &silu_avx512;
    case tandem_cpu::VectorIsa::kAvx2: return &silu_avx2;
    default: break;
  }
#endif
  return &silu_portable;
}

// One row: out[i] = T(float(T(silu(gate[i]))) * float(up[i])); for float32 both casts are the identity.
template <typename T>
void silu_mul_row(const T* gate, const T* up, T* out, int64_t n, SiluBlock silu) {
  float g[kBlock], s[kBlock];
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const int64_t len = std::min(kBlock, n - i0);
    for (int64_t j = 0; j < len; ++j) g[j] = static_cast<float>(gate[i0 + j]);
    silu(g, s, len);
    for (int64_t j = 0; j < len; ++j) {
      out[i0 + j] = static_cast<T>(static_cast<float>(static_cast<T>(s[j])) * static_cast<float>(up[i0 + j]));
    }
  }
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu(), "silu_and_mul: CPU tensors only");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(-1) == 1 && gate_up.size(1) % 2 == 0, "silu_and_mul: gate_up must "
              "be [R, 2I] (gate, then up) with a unit last stride, not ", gate_up.sizes(), " strides ",
              gate_up.strides());
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2, stride = gate_up.stride(0);
  at::Tensor out = at::empty({rows, inter}, gate_up.options());
  if (out.numel() == 0) return out;
  const int64_t grain = std::max<int64_t>(1, kElementsPerTask / inter);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* src = gate_up.data_ptr<T>();
    T* dst = out.data_ptr<T>();
    const SiluBlock silu = silu_block();
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        silu_mul_row(src + r * stride, src + r * stride + inter, dst + r * inter, inter, silu);
      }
    });
  };
  switch (gate_up.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK(false, "silu_and_mul supports float32, bfloat16 and float16, not ", gate_up.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) { m.def("silu_and_mul(Tensor gate_up) -> Tensor"); }

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) { m.impl("silu_and_mul", &silu_and_mul); }
