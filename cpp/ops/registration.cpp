// The operator schemas, defined once; each device adds its kernels with
// TORCH_LIBRARY_IMPL in its own file. Fake functions and autograd are
// registered from Python (python/fusedattn/ops.py).
#include <torch/library.h>

TORCH_LIBRARY(fusedattn, m) {
  m.def(
      "forward(Tensor q, Tensor k, Tensor v, Tensor? attn_mask=None, bool is_causal=False, "
      "float? scale=None) -> (Tensor out, Tensor lse)");
  m.def(
      "backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor? attn_mask=None, bool is_causal=False, float? scale=None) "
      "-> (Tensor grad_q, Tensor grad_k, Tensor grad_v)");
  // Decoding against a preallocated KV cache: k_new/v_new (if given) are written
  // into the caches at cache_seqlens[b] (in place), then q attends to the first
  // cache_seqlens[b] + Nnew positions of sequence b.
  m.def(
      "forward_kvcache(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_seqlens, "
      "Tensor? k_new=None, Tensor? v_new=None, bool is_causal=True, float? scale=None) "
      "-> (Tensor out, Tensor lse)");
  // The split count forward_kvcache's CUDA kernel would take for this q and
  // cache (the host's rule: it sees the cache's capacity, not cache_seqlens),
  // for tests and tuning. CUDA only.
  m.def("decode_num_splits(Tensor q, Tensor k_cache) -> int");
  // Seed 2's naive path (materialises S), the baseline of the GPU benchmark. CUDA only.
  m.def(
      "naive_forward(Tensor q, Tensor k, Tensor v, Tensor? attn_mask=None, bool is_causal=False, "
      "float? scale=None) -> Tensor");
}
