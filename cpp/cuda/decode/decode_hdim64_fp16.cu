// One instantiation per file so the build compiles them in parallel.
#include "decode_kernel.cuh"

namespace fusedattn::cuda {
template void launch_decode<64, __half>(const KVCacheParams&, cudaStream_t);
template int decode_blocks_per_sm<64, __half>();
template int decode_warps<64, __half>();
template int decode_max_active_clusters<64, __half>(int);
}  // namespace fusedattn::cuda
