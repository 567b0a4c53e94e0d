// One instantiation per file so the build compiles them in parallel.
#include "forward_kernel.cuh"

namespace fusedattn::cuda {
template void launch_forward_sm90<128, __half>(const Sm90ForwardArgs&, cudaStream_t);
}  // namespace fusedattn::cuda
