// The one matrix product the CPU kernels use, on row-major float32 tiles:
//   C[m x n] = A[m x k] B[k x n]        (accumulate = false)
//   C[m x n] += A[m x k] B[k x n]       (accumulate = true)
// It runs on ATen's batch-reduce GEMM (oneDNN's brgemm micro-kernel where the
// CPU has AVX-512, PyTorch's BLAS otherwise), single-threaded inside our
// parallel_for. Kernels transpose operands themselves (see tile.h); with no
// transpose flags and no alpha, the call maps onto brgemm directly.
// m, n and k are at least 1.
//
// Measured on the 2-core AMD EPYC (2026-11-30, one thread, 256x256x64 and
// 256x64x256): brgemm 114-117 GFLOP/s, at::cpu::addmm_out (MKL) 97.
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
