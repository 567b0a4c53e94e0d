// How warp-specialised kernels split their registers with setmaxnreg (hopper/warpgroup.cuh).
#pragma once

namespace fusedattn::cuda {

// Whether one producer warpgroup at `producer` registers and the other
// threads at `consumer` fit what a block of `threads` got at launch: with
// __launch_bounds__(threads, 1) ptxas gives each thread 65536 / threads,
// rounded down to 8 (168 for 384 threads), and setmaxnreg moves registers
// within that pool, not the SM's 65536; a split that asks for more hangs.
constexpr bool register_split_fits(int threads, int producer, int consumer) {
  return 128 * producer + (threads - 128) * consumer <= threads * (65536 / threads / 8 * 8);
}

}  // namespace fusedattn::cuda
