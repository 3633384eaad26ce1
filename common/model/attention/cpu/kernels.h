// Shared declarations of the `cpu` backend's paged attention: the pool view both ops read, the AVX-512 kernels
// (kernels_avx512.cpp) that paged_attention.cpp calls when this CPU has AVX-512 F/BW/VL/DQ, and the AVX2 ones
// (kernels_avx2.cpp) for CPUs with AVX2, FMA and F16C only; elsewhere its portable loops run.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
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

// Keys [start, end) of `slots` that a decode split's thread reads next (the next work item's), or none (null).
struct NextKeys {
  const int64_t* slots = nullptr;
  int64_t start = 0;
  int64_t end = 0;
};

// Pool rows a decode split reads after its current block (its own next block, or the first block of the thread's
// next work item) pulled into L2 one head slice of a K or V row per call of step(), while the current block
// computes. Without it the memory streams only while the first KV head's pass reads the block's rows (prefetching
// them) and idles through the other heads' passes and the P.V pass, which find the rows in L2: a decode batch of
// the small model read its KV at 29 GB/s from DRAM where a plain sum reads 42. K rows first (the first pass needs
// them first), then V rows; at most kTrickleBytes, so the block being computed stays in L2 beside them.
template <typename KV>
class Trickle {
 public:
  static constexpr int64_t kTrickleBytes = 256 << 10;

  // Plans rows slots[start, end) (as many as kTrickleBytes holds) over about `steps` calls of step().
  void plan(const PagedKV<KV>& kv, int64_t kv_heads, int64_t head_dim, const int64_t* slots, int64_t start,
            int64_t end, int64_t steps) {
    const int64_t row_bytes = kv_heads * kv.head_stride * int64_t(sizeof(KV));
    kv_ = &kv;
    slots_ = slots != nullptr ? slots + start : nullptr;
    rows_ = slots != nullptr ? std::max<int64_t>(0, std::min(end - start, kTrickleBytes / (2 * row_bytes))) : 0;
    kv_heads_ = kv_heads;
    slice_lines_ = (head_dim * int64_t(sizeof(KV)) + 63) / 64;
    const int64_t slices = 2 * rows_ * kv_heads;
    per_step_ = steps > 0 ? (slices + steps - 1) / steps : slices;
    left_ = slices;
    row_ = head_ = 0;
    base_ = kv.k;
  }
  // Rows this plan fetches (the first ones of its range).
  int64_t rows() const { return rows_; }
  // The next per_step slices.
  inline void step() {
    for (int64_t i = 0; i < per_step_ && left_ > 0; ++i) fetch_next();
  }
  // Whatever the steps left (a block with fewer calls than planned).
  void finish() {
    while (left_ > 0) fetch_next();
  }

 private:
  inline void fetch_next() {
    const char* p = reinterpret_cast<const char*>(base_ + slots_[row_] * kv_->row_stride + head_ * kv_->head_stride);
    for (int64_t l = 0; l < slice_lines_; ++l) __builtin_prefetch(p + 64 * l, 0, 2);
    --left_;
    if (++head_ < kv_heads_) return;
    head_ = 0;
    if (++row_ < rows_) return;
    row_ = 0;
    base_ = kv_->v;  // the K rows are done
  }

  const PagedKV<KV>* kv_ = nullptr;
  const KV* base_ = nullptr;
  const int64_t* slots_ = nullptr;
  int64_t rows_ = 0, kv_heads_ = 1, slice_lines_ = 0, per_step_ = 0, left_ = 0, row_ = 0, head_ = 0;
};

// Plans `trickle` for what a decode split reads after its block of `steps_keys` keys: its keys [next, end), or the
// first block of `after` (the thread's next split) once its own are done. Every key of the block calls step() at
// least twice a KV head (a scores pass and a P.V pass), kDecodeBlock keys a block.
template <typename KV>
inline void trickle_next(Trickle<KV>& trickle, const PagedKV<KV>& kv, int64_t kv_heads, int64_t head_dim,
                         const int64_t* slots, int64_t next, int64_t end, NextKeys after, int64_t steps_keys) {
  constexpr int64_t kBlock = 128;
  const int64_t steps = 2 * steps_keys * kv_heads;
  if (next < end) {
    trickle.plan(kv, kv_heads, head_dim, slots, next, std::min(next + kBlock, end), steps);
  } else {
    trickle.plan(kv, kv_heads, head_dim, after.slots, after.start,
                 after.slots ? std::min(after.start + kBlock, after.end) : after.start, steps);
  }
}

// Head dims the vector kernels take (up to 8 vectors of 16 floats; a partial last vector is masked).
constexpr int64_t kMaxVectorHeadDim = 128;

// Decode, one split: the query heads [Hq, D] of one request (scaled here) over its keys [start, end), every KV head
// of a pool row at once. scratch holds vector_decode_scratch(...) floats; out is that split's Partial. The first
// `warm` rows of [start, end) are already on their way to L2 (the previous split's Trickle); while its last block
// computes, the split trickles the first rows of `after` and returns how many.
int64_t vector_decode_scratch(int64_t num_heads, int64_t head_dim);
template <typename T, typename KV>
int64_t vector_decode_split(const PagedKV<KV>& kv, const int64_t* slots, int64_t start, int64_t end, QueryView<T> q,
                            float sm_scale, int64_t num_heads, int64_t group, int64_t head_dim, float* scratch,
                            Partial out, int64_t warm, NextKeys after);

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
int64_t decode_split(const PagedKV<KV>& kv, const int64_t* slots, int64_t start, int64_t end, QueryView<T> q,
                     float sm_scale, int64_t num_heads, int64_t group, int64_t head_dim, float* scratch, Partial out,
                     int64_t warm, NextKeys after);

int64_t extend_scratch(int64_t tokens, int64_t group, int64_t head_dim);
template <typename T, typename KV>
void extend_item(const PagedKV<KV>& kv, const int64_t* slots, int64_t head, int64_t first_pos, int64_t tokens,
                 QueryView<T> q, float sm_scale, float v_scale, int64_t group, int64_t head_dim, T* out,
                 int64_t out_row_stride, float* scratch);
}  // namespace avx2

}  // namespace tandem_cpu
