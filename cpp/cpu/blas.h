// The one GEMM the CPU kernels use, on row-major float32 tiles:
//   C[m x n] = alpha * op(A) * op(B) + beta * C
// where op(X) is X or X^T. It runs on ATen's CPU BLAS (MKL, OpenBLAS or
// oneDNN, whichever PyTorch was built with) single-threaded inside our
// parallel_for. beta = 0 ignores C's previous contents, NaN included.
#pragma once

#include <cstdint>

namespace fusedattn::cpu {

struct Matrix {
  const float* data;
  int64_t rows;  // as stored, before any transpose
  int64_t cols;
  int64_t ld;    // row stride in elements
};

void gemm(const Matrix& a, bool transpose_a, const Matrix& b, bool transpose_b,
          float alpha, float beta, float* c, int64_t ldc);

}  // namespace fusedattn::cpu
