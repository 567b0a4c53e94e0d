#include "blas.h"

#include <ATen/native/CPUBlas.h>

namespace fusedattn::cpu {

void matmul(int64_t m, int64_t n, int64_t k, Matrix a, Matrix b, float* c, int64_t ldc,
            bool accumulate) {
  at::native::cpublas::brgemm(m, n, k, a.ld, b.ld, ldc, accumulate, a.data, b.data, c,
                              /*is_vnni=*/false);
}

}  // namespace fusedattn::cpu
