// attn_mask as the CUDA kernels read it (MaskParams: broadcast with stride 0):
// the one place that decodes a mask entry of each kind.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "device_math.cuh"
#include "fusedattn/params.h"
#include "online_softmax.cuh"

namespace fusedattn::cuda {

// The type attn_mask's entries are stored as (None: a placeholder).
template <MaskKind Kind, typename T>
using MaskStorage = std::conditional_t<Kind == MaskKind::AdditiveFloat32, float,
                                       std::conditional_t<Kind == MaskKind::AdditiveInput, T, uint8_t>>;

// attn_mask's entry at offset i as a kind other than None stores it: 0 or
// -inf for a bool mask, the value for an additive one, times log2(e) with
// Log2 (the kernels' base-2 scores). Every CUDA family reads masks through it.
template <MaskKind Kind, typename T, bool Log2 = true>
__device__ __forceinline__ float mask_entry(const void* ptr, int64_t i) {
  constexpr float kUnit = Log2 ? kLog2e : 1.0f;
  static_assert(Kind != MaskKind::None, "no mask has no entries");
  const MaskStorage<Kind, T> entry = static_cast<const MaskStorage<Kind, T>*>(ptr)[i];
  if constexpr (Kind == MaskKind::Bool) {
    return entry ? 0.0f : -INFINITY;
  } else if constexpr (Kind == MaskKind::AdditiveFloat32) {
    return entry * kUnit;
  } else {
    return to_float(entry) * kUnit;
  }
}

// f(std::integral_constant<MaskKind, kind>{}) for a kind other than None: one
// branch, outside the loops that read the mask.
template <typename F>
__device__ __forceinline__ void dispatch_mask_kind(MaskKind kind, F&& f) {
  switch (kind) {
    case MaskKind::Bool: f(std::integral_constant<MaskKind, MaskKind::Bool>{}); break;
    case MaskKind::AdditiveFloat32: f(std::integral_constant<MaskKind, MaskKind::AdditiveFloat32>{}); break;
    default: f(std::integral_constant<MaskKind, MaskKind::AdditiveInput>{}); break;
  }
}

// Host code: f(std::integral_constant<MaskKind, kind>{}) for every kind, None
// included, for launchers whose kernels take the kind as a template argument.
template <typename F>
void dispatch_each_mask_kind(MaskKind kind, F&& f) {
  switch (kind) {
    case MaskKind::None: f(std::integral_constant<MaskKind, MaskKind::None>{}); break;
    case MaskKind::Bool: f(std::integral_constant<MaskKind, MaskKind::Bool>{}); break;
    case MaskKind::AdditiveFloat32: f(std::integral_constant<MaskKind, MaskKind::AdditiveFloat32>{}); break;
    case MaskKind::AdditiveInput: f(std::integral_constant<MaskKind, MaskKind::AdditiveInput>{}); break;
  }
}

// Bytes of one entry of a mask of this kind (inputs on CUDA are 2 bytes).
inline int mask_entry_bytes(MaskKind kind) {
  return kind == MaskKind::Bool ? 1 : kind == MaskKind::AdditiveFloat32 ? 4 : 2;
}

// attn_mask at (row, col) in base-2 score units, the kind decided per entry
// (0 without a mask).
template <typename T>
__device__ __forceinline__ float mask_log2(const MaskParams& m, int64_t base, int64_t row,
                                           int64_t col) {
  const int64_t i = base + row * m.row_stride + col * m.col_stride;
  switch (m.kind) {
    case MaskKind::Bool: return mask_entry<MaskKind::Bool, T>(m.ptr, i);
    case MaskKind::AdditiveFloat32: return mask_entry<MaskKind::AdditiveFloat32, T>(m.ptr, i);
    case MaskKind::AdditiveInput: return mask_entry<MaskKind::AdditiveInput, T>(m.ptr, i);
    default: return 0.0f;
  }
}

}  // namespace fusedattn::cuda
