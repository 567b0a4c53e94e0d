#include "blas.h"

#include <ATen/Functions.h>
#include <ATen/ops/addmm_cpu_dispatch.h>

namespace fusedattn::cpu {
namespace {

at::Tensor wrap(const Matrix& m, bool transpose) {
  // from_blob never copies; the const_cast is safe because addmm only reads
  // its matrix operands.
  at::Tensor t = at::from_blob(const_cast<float*>(m.data), {m.rows, m.cols}, {m.ld, 1},
                               at::TensorOptions().dtype(at::kFloat));
  return transpose ? t.t() : t;
}

}  // namespace

void gemm(const Matrix& a, bool transpose_a, const Matrix& b, bool transpose_b,
          float alpha, float beta, float* c, int64_t ldc) {
  const at::Tensor A = wrap(a, transpose_a);
  const at::Tensor B = wrap(b, transpose_b);
  at::Tensor C = at::from_blob(c, {A.size(0), B.size(1)}, {ldc, 1},
                               at::TensorOptions().dtype(at::kFloat));
  // at::cpu:: calls the CPU kernel directly, skipping the dispatcher.
  at::cpu::addmm_out(C, C, A, B, beta, alpha);
}

}  // namespace fusedattn::cpu
