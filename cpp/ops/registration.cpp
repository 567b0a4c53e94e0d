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
  // Seed 2's naive path (materialises S), the baseline of the GPU benchmark. CUDA only.
  m.def(
      "naive_forward(Tensor q, Tensor k, Tensor v, Tensor? attn_mask=None, bool is_causal=False, "
      "float? scale=None) -> Tensor");
}
