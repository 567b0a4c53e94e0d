// Plain parameter structs shared by the operator layer and every kernel.
//
// The operator layer (cpp/ops) validates tensors and fills these; kernels read
// only these. Nothing here depends on ATen, so CUDA kernels can include it and
// stay free of PyTorch.
#pragma once

#include <cstdint>

// Members the CUDA kernels call as well as the host (empty outside nvcc).
#ifdef __CUDACC__
#define FUSEDATTN_HOST_DEVICE __host__ __device__
#else
#define FUSEDATTN_HOST_DEVICE
#endif

namespace fusedattn {

enum class DType : int { Float32, Float16, BFloat16 };

// How attn_mask enters the scores.
//   None:             no mask.
//   Bool:             one byte per element, nonzero = may attend.
//   AdditiveFloat32:  float32 added to the scaled scores.
//   AdditiveInput:    same dtype as q, added to the scaled scores.
enum class MaskKind : int { None, Bool, AdditiveFloat32, AdditiveInput };

// attn_mask sorted into a kernel's tiles (cpp/cuda/common/mask_tiles.h), so
// that tiles it hides are never visited and tiles it leaves whole read none of
// it. Query tile qt of (batch, head) owns row r = batch * batch_stride + head *
// head_stride + qt: counts[r] entries of list(r), each a key tile and whether
// it must read the mask (entry()), in increasing key tile order. A stride is 0
// where the mask broadcasts.
struct MaskTiles {
  const int32_t* lists = nullptr;   // [rows, capacity]
  const int32_t* counts = nullptr;  // [rows]
  uint8_t* classes = nullptr;       // [rows, capacity]: the sort's workspace
  int64_t rows = 0, capacity = 0, batch_stride = 0, head_stride = 0;

  FUSEDATTN_HOST_DEVICE int64_t row(int64_t batch, int64_t head, int64_t query_tile) const {
    return batch * batch_stride + head * head_stride + query_tile;
  }
  FUSEDATTN_HOST_DEVICE const int32_t* list(int64_t row) const { return lists + row * capacity; }

  // A list entry, and what it holds.
  template <typename Int>
  FUSEDATTN_HOST_DEVICE static int32_t entry(Int tile, bool reads_mask) {
    return static_cast<int32_t>(2 * tile + (reads_mask ? 1 : 0));
  }
  FUSEDATTN_HOST_DEVICE static int32_t tile_of(int32_t entry) { return entry >> 1; }
  FUSEDATTN_HOST_DEVICE static bool reads_mask(int32_t entry) { return (entry & 1) != 0; }
};

// attn_mask broadcast to [B, Hq, Nq, Nk]. A broadcast dimension has stride 0;
// nothing is materialised.
struct MaskParams {
  MaskKind kind = MaskKind::None;
  const void* ptr = nullptr;
  int64_t batch_stride = 0;
  int64_t head_stride = 0;
  int64_t row_stride = 0;  // along Nq
  int64_t col_stride = 0;  // along Nk
  MaskTiles tiles;          // where a kernel takes them (null otherwise)
};

// Strides of one [B, H, N, d] tensor whose last dimension is contiguous.
struct TensorStrides {
  int64_t batch = 0;
  int64_t head = 0;
  int64_t row = 0;
};

struct AttentionShape {
  int64_t batch = 0;
  int64_t heads_q = 0;
  int64_t heads_kv = 0;
  int64_t seqlen_q = 0;
  int64_t seqlen_k = 0;
  int64_t head_dim = 0;    // of q and k
  int64_t head_dim_v = 0;  // of v and out (CUDA kernels run head_dim_v == head_dim: the operators pad)

  int64_t group_size() const { return heads_q / heads_kv; }
  // Bottom-right causal alignment: query i may see key j iff j <= i + causal_offset.
  int64_t causal_offset() const { return seqlen_k - seqlen_q; }
};

// Packed sequences of different lengths (forward_varlen, backward_varlen): the
// operands are one [1, H, total, d] batch whose rows cu_seqlens cut
// into sequences, each attending to its own keys, causal and windows aligned
// on its own lengths (shape.seqlen_q and seqlen_k hold the totals). The
// kernels take their blocks from a work list of (sequence, tile) pairs in
// launch order, longest first (cpp/cuda/plan.h): block index = item x heads
// + head; the CPU kernels read only cu_seqlens (host memory there) and batch
// (cpu/sequences.h). cu_seqlens_q null: a dense call. Packed queries against a KV
// cache (forward_kvcache with cu_seqlens_q) have seqused_k instead of
// cu_seqlens_k: sequence b's keys are the first seqused_k[b] rows from row
// b x cache_rows of the [1, Hkv, rows, d] view of the cache (its batch
// stride over its row stride; the operators check that K's and V's agree).
struct VarlenParams {
  const int32_t* cu_seqlens_q = nullptr;  // [B + 1], device memory (host memory on the CPU)
  const int32_t* cu_seqlens_k = nullptr;
  int64_t batch = 0;                      // B (the CPU kernels walk the sequences)
  const int32_t* seqused_k = nullptr;     // [B]: a KV cache's lengths, or null
  int64_t cache_rows = 0;
  const int32_t* query_tiles = nullptr;   // [query_items][2]: the forward's and the dQ pass's
  int64_t query_items = 0;
  const int32_t* key_tiles = nullptr;     // [key_items][2]: the backward's key blocks
  int64_t key_items = 0;

  FUSEDATTN_HOST_DEVICE bool on() const { return cu_seqlens_q != nullptr; }
};

struct ForwardParams {
  AttentionShape shape;
  DType dtype = DType::Float32;

  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  float* lse = nullptr;  // contiguous [B, Hq, Nq], natural log

  TensorStrides q_strides, k_strides, v_strides, out_strides;

  float scale = 1.0f;
  bool is_causal = false;
  // A sliding window (FlashAttention's window_size, bottom-right aligned as
  // is_causal): query i sees key j only if
  //   i + causal_offset - window_left <= j <= i + causal_offset + window_right,
  // -1 leaving that side open. is_causal is the right side at 0 on top of it;
  // the operators fold a window of (-1, 0) into is_causal.
  int64_t window_left = -1;
  int64_t window_right = -1;
  MaskParams mask;
  // Soft-capping (Gemma 2): scaled scores become softcap * tanh(scores /
  // softcap) before attn_mask is added; 0 leaves them as they are.
  float softcap = 0.0f;
  // Attention sinks (gpt-oss): float32 [Hq], one logit per query head that
  // joins every row's softmax normaliser and carries no value; null: none.
  // lse then includes it, so the backward's P needs nothing else.
  const float* sinks = nullptr;

  FUSEDATTN_HOST_DEVICE bool has_window() const { return window_left >= 0 || window_right >= 0; }
  // The band's right side with is_causal folded in: 0 under is_causal, else
  // the window's (-1: open).
  FUSEDATTN_HOST_DEVICE int64_t band_right() const { return is_causal ? 0 : window_right; }
  // Whether some key is hidden by position (causal or a window): the CUDA
  // kernels' banded instantiation (cpp/cuda/common/band.cuh).
  FUSEDATTN_HOST_DEVICE bool banded() const { return is_causal || has_window(); }

  // Device workspace for the sm90 forward: one unsigned int, from which its
  // persistent blocks take work items (the launch zeroes it).
  unsigned* work_counter = nullptr;

  VarlenParams varlen;
};

struct BackwardParams {
  ForwardParams fwd;  // q, k, v, out, lse (read only here), shape, mask, scale

  const void* grad_out = nullptr;
  void* grad_q = nullptr;
  void* grad_k = nullptr;
  void* grad_v = nullptr;
  TensorStrides grad_out_strides, grad_q_strides, grad_k_strides, grad_v_strides;

  // Device workspaces, for the CUDA kernels (the CPU's allocate their own):
  // delta = rowsum(grad_out * out), float32 [B, Hq, Nq]; grad_q_accum,
  // float32 [B, Hq, Nq, d], where key blocks add their share of grad_q
  // (sm80: unused when deterministic).
  float* delta = nullptr;
  float* grad_q_accum = nullptr;
  // Same bits on every run (grad_q summed in a fixed order: the sm80 family
  // in a pass of its own, without grad_q_accum; the sm90 family into
  // grad_q_accum at turns counted in dq_turns, int [sm90_backward_dq_turns],
  // which the launch zeroes).
  bool deterministic = false;
  int* dq_turns = nullptr;
  // The query heads of each kv head's group split over this many blocks per
  // key block (when B x Hkv x key blocks alone would leave SMs idle); their
  // dK and dV are then summed in grad_kv_accum, float32 [2, B, Hkv, Nk, d].
  int head_splits = 1;
  float* grad_kv_accum = nullptr;
};

// Upper bound of KVCacheParams::num_splits (the merge holds two split LSEs per lane).
inline constexpr int kMaxDecodeSplits = 64;

// Decoding against a preallocated KV cache (forward_kvcache): a few queries per
// sequence, each sequence at its own length.
struct KVCacheParams {
  // q, k = k_cache, v = v_cache, out, lse, scale, is_causal. shape.seqlen_k is
  // the positions each cache holds (max_len); sequence b attends to its first
  // cache_seqlens[b] + n_new. The caches have 16-byte aligned rows.
  ForwardParams attn;

  // Device memory, [B]: cached positions of each sequence before the append.
  const int32_t* cache_seqlens = nullptr;
  // Paged caches (FlashAttention's block_table), or null: attn.k and attn.v
  // are then [pages, Hkv, page_size, d] (k_strides.batch a page's stride),
  // and position t of sequence b is row t % page_size of page
  // block_table[b * max_blocks + t / page_size]; shape.seqlen_k is
  // max_blocks * page_size. The kernels read an entry only for positions
  // they read (below the sequence's length; a window's first keys not even
  // those); one outside [0, pages) that the attention reads gives the
  // sequence NaN outputs, and the append skips positions whose own entry is
  // outside (the table lives on the device: nothing checks it on the host).
  const int32_t* block_table = nullptr;
  int64_t max_blocks = 0, page_size = 0, pages = 0;

  // [B, Hkv, n_new, d], written into the caches at cache_seqlens[b]; null when n_new = 0.
  int64_t n_new = 0;
  const void* k_new = nullptr;
  const void* v_new = nullptr;
  TensorStrides k_new_strides, v_new_strides;

  // The key range of every (sequence, kv head) is split over num_splits thread
  // blocks. With more than one split, each writes a partial result here,
  // normalised by its own softmax sum, and counts itself in split_arrivals;
  // the last block of each (sequence, kv head, row tile) merges them:
  //   partial_out: float32 [num_splits, B, Hq, Nq, d], partial_lse: [num_splits, B, Hq, Nq],
  //   split_arrivals: int32 [B, Hkv, row tiles], zero before the launch and
  //   zero again after it.
  int num_splits = 1;
  float* partial_out = nullptr;
  float* partial_lse = nullptr;
  int32_t* split_arrivals = nullptr;
  // Instead, with 2-8 splits on sm_90, the splits of a row tile may run as
  // one thread block cluster and merge from each other's shared memory
  // (the planner, cuda::plan_decode, says where): then the three buffers
  // above are not used.
  bool merge_in_cluster = false;
};

}  // namespace fusedattn
