// One instantiation per file so the build compiles them in parallel.
#include "forward_kernel.cuh"

namespace fusedattn::cuda {
template void launch_forward_sm90<64, __nv_bfloat16>(const Sm90ForwardArgs&, cudaStream_t);
}  // namespace fusedattn::cuda
