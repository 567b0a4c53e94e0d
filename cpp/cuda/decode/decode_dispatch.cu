// forward_kvcache on CUDA: a plan (plan.cu's) into the compile-time
// instantiation, and the order of the kernels.
#include <stdexcept>

#include "../common/instantiation_dispatch.h"
#include "decode_steps.h"
#include "forward_kvcache.h"

namespace fusedattn::cuda {

void forward_kvcache(const KVCacheParams& p, const Plan& plan, cudaStream_t stream) {
  const AttentionShape& sh = p.attn.shape;
  // Checked before the append, so that a call that throws leaves the caches as they were.
  const bool attends = sh.batch * sh.heads_q * sh.seqlen_q > 0;
  if (attends) {
    if (plan.family != Family::Decode || plan.num_splits != p.num_splits ||
        plan.merge_in_cluster != p.merge_in_cluster)
      throw_planner_bug("forward_kvcache's parameters do not carry its plan's splits");
    if (p.num_splits < 1 || p.num_splits > kMaxDecodeSplits)  // merge_splits: two split LSEs per lane
      throw_planner_bug("num_splits must be in [1, kMaxDecodeSplits]");
    if (p.merge_in_cluster && (p.num_splits < 2 || p.num_splits > kMaxClusterSplits))
      throw_planner_bug("merge_in_cluster needs 2 to kMaxClusterSplits splits");
    if (p.num_splits > 1 && !p.merge_in_cluster &&
        (p.partial_out == nullptr || p.partial_lse == nullptr || p.split_arrivals == nullptr))
      throw std::invalid_argument("fusedattn: num_splits > 1 needs partial_out, partial_lse and split_arrivals");
  }
  if (p.n_new > 0) launch_append(p, stream);
  if (!attends) return;
  dispatch_instantiation(DecodeHeadDims{}, "decode kernel", p.attn.dtype, sh.head_dim, [&](auto head_dim, auto element) {
    launch_decode<decltype(head_dim)::value, decltype(element)>(p, plan, stream);
  });
}

}  // namespace fusedattn::cuda
