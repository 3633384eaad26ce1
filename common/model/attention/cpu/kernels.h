// Shared declarations of the `cpu` backend's paged attention: the pool view both ops read, the AVX-512 kernels
// (kernels_avx512.cpp) that paged_attention.cpp calls when this CPU has AVX-512 F/BW/VL/DQ, and the AVX2 ones
// (kernels_avx2.cpp) for CPUs with AVX2, FMA and F16C only; elsewhere its portable loops run.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <cstdint>

// The vector kernels are compiled on every x86-64 GCC/Clang build (with a target pragma, not -mavx512f, so the
// library still loads on CPUs without AVX-512) and chosen at run time.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define TANDEM_X86_KERNELS 1
#else
#define TANDEM_X86_KERNELS 0
#endif

namespace tandem_cpu {

// The tensors both ops read, as raw pointers and strides. Pool layout (common/memory/kv_pool.py): k / v
// [rows, kv_heads, head_dim], contiguous; position p of request b sits at row req_to_token[req_pool_indices[b], p].
// KV is the queries' type, or an FP8 type (c10::Float8_e4m3fn / Float8_e5m2) whose per-layer scales the ops fold
// into sm_scale (K) and the output's normalization (V).
template <typename KV>
struct PagedKV {
  const KV* k;
  const KV* v;
  int64_t row_stride;   // elements between pool rows
  int64_t head_stride;  // elements between KV heads of one row
  const int64_t* req_to_token;
  int64_t r2t_stride;
  const int64_t* req_pool_indices;

  const int64_t* slots(int64_t b) const { return req_to_token + req_pool_indices[b] * r2t_stride; }
};

struct Partial {  // one split's unnormalized result for every query head of one request
  float* acc;     // [Hq, D]
  float* m;       // [Hq]
  float* l;       // [Hq]
};

// The query rows of one request (decode) or one work item (extend): q[row * row_stride + head * head_stride + d].
template <typename T>
struct QueryView {
  const T* q;
  int64_t row_stride;
  int64_t head_stride;
};

// Head dims the vector kernels take (up to 8 vectors of 16 floats; a partial last vector is masked).
constexpr int64_t kMaxVectorHeadDim = 128;

// Decode, one split: the query heads [Hq, D] of one request (scaled here) over its keys [start, end), every KV head
// of a pool row at once. scratch holds vector_decode_scratch(...) floats; out is that split's Partial.
int64_t vector_decode_scratch(int64_t num_heads, int64_t head_dim);
template <typename T, typename KV>
void vector_decode_split(const PagedKV<KV>& kv, const int64_t* slots, int64_t start, int64_t end, QueryView<T> q,
                         float sm_scale, int64_t num_heads, int64_t group, int64_t head_dim, float* scratch,
                         Partial out);

// Extend, one work item: `tokens` new tokens at positions first_pos.. of one request for the `group` query heads
// of KV head `head` (q already offset to the item's first token and first head); writes the normalized rows, times
// v_scale, to out[token * out_row_stride + g * head_dim + d]. scratch holds vector_extend_scratch(...) floats.
int64_t vector_extend_scratch(int64_t tokens, int64_t group, int64_t head_dim);
template <typename T, typename KV>
void vector_extend_item(const PagedKV<KV>& kv, const int64_t* slots, int64_t head, int64_t first_pos, int64_t tokens,
                        QueryView<T> q, float sm_scale, float v_scale, int64_t group, int64_t head_dim, T* out,
                        int64_t out_row_stride, float* scratch);

// Whether this CPU runs the vector kernels (AVX-512 F, BW, VL, DQ).
bool cpu_has_avx512();

// Whether this CPU runs the AVX2 kernels (AVX2, FMA, F16C).
bool cpu_has_avx2();

// The kernels set_kernel_isa chose (paged_attention.cpp), for the other ops' vector paths to follow.
enum class VectorIsa : int { kPortable, kAvx2, kAvx512 };
VectorIsa selected_isa();

// The AVX2 kernels: the same contracts as vector_decode_split / vector_extend_item above, head dims up to
// kMaxVectorHeadDim, their own scratch sizes.
namespace avx2 {
int64_t decode_scratch(int64_t num_heads, int64_t head_dim);
template <typename T, typename KV>
void decode_split(const PagedKV<KV>& kv, const int64_t* slots, int64_t start, int64_t end, QueryView<T> q,
                  float sm_scale, int64_t num_heads, int64_t group, int64_t head_dim, float* scratch, Partial out);

int64_t extend_scratch(int64_t tokens, int64_t group, int64_t head_dim);
template <typename T, typename KV>
void extend_item(const PagedKV<KV>& kv, const int64_t* slots, int64_t head, int64_t first_pos, int64_t tokens,
                 QueryView<T> q, float sm_scale, float v_scale, int64_t group, int64_t head_dim, T* out,
                 int64_t out_row_stride, float* scratch);
}  // namespace avx2

}  // namespace tandem_cpu
