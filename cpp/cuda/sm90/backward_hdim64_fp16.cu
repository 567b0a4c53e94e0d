// One instantiation per file so the build compiles them in parallel.
#include "backward_kernel.cuh"

namespace fusedattn::cuda {
template void launch_backward_sm90<64, __half>(const Sm90BackwardArgs&, cudaStream_t);
}  // namespace fusedattn::cuda
