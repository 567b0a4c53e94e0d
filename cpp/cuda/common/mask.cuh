// attn_mask as the kernels read it (MaskParams: broadcast with stride 0).
#pragma once

#include <cmath>
#include <cstdint>

#include "device_math.cuh"
#include "fusedattn/params.h"
#include "online_softmax.cuh"

namespace fusedattn::cuda {

// attn_mask at (row, col) in base-2 score units: 0 or -inf for a bool mask,
// value * log2(e) for an additive one.
template <typename T>
__device__ __forceinline__ float mask_log2(const MaskParams& m, int64_t base, int64_t row,
                                           int64_t col) {
  const int64_t i = base + row * m.row_stride + col * m.col_stride;
  switch (m.kind) {
    case MaskKind::Bool:
      return static_cast<const uint8_t*>(m.ptr)[i] ? 0.0f : -INFINITY;
    case MaskKind::AdditiveFloat32:
      return static_cast<const float*>(m.ptr)[i] * kLog2e;
    case MaskKind::AdditiveInput:
      return to_float(static_cast<const T*>(m.ptr)[i]) * kLog2e;
    default:
      return 0.0f;
  }
}

}  // namespace fusedattn::cuda
