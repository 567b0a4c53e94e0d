// The operator schemas, defined once; each device adds its kernels with
// TORCH_LIBRARY_IMPL in its own file. Fake functions are registered from
// Python (python/fusedattn/ops.py; the block operators' in gguf_blocks.py),
// and so is forward_varlen's autograd; forward's is C++ (autograd.cpp).
#include <torch/library.h>

TORCH_LIBRARY(fusedattn, m) {
  // family: None (the planner decides) or a family to force, for tests and
  // benchmarks (fusedattn.backends.force); it names the backward's too.
  // window: None or [left, right], a sliding window bottom-right aligned as
  // is_causal (query i sees key j iff i + Nk - Nq - left <= j <= i + Nk - Nq +
  // right; -1 leaves a side open), combined with is_causal and attn_mask.
  // softcap: None or > 0, scaled scores become softcap * tanh(scores /
  // softcap) before attn_mask is added. sinks: None or float32 [Hq], a logit
  // per query head in every row's softmax normaliser that carries no value;
  // lse includes it, and the backward returns its gradient as grad_sinks
  // (an empty tensor without sinks).
  m.def(
      "forward(Tensor q, Tensor k, Tensor v, Tensor? attn_mask=None, bool is_causal=False, "
      "float? scale=None, str? family=None, int[]? window=None, float? softcap=None, Tensor? sinks=None) "
      "-> (Tensor out, Tensor lse)");
  m.def(
      "backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor? attn_mask=None, bool is_causal=False, float? scale=None, str? family=None, int[]? window=None, "
      "float? softcap=None, Tensor? sinks=None) -> (Tensor grad_q, Tensor grad_k, Tensor grad_v, Tensor grad_sinks)");
  // Decoding against a preallocated KV cache: k_new/v_new (if given) are written
  // into the caches at cache_seqlens[b] (in place), then q attends to the first
  // cache_seqlens[b] + Nnew positions of sequence b. num_splits: None (the
  // planner's count) or the blocks each sequence's keys are split over on
  // CUDA; merge_in_cluster and warps force the decode kernel's other choices.
  // With cu_seqlens_q (int32 [B + 1]): q [total_q, Hq, d] packed, sequence b's
  // queries (and new keys: k_new [total_q, Hkv, d]) its rows cu_seqlens_q[b] :
  // cu_seqlens_q[b + 1]; out [total_q, Hq, d_v], lse [Hq, total_q]; the
  // lengths are read on the host and the decode overrides must be None.
  // With block_table (int32 [B, max_blocks]; the CPU only so far) the caches
  // are pages [pages, Hkv, page_size, d]: position p of sequence b is row
  // p % page_size of page block_table[b, p / page_size] (cpp/ops/paged_cache.h).
  m.def(
      "forward_kvcache(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_seqlens, "
      "Tensor? k_new=None, Tensor? v_new=None, bool is_causal=True, float? scale=None, "
      "int? num_splits=None, bool? merge_in_cluster=None, int? warps=None, int[]? window=None, "
      "float? softcap=None, Tensor? sinks=None, Tensor? cu_seqlens_q=None, Tensor? block_table=None) "
      "-> (Tensor out, Tensor lse)");
  // Packed sequences: q [total_q, Hq, d], k and v [total_k, Hkv, d]; sequence
  // b is rows cu_seqlens[b] : cu_seqlens[b + 1] (int32 [B + 1]) and attends
  // to its own keys only, causal and window bottom-right per sequence. lse is float32
  // [Hq, total_q]. max_seqlen_* bound every sequence's length.
  m.def(
      "forward_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, "
      "int max_seqlen_k, bool is_causal=False, float? scale=None, str? family=None, int[]? window=None, "
      "float? softcap=None, Tensor? sinks=None) -> (Tensor out, Tensor lse)");
  m.def(
      "backward_varlen(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor cu_seqlens_q, "
      "Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, bool is_causal=False, float? scale=None, "
      "str? family=None, int[]? window=None, float? softcap=None, Tensor? sinks=None) "
      "-> (Tensor grad_q, Tensor grad_k, Tensor grad_v, Tensor grad_sinks)");
  // The plan the call with these arguments would run (forward, or with
  // backward=True the backward), as "key=value ..." words; nothing is launched.
  m.def(
      "plan(Tensor q, Tensor k, Tensor v, Tensor? attn_mask=None, bool is_causal=False, float? scale=None, "
      "str? family=None, bool backward=False, int[]? window=None, float? softcap=None, Tensor? sinks=None) -> str");
  // The plan forward_varlen (backward=True: backward_varlen) would run with
  // these arguments, its work list included.
  m.def(
      "plan_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, "
      "int max_seqlen_k, bool is_causal=False, float? scale=None, str? family=None, bool backward=False, "
      "int[]? window=None, float? softcap=None, Tensor? sinks=None) -> str");
  // The plan of forward_kvcache with these arguments (it depends on the
  // cache's capacity, not on cache_seqlens). Packed queries (cu_seqlens_q):
  // seqused_k (int32 [B]) holds the keys each sequence attends to, cached
  // and new, which order the work list.
  m.def(
      "plan_kvcache(Tensor q, Tensor k_cache, Tensor v_cache, bool is_causal=True, float? scale=None, "
      "int? num_splits=None, bool? merge_in_cluster=None, int? warps=None, int[]? window=None, "
      "float? softcap=None, Tensor? sinks=None, Tensor? cu_seqlens_q=None, Tensor? seqused_k=None, "
      "Tensor? block_table=None) -> str");
  // The head dims a CUDA kernel is instantiated for (cpp/generate_kernels.py's table).
  m.def("instantiated_head_dims(str kernel) -> int[]");
  // The head dims the CUDA forward (backward) kernels of the current device
  // serve natively; others up to the largest run padded to the next (the planner's table).
  m.def("served_head_dims(bool backward) -> int[]");
  // Weights as a GGUF file stores them (cpp/cpu/gguf_blocks.h): blocks uint8
  // [n, k / block values * block bytes] in format q4_0, q4_1, q5_0, q8_0,
  // q4_K, q5_K or q6_K. The engine's linear layers on the CPU: x [..., k]
  // float32 times W^T, and W's rows in float32. CPU only.
  m.def("block_linear(Tensor x, Tensor blocks, str format) -> Tensor");
  m.def("block_dequantize(Tensor blocks, str format) -> Tensor");
  // Seed 2's naive path (materialises S), the baseline of the GPU benchmark. CUDA only.
  m.def(
      "naive_forward(Tensor q, Tensor k, Tensor v, Tensor? attn_mask=None, bool is_causal=False, "
      "float? scale=None) -> Tensor");
}
