// A ring of Stages buffers, each guarded by mbarriers, used in runs that
// each start at stage 0: use j of a run takes stage j % Stages, and its
// phase parity is that stage's parity at the run's start (bit s of `bits`)
// flipped once per round.
#pragma once

#include <cstdint>

namespace fusedattn::cuda {

template <int Stages>
struct RingPhases {
  uint32_t bits = 0;

  static __device__ __forceinline__ int stage(int j) { return j % Stages; }
  __device__ __forceinline__ uint32_t phase(int j) const {
    return ((bits >> (j % Stages)) ^ static_cast<uint32_t>(j / Stages)) & 1u;
  }
  // After a run of n_tiles uses: stage s was used an odd number of times or not.
  __device__ __forceinline__ void end_item(int n_tiles) {
#pragma unroll
    for (int s = 0; s < Stages; ++s)
      if (((n_tiles + Stages - 1 - s) / Stages) & 1) bits ^= 1u << s;
  }
};

}  // namespace fusedattn::cuda
