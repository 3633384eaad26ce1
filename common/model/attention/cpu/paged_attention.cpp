// Paged attention for the `cpu` attention backend: decode and extend read K/V rows straight from the KV pool.
//
// Pool layout (common/memory/kv_pool.py): k_buffer / v_buffer [rows, kv_heads, head_dim], contiguous; the K/V of
// position p of request b sit at row req_to_token[req_pool_indices[b], p]. Query heads h*G .. h*G+G-1 share KV
// head h (GQA). Scores, softmax and outputs accumulate in float32 (an online softmax over blocks of keys); each op
// returns a new [T, Hq, D] tensor in q's dtype, so torch.compile can treat it as a functional opaque op.
// An FP8 pool (float8_e4m3fn / float8_e5m2) holds k / k_scale and v / v_scale: k_scale joins sm_scale, v_scale the
// output's 1 / l, so the loops read float(kv) and never scale a key or value one by one.
// This file holds the ops, their checks, the work split and the portable loops; where the CPU has AVX-512 the
// work items run the kernels of kernels_avx512.cpp instead, where it has AVX2 (+FMA, F16C) those of kernels_avx2.cpp
// (kernels_for).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "kernels.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using tandem_cpu::Partial;
using tandem_cpu::PagedKV;
using tandem_cpu::QueryView;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kDecodeBlock = 128;  // keys scored per online-softmax step in decode
constexpr int64_t kExtendRows = 32;    // new tokens per extend work item
constexpr int64_t kExtendBlock = 64;   // keys per extend step (the width of a score row)
constexpr int64_t kMinKeysPerSplit = 128;

// exp(x) for x <= 0, written so the compiler vectorizes it (std::exp stays a scalar call without -ffast-math):
// x = n ln2 + r with |r| <= ln2/2, exp(r) by Cephes' polynomial (about 1 ulp), 2^n through the exponent bits.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // exp(-87) is still a normal float: no denormal exponent bits
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

template <typename T>
inline float dot(const float* q, const T* k, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += q[i] * static_cast<float>(k[i]);
  return s;
}

template <typename T>
inline void axpy(float a, const T* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * static_cast<float>(x[i]);
}

template <typename T>
inline void to_float(const T* x, float* y, int64_t n, float scale) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = static_cast<float>(x[i]) * scale;
}

// One online-softmax step of a row: scores s[0, n) (overwritten by their probabilities) join the running max m,
// denominator l and the accumulator acc [d], which is rescaled when the max moves.
inline void softmax_step(float* s, int64_t n, float& m, float& l, float* acc, int64_t d) {
  float block_max = kNegInf;
#pragma omp simd reduction(max : block_max)
  for (int64_t i = 0; i < n; ++i) block_max = std::max(block_max, s[i]);
  const float m_new = std::max(m, block_max);
  if (m != m_new) {
    const float alpha = m == kNegInf ? 0.f : exp_nonpositive(m - m_new);
    l *= alpha;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) acc[i] *= alpha;
    m = m_new;
  }
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    s[i] = exp_nonpositive(s[i] - m_new);
    sum += s[i];
  }
  l += sum;
}

// Which kernels the work items run. set_kernel_isa forces one (the tests and `tandem bench attention` compare them).
enum class Isa : int { kPortable, kAvx2, kAvx512 };  // tandem_cpu::VectorIsa's values

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "portable";
  }
}

bool isa_available(Isa isa) {
  if (isa == Isa::kPortable) return true;
  if (!TANDEM_X86_KERNELS) return false;
  return isa == Isa::kAvx512 ? tandem_cpu::cpu_has_avx512() : tandem_cpu::cpu_has_avx2();
}

Isa best_isa() {
  if (isa_available(Isa::kAvx512)) return Isa::kAvx512;
  return isa_available(Isa::kAvx2) ? Isa::kAvx2 : Isa::kPortable;
}

std::atomic<Isa> g_isa{best_isa()};

// The kernels for this head dim: the chosen vector ones up to kMaxVectorHeadDim, the portable loops past it.
Isa kernels_for(int64_t head_dim) {
  return head_dim <= tandem_cpu::kMaxVectorHeadDim ? g_isa.load(std::memory_order_relaxed) : Isa::kPortable;
}

// Runs work(i) for i in [0, n) on torch's intra-op threads, each taking the next item as it finishes one: requests
// of unequal lengths would leave a static split unbalanced.
template <typename F>
void parallel_items(int64_t n, const F& work) {
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  at::parallel_for(0, std::max<int64_t>(threads, 1), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = next++; i < n; i = next++) work(i);
    }
  });
}

// The same, each thread claiming its next item before it runs the current one: work(i, after, carry) learns the
// item it runs next (-1: none) and returns what it hands that item (the decode kernels: how many of its rows they
// trickled into L2), passed back as `carry`, 0 for a thread's first item.
template <typename F>
void parallel_items_ahead(int64_t n, const F& work) {
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  at::parallel_for(0, std::max<int64_t>(threads, 1), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      int64_t carry = 0;
      for (int64_t i = next++; i < n;) {
        const int64_t after = next++;
        carry = work(i, after < n ? after : -1, carry);
        i = after;
      }
    }
  });
}

template <typename KV>
PagedKV<KV> paged_kv(const at::Tensor& k_buffer, const at::Tensor& v_buffer, const at::Tensor& req_to_token,
                     const at::Tensor& req_pool_indices) {
  return {k_buffer.data_ptr<KV>(), v_buffer.data_ptr<KV>(), k_buffer.stride(0), k_buffer.stride(1),
          req_to_token.data_ptr<int64_t>(), req_to_token.stride(0), req_pool_indices.data_ptr<int64_t>()};
}

// Decode: attends the query rows q [Hq, D] (already float and scaled) of one request over its keys [start, end).
// All heads of a pool row are read together: the row is contiguous, and reading one head's slice of each row
// would leave the hardware prefetcher fetching the other heads' lines for nothing.
template <typename KV>
void decode_split(const PagedKV<KV>& kv, const int64_t* slots, int64_t start, int64_t end, const float* q,
                  int64_t num_heads, int64_t group, int64_t head_dim, float* scores, Partial out) {
  std::fill(out.acc, out.acc + num_heads * head_dim, 0.f);
  std::fill(out.m, out.m + num_heads, kNegInf);
  std::fill(out.l, out.l + num_heads, 0.f);
  for (int64_t n0 = start; n0 < end; n0 += kDecodeBlock) {
    const int64_t nb = std::min(kDecodeBlock, end - n0);
    for (int64_t n = 0; n < nb; ++n) {
      const KV* key_row = kv.k + slots[n0 + n] * kv.row_stride;
      for (int64_t hq = 0; hq < num_heads; ++hq) {
        scores[hq * kDecodeBlock + n] = dot(q + hq * head_dim, key_row + (hq / group) * kv.head_stride, head_dim);
      }
    }
    for (int64_t hq = 0; hq < num_heads; ++hq) {
      softmax_step(scores + hq * kDecodeBlock, nb, out.m[hq], out.l[hq], out.acc + hq * head_dim, head_dim);
    }
    for (int64_t n = 0; n < nb; ++n) {
      const KV* value_row = kv.v + slots[n0 + n] * kv.row_stride;
      for (int64_t hq = 0; hq < num_heads; ++hq) {
        axpy(scores[hq * kDecodeBlock + n], value_row + (hq / group) * kv.head_stride, out.acc + hq * head_dim,
             head_dim);
      }
    }
  }
}

void check_common(const at::Tensor& q, const at::Tensor& k_buffer, const at::Tensor& v_buffer,
                  const at::Tensor& req_to_token, const at::Tensor& req_pool_indices) {
  TORCH_CHECK(q.device().is_cpu() && k_buffer.device().is_cpu(), "tandem_cpu attention runs on CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [T, Hq, D] with a unit-stride head dimension");
  TORCH_CHECK(k_buffer.dim() == 3 && k_buffer.is_contiguous() && v_buffer.sizes() == k_buffer.sizes() &&
                  v_buffer.strides() == k_buffer.strides(),
              "k_buffer/v_buffer must be contiguous [rows, kv_heads, head_dim] of one shape");
  const bool fp8 = k_buffer.scalar_type() == at::kFloat8_e4m3fn || k_buffer.scalar_type() == at::kFloat8_e5m2;
  const bool widened = q.scalar_type() == at::kFloat &&
                       (k_buffer.scalar_type() == at::kBFloat16 || k_buffer.scalar_type() == at::kHalf);
  TORCH_CHECK((q.scalar_type() == k_buffer.scalar_type() || fp8 || widened) &&
                  v_buffer.scalar_type() == k_buffer.scalar_type(),
              "k_buffer and v_buffer must share q's dtype, one FP8 dtype, or (float32 queries) one 16-bit dtype");
  TORCH_CHECK(q.size(2) == k_buffer.size(2), "q's head_dim differs from the pool's");
  TORCH_CHECK(q.size(1) % k_buffer.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(req_to_token.scalar_type() == at::kLong && req_to_token.dim() == 2 && req_to_token.stride(1) == 1,
              "req_to_token must be an int64 [rows, context] table");
  TORCH_CHECK(req_pool_indices.scalar_type() == at::kLong && req_pool_indices.is_contiguous(),
              "req_pool_indices must be contiguous int64");
}

// Splits per request so that (requests x splits) keeps every thread busy when the batch is small.
int64_t decode_num_splits(int64_t batch, int64_t max_len) {
  const int64_t wanted = 4 * at::get_num_threads();
  if (batch >= wanted) return 1;
  const int64_t by_length = std::max<int64_t>(1, max_len / kMinKeysPerSplit);
  return std::max<int64_t>(1, std::min((wanted + batch - 1) / batch, by_length));
}

template <typename T, typename KV>
void decode_impl(const at::Tensor& q, const PagedKV<KV>& kv, const int64_t* seq_lens, int64_t kv_heads,
                 float sm_scale, float v_scale, at::Tensor& out) {
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t group = num_heads / kv_heads;
  const int64_t splits = decode_num_splits(batch, *std::max_element(seq_lens, seq_lens + batch));
  const int64_t partial_size = num_heads * (head_dim + 2);  // acc [Hq, D], m [Hq], l [Hq]
  std::vector<float> partials(splits > 1 ? batch * splits * partial_size : 0);
  const T* q_ptr = q.data_ptr<T>();
  T* out_ptr = out.data_ptr<T>();

  auto finish = [&](int64_t b, const float* acc, const float* l) {
    T* dst = out_ptr + b * num_heads * head_dim;
    for (int64_t hq = 0; hq < num_heads; ++hq) {
      const float inv = l[hq] > 0.f ? v_scale / l[hq] : 0.f;  // seq_len 0 (a padded graph row): zeros, not NaN
      for (int64_t i = 0; i < head_dim; ++i) dst[hq * head_dim + i] = static_cast<T>(acc[hq * head_dim + i] * inv);
    }
  };

  const Isa isa = kernels_for(head_dim);
  const int64_t work_size = isa == Isa::kAvx512 ? tandem_cpu::vector_decode_scratch(num_heads, head_dim)
                            : isa == Isa::kAvx2 ? tandem_cpu::avx2::decode_scratch(num_heads, head_dim)
                                                : num_heads * (head_dim + kDecodeBlock);  // q [Hq, D], scores [Hq, block]
  auto keys = [&](int64_t item) {  // the keys [start, end) of one split
    const int64_t b = item / splits, split = item % splits;
    const int64_t len = seq_lens[b], per_split = (len + splits - 1) / splits;
    const int64_t start = std::min(len, split * per_split);
    return tandem_cpu::NextKeys{kv.slots(b), start, std::min(len, start + per_split)};
  };
  parallel_items_ahead(batch * splits, [&](int64_t item, int64_t next_item, int64_t warm) -> int64_t {
    thread_local std::vector<float> scratch;  // one split's acc, m, l (when not in partials), then the kernel's own
    if (static_cast<int64_t>(scratch.size()) < partial_size + work_size) scratch.resize(partial_size + work_size);
    float* own = splits > 1 ? partials.data() + item * partial_size : scratch.data();
    float* work = scratch.data() + partial_size;
    const Partial part{own, own + num_heads * head_dim, own + num_heads * head_dim + num_heads};
    const int64_t b = item / splits;
    const auto [slots, start, end] = keys(item);
    const tandem_cpu::NextKeys after = next_item >= 0 ? keys(next_item) : tandem_cpu::NextKeys{};
    const QueryView<T> rows{q_ptr + b * q.stride(0), 0, q.stride(1)};
    int64_t trickled = 0;
    if (isa == Isa::kAvx512) {
      trickled = tandem_cpu::vector_decode_split<T, KV>(kv, slots, start, end, rows, sm_scale, num_heads, group,
                                                        head_dim, work, part, warm, after);
    } else if (isa == Isa::kAvx2) {
      trickled = tandem_cpu::avx2::decode_split<T, KV>(kv, slots, start, end, rows, sm_scale, num_heads, group,
                                                       head_dim, work, part, warm, after);
    } else {
      for (int64_t hq = 0; hq < num_heads; ++hq) {
        to_float(q_ptr + b * q.stride(0) + hq * q.stride(1), work + hq * head_dim, head_dim, sm_scale);
      }
      decode_split(kv, slots, start, end, work, num_heads, group, head_dim, work + num_heads * head_dim, part);
    }
    if (splits == 1) finish(b, part.acc, part.l);
    return trickled;
  });
  if (splits == 1) return;

  // Merge each request's splits by log-sum-exp.
  parallel_items(batch, [&](int64_t b) {
    thread_local std::vector<float> merged;
    merged.assign(num_heads * (head_dim + 1), 0.f);
    float* acc = merged.data();
    float* l = acc + num_heads * head_dim;
    const float* first = partials.data() + b * splits * partial_size;
    for (int64_t hq = 0; hq < num_heads; ++hq) {
      float m = kNegInf;
      for (int64_t s = 0; s < splits; ++s) m = std::max(m, first[s * partial_size + num_heads * head_dim + hq]);
      for (int64_t s = 0; s < splits; ++s) {
        const float* part = first + s * partial_size;
        const float m_s = part[num_heads * head_dim + hq], l_s = part[num_heads * (head_dim + 1) + hq];
        if (l_s == 0.f) continue;  // an empty split
        const float w = exp_nonpositive(m_s - m);
        l[hq] += w * l_s;
        axpy(w, part + hq * head_dim, acc + hq * head_dim, head_dim);
      }
    }
    finish(b, acc, l);
  });
}

// Extend: one work item is up to kExtendRows new tokens of one request for the G query heads of one KV head.
// Rows r = j * G + g (token j, head g); token j sits at position prefix + j0 + j and sees keys [0, that].
struct ExtendItem {
  int64_t b, head, j0, rows_tokens;
};

// s [block] = q [D] . keys_t [D, block]: whole-vector FMAs into a local row the compiler keeps in registers.
inline void score_row(const float* __restrict__ q, const float* __restrict__ keys_t, int64_t head_dim,
                      float* __restrict__ s) {
  float row[kExtendBlock] = {};
  for (int64_t d = 0; d < head_dim; ++d) {
    const float qd = q[d];
    const float* __restrict__ kd = keys_t + d * kExtendBlock;
#pragma omp simd
    for (int64_t n = 0; n < kExtendBlock; ++n) row[n] += qd * kd[n];
  }
  std::memcpy(s, row, sizeof(row));
}

// acc [D] += p [n] . values [n, D] for a head dim known at compile time, so the row stays in registers.
template <int64_t kHeadDim>
inline void accumulate_row(const float* __restrict__ p, int64_t n, const float* __restrict__ values,
                           float* __restrict__ acc) {
  float row[kHeadDim];
  std::memcpy(row, acc, sizeof(row));
  for (int64_t i = 0; i < n; ++i) {
    const float pi = p[i];
    const float* __restrict__ v = values + i * kHeadDim;
#pragma omp simd
    for (int64_t d = 0; d < kHeadDim; ++d) row[d] += pi * v[d];
  }
  std::memcpy(acc, row, sizeof(row));
}

template <typename T, typename KV>
void extend_item(const at::Tensor& q, const PagedKV<KV>& kv, const ExtendItem& it, int64_t prefix, int64_t q_row0,
                 int64_t group, float sm_scale, float v_scale, T* out_ptr, std::vector<float>& scratch) {
  const int64_t head_dim = q.size(2), num_heads = q.size(1);
  const int64_t rows = it.rows_tokens * group;
  scratch.resize(rows * head_dim * 2 + rows * (kExtendBlock + 2) + 2 * kExtendBlock * head_dim);
  float* qf = scratch.data();
  float* acc = qf + rows * head_dim;
  float* scores = acc + rows * head_dim;
  float* m = scores + rows * kExtendBlock;
  float* l = m + rows;
  float* keys_t = l + rows;                      // [D, block]: the block's keys transposed
  float* values = keys_t + kExtendBlock * head_dim;  // [block, D]
  const T* q_ptr = q.data_ptr<T>();
  for (int64_t j = 0; j < it.rows_tokens; ++j) {
    for (int64_t g = 0; g < group; ++g) {
      to_float(q_ptr + (q_row0 + it.j0 + j) * q.stride(0) + (it.head * group + g) * q.stride(1),
               qf + (j * group + g) * head_dim, head_dim, sm_scale);
    }
  }
  std::fill(acc, acc + rows * head_dim, 0.f);
  std::fill(m, m + rows, kNegInf);
  std::fill(l, l + rows, 0.f);
  const int64_t* slots = kv.slots(it.b);
  const int64_t first_pos = prefix + it.j0, kv_end = first_pos + it.rows_tokens;
  for (int64_t n0 = 0; n0 < kv_end; n0 += kExtendBlock) {
    const int64_t nb = std::min(kExtendBlock, kv_end - n0);
    for (int64_t n = 0; n < nb; ++n) {
      const int64_t offset = slots[n0 + n] * kv.row_stride + it.head * kv.head_stride;
      const KV* key = kv.k + offset;
      for (int64_t d = 0; d < head_dim; ++d) keys_t[d * kExtendBlock + n] = static_cast<float>(key[d]);
      to_float(kv.v + offset, values + n * head_dim, head_dim, 1.f);
    }
    for (int64_t r = 0; r < rows; ++r) {
      // Keys past this row's own position are masked by never being scored.
      const int64_t visible = std::min(nb, first_pos + r / group - n0 + 1);
      if (visible <= 0) continue;
      float* s = scores + r * kExtendBlock;
      score_row(qf + r * head_dim, keys_t, head_dim, s);
      float* acc_r = acc + r * head_dim;
      softmax_step(s, visible, m[r], l[r], acc_r, head_dim);
      if (head_dim == 64) {
        accumulate_row<64>(s, visible, values, acc_r);
      } else if (head_dim == 128) {
        accumulate_row<128>(s, visible, values, acc_r);
      } else {
        for (int64_t n = 0; n < visible; ++n) axpy(s[n], values + n * head_dim, acc_r, head_dim);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = q_row0 + it.j0 + r / group, head = it.head * group + r % group;
    T* dst = out_ptr + (token * num_heads + head) * head_dim;
    const float inv = v_scale / l[r];  // key 0 is visible to every row, so l > 0
    for (int64_t i = 0; i < head_dim; ++i) dst[i] = static_cast<T>(acc[r * head_dim + i] * inv);
  }
}

template <typename T, typename KV>
void extend_impl(const at::Tensor& q, const PagedKV<KV>& kv, const int64_t* prefix_lens, const int64_t* extend_lens,
                 int64_t batch, int64_t kv_heads, float sm_scale, float v_scale, at::Tensor& out) {
  const int64_t group = q.size(1) / kv_heads;
  std::vector<int64_t> starts(batch);
  std::vector<ExtendItem> items;
  int64_t token = 0;
  for (int64_t b = 0; b < batch; ++b) {
    starts[b] = token;
    token += extend_lens[b];
    for (int64_t j0 = 0; j0 < extend_lens[b]; j0 += kExtendRows) {
      for (int64_t h = 0; h < kv_heads; ++h) items.push_back({b, h, j0, std::min(kExtendRows, extend_lens[b] - j0)});
    }
  }
  TORCH_CHECK(token == q.size(0), "extend_seq_lens sum to ", token, " tokens but q has ", q.size(0));
  T* out_ptr = out.data_ptr<T>();
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const Isa isa = kernels_for(head_dim);
  parallel_items(static_cast<int64_t>(items.size()), [&](int64_t i) {
    thread_local std::vector<float> scratch;
    const ExtendItem& it = items[i];
    if (isa == Isa::kPortable) {
      extend_item(q, kv, it, prefix_lens[it.b], starts[it.b], group, sm_scale, v_scale, out_ptr, scratch);
      return;
    }
    const int64_t size = isa == Isa::kAvx512 ? tandem_cpu::vector_extend_scratch(it.rows_tokens, group, head_dim)
                                             : tandem_cpu::avx2::extend_scratch(it.rows_tokens, group, head_dim);
    if (static_cast<int64_t>(scratch.size()) < size) scratch.resize(size);
    const int64_t token = starts[it.b] + it.j0, first_head = it.head * group;
    const QueryView<T> rows{q.data_ptr<T>() + token * q.stride(0) + first_head * q.stride(1), q.stride(0), q.stride(1)};
    T* out_rows = out_ptr + (token * num_heads + first_head) * head_dim;
    const int64_t first_pos = prefix_lens[it.b] + it.j0;
    if (isa == Isa::kAvx512) {
      tandem_cpu::vector_extend_item<T, KV>(kv, kv.slots(it.b), it.head, first_pos, it.rows_tokens, rows, sm_scale,
                                            v_scale, group, head_dim, out_rows, num_heads * head_dim, scratch.data());
    } else {
      tandem_cpu::avx2::extend_item<T, KV>(kv, kv.slots(it.b), it.head, first_pos, it.rows_tokens, rows, sm_scale,
                                           v_scale, group, head_dim, out_rows, num_heads * head_dim, scratch.data());
    }
  });
}

template <typename F>
void dispatch_dtype(at::ScalarType dtype, const F& f) {
  switch (dtype) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, "tandem_cpu attention supports float32, bfloat16 and float16 queries, not ", dtype);
  }
}

// f(T{}, KV{}): the queries' type and the pool's (the same, an FP8 type, or a 16-bit one under float32 queries:
// --kv-cache-dtype bfloat16/float16 for a float32 model).
template <typename F>
void dispatch_types(const at::Tensor& q, const at::Tensor& k_buffer, const F& f) {
  dispatch_dtype(q.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    switch (k_buffer.scalar_type()) {
      case at::kFloat8_e4m3fn: f(T{}, c10::Float8_e4m3fn{}); break;
      case at::kFloat8_e5m2: f(T{}, c10::Float8_e5m2{}); break;
      case at::kBFloat16:
        if constexpr (std::is_same_v<T, float>) f(T{}, c10::BFloat16{}); else f(T{}, T{});  // q bf16: the same
        break;
      case at::kHalf:
        if constexpr (std::is_same_v<T, float>) f(T{}, c10::Half{}); else f(T{}, T{});
        break;
      default: f(T{}, T{}); break;  // check_common: the pool's dtype is q's
    }
  });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_buffer, const at::Tensor& v_buffer,
                            const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                            const at::Tensor& seq_lens, double sm_scale, double k_scale, double v_scale) {
  check_common(q, k_buffer, v_buffer, req_to_token, req_pool_indices);
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous() && seq_lens.numel() == q.size(0) &&
                  req_pool_indices.numel() == q.size(0),
              "decode: q has one row per request; seq_lens and req_pool_indices one int64 entry each");
  at::Tensor out = at::empty(q.sizes(), q.options());
  if (q.size(0) == 0) return out;
  dispatch_types(q, k_buffer, [&](auto q_tag, auto kv_tag) {
    using T = decltype(q_tag);
    using KV = decltype(kv_tag);
    decode_impl<T, KV>(q, paged_kv<KV>(k_buffer, v_buffer, req_to_token, req_pool_indices),
                       seq_lens.data_ptr<int64_t>(), k_buffer.size(1), static_cast<float>(sm_scale * k_scale),
                       static_cast<float>(v_scale), out);
  });
  return out;
}

at::Tensor extend_attention(const at::Tensor& q, const at::Tensor& k_buffer, const at::Tensor& v_buffer,
                            const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                            const at::Tensor& extend_prefix_lens, const at::Tensor& extend_seq_lens,
                            double sm_scale, double k_scale, double v_scale) {
  check_common(q, k_buffer, v_buffer, req_to_token, req_pool_indices);
  const int64_t batch = req_pool_indices.numel();
  TORCH_CHECK(extend_prefix_lens.scalar_type() == at::kLong && extend_seq_lens.scalar_type() == at::kLong &&
                  extend_prefix_lens.is_contiguous() && extend_seq_lens.is_contiguous() &&
                  extend_prefix_lens.numel() == batch && extend_seq_lens.numel() == batch,
              "extend: extend_prefix_lens and extend_seq_lens need one contiguous int64 entry per request");
  at::Tensor out = at::empty(q.sizes(), q.options());
  if (q.size(0) == 0) return out;
  dispatch_types(q, k_buffer, [&](auto q_tag, auto kv_tag) {
    using T = decltype(q_tag);
    using KV = decltype(kv_tag);
    extend_impl<T, KV>(q, paged_kv<KV>(k_buffer, v_buffer, req_to_token, req_pool_indices),
                       extend_prefix_lens.data_ptr<int64_t>(), extend_seq_lens.data_ptr<int64_t>(), batch,
                       k_buffer.size(1), static_cast<float>(sm_scale * k_scale), static_cast<float>(v_scale), out);
  });
  return out;
}

// "auto" (AVX-512 where the CPU has it, else AVX2 + FMA + F16C, else the portable loops), "avx512" or "avx2" (an
// error where the CPU lacks them) or "portable"; returns the kernels the ops now run: "avx512", "avx2" or "portable".
std::string set_kernel_isa(const std::string& name) {
  TORCH_CHECK(name == "auto" || name == "avx512" || name == "avx2" || name == "portable",
              "set_kernel_isa takes auto, avx512, avx2 or portable, not '", name, "'");
  Isa isa = best_isa();
  if (name == "avx512") isa = Isa::kAvx512;
  if (name == "avx2") isa = Isa::kAvx2;
  if (name == "portable") isa = Isa::kPortable;
  TORCH_CHECK(isa != Isa::kAvx512 || isa_available(isa), "this CPU (or build) has no AVX-512 F/BW/VL/DQ kernels");
  TORCH_CHECK(isa != Isa::kAvx2 || isa_available(isa), "this CPU (or build) has no AVX2 + FMA + F16C kernels");
  g_isa.store(isa);
  return isa_name(isa);
}

// The kernels the ops run now (for head dims up to 128; larger ones always take the portable loops).
std::string kernel_isa() { return isa_name(g_isa.load()); }

}  // namespace

tandem_cpu::VectorIsa tandem_cpu::selected_isa() { return static_cast<tandem_cpu::VectorIsa>(g_isa.load()); }

TORCH_LIBRARY(tandem_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor k_buffer, Tensor v_buffer, Tensor req_to_token, "
        "Tensor req_pool_indices, Tensor seq_lens, float sm_scale, float k_scale=1.0, float v_scale=1.0) -> Tensor");
  m.def("extend_attention(Tensor q, Tensor k_buffer, Tensor v_buffer, Tensor req_to_token, "
        "Tensor req_pool_indices, Tensor extend_prefix_lens, Tensor extend_seq_lens, float sm_scale, "
        "float k_scale=1.0, float v_scale=1.0) -> Tensor");
  m.def("set_kernel_isa(str isa) -> str", &set_kernel_isa);
  m.def("kernel_isa() -> str", &kernel_isa);
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("extend_attention", &extend_attention);
}
