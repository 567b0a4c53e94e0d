// The one matrix product the CPU kernels use, on row-major float32 tiles:
//   C[m x n] = A[m x k] B[k x n]        (accumulate = false)
//   C[m x n] += A[m x k] B[k x n]       (accumulate = true)
// It runs on ATen's batch-reduce GEMM (oneDNN's brgemm micro-kernel where the
// CPU has AVX-512, PyTorch's BLAS otherwise), single-threaded inside our
// parallel_for. Kernels transpose operands themselves (see tile.h); with no
// transpose flags and no alpha, the call maps onto brgemm directly.
// m, n and k are at least 1.
//
// brgemm rather than at::cpu::addmm_out: on an AMD CPU MKL takes its generic
// code path and packs both operands on every call, which at the kernels'
// tile shapes makes it the slower of the two (docs/tuning.md).
#pragma once

#include <cstdint>

namespace fusedattn::cpu {

struct Matrix {
  const float* data;
  int64_t ld;  // row stride in elements
};

void matmul(int64_t m, int64_t n, int64_t k, Matrix a, Matrix b, float* c, int64_t ldc,
            bool accumulate);

}  // namespace fusedattn::cpu
