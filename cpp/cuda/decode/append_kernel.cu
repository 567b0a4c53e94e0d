// The in-place append of forward_kvcache: row t of k_new[b, h] (and v_new)
// goes to position cache_seqlens[b] + t of the caches (through the block
// table where they are paged). One thread per 16-byte
// chunk; the elements are 2 bytes (float16 and bfloat16), which is all the
// copy needs to know.
#include <cstdint>

#include "../common/launch_check.h"
#include "decode_steps.h"
#include "kvcache_common.cuh"

namespace fusedattn::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) append_kernel(const __grid_constant__ KVCacheParams p) {
  const AttentionShape& sh = p.attn.shape;
  const int64_t chunks_per_row = sh.head_dim / 8;
  const int64_t index = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (index >= sh.batch * sh.heads_kv * p.n_new * chunks_per_row) return;
  const int64_t col = index % chunks_per_row * 8, row = index / chunks_per_row;
  const int64_t t = row % p.n_new, head = row / p.n_new % sh.heads_kv, batch = row / p.n_new / sh.heads_kv;
  if (kv_length(p, batch) < 0) return;
  int64_t slot = batch, position = p.cache_seqlens[batch] + t;  // the cache's first index and row
  if (p.block_table != nullptr) {
    slot = p.block_table[batch * p.max_blocks + position / p.page_size];
    position %= p.page_size;
    if (slot < 0 || slot >= p.pages) return;  // the attention kernel gives this sequence NaN
  }

  auto copy = [&](void* cache, const TensorStrides& cs, const void* src, const TensorStrides& ss) {
    const uint16_t* from = static_cast<const uint16_t*>(src) + batch * ss.batch + head * ss.head + t * ss.row + col;
    uint16_t* to = static_cast<uint16_t*>(cache) + slot * cs.batch + head * cs.head + position * cs.row + col;
    *reinterpret_cast<uint4*>(to) = *reinterpret_cast<const uint4*>(from);
  };
  // attn.k and attn.v are the caches: read-only for attention, written here.
  copy(const_cast<void*>(p.attn.k), p.attn.k_strides, p.k_new, p.k_new_strides);
  copy(const_cast<void*>(p.attn.v), p.attn.v_strides, p.v_new, p.v_new_strides);
}

}  // namespace

void launch_append(const KVCacheParams& p, cudaStream_t stream) {
  const AttentionShape& sh = p.attn.shape;
  const int64_t chunks = sh.batch * sh.heads_kv * p.n_new * (sh.head_dim / 8);
  if (chunks == 0) return;
  const int64_t blocks = (chunks + kThreads - 1) / kThreads;
  if (blocks > 2147483647) throw std::runtime_error("fusedattn: k_new/v_new too large for one append launch");
  append_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  FUSEDATTN_CUDA_CHECK(cudaGetLastError());
}

}  // namespace fusedattn::cuda
