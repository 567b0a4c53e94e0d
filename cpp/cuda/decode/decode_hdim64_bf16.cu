// One instantiation per file so the build compiles them in parallel.
#include "decode_kernel.cuh"

namespace fusedattn::cuda {
template void launch_decode<64, __nv_bfloat16>(const KVCacheParams&, cudaStream_t);
template int decode_blocks_per_sm<64, __nv_bfloat16>();
template int decode_warps<64, __nv_bfloat16>();
template int decode_max_active_clusters<64, __nv_bfloat16>(int);
}  // namespace fusedattn::cuda
