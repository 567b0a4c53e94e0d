// The CUDA planner: the one place that turns a call's parameters, what the
// caller asked for and the current device into a plan (family, tiles,
// persistence, splits, cluster merge, warps). Launchers execute plans and
// decide nothing; the rules' figures are in docs/tuning.md.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "fusedattn/params.h"
#include "fusedattn/plan.h"
#include "common/varlen_tile_list.h"

namespace fusedattn::cuda {

// fusedattn.forward and fusedattn.backward, first: the gemm family's plan
// (cpp/ops/gemm_attention.h) where it is forced or no fused kernel takes the
// call (float32; head dims past the kernels'; soft-capping in the
// backward), else nullopt and plan_forward / plan_backward decide. Throws
// std::invalid_argument where a forced sm80 or sm90 cannot take the call.
std::optional<Plan> plan_gemm(const ForwardParams& p, const PlanRequest& request, bool backward);
// plan_gemm for a dense backward with its own operands (grad_out's strides
// included): also the gemm family where only sm90 serves the head dim and
// its tensor maps cannot take the operands as given.
std::optional<Plan> plan_backward_gemm(const BackwardParams& p, const PlanRequest& request);

// forward_kvcache, first: the gemm family's plan (run a sequence at a time,
// the cache lengths read on the host) where no kernel takes the call: the
// caches are read in place, so the decode kernel (contiguous queries) or the
// varlen forward (`packed`) serves float16 and bfloat16 at a head dim it is
// built for with d_v = d.
std::optional<Plan> plan_kvcache_gemm(const ForwardParams& p, bool packed);

// fusedattn.forward: sm90 where this build and device have it and it takes
// the call, else sm80. Throws std::invalid_argument where a forced family
// cannot serve the call, saying why.
Plan plan_forward(const ForwardParams& p, const PlanRequest& request);

// fusedattn.backward (p.deterministic set): the family as for the forward,
// and the split of each kv head's query heads over blocks.
Plan plan_backward(const BackwardParams& p, const PlanRequest& request);

// forward_kvcache: warps, split count and cluster merge of the decode kernel
// for p's shape (p.attn.shape.seqlen_k, the cache's capacity, stands in for
// the lengths, which only the device knows). Throws std::invalid_argument for
// a request the device cannot serve.
Plan plan_decode(const KVCacheParams& p, const PlanRequest& request);

// The work lists a packed call's plan launches (VarlenParams, params.h), as
// (sequence, tile) pairs: the query tiles (the forward's; the deterministic
// backward's dQ pass's) and the key tiles (the backward's). Every tile of
// every sequence is an item, so every row of the outputs is written; those
// that visit the most tiles come first (a longest-processing-time order, as
// FlashAttention 3 schedules varlen work), ties in sequence order; the sm90
// backward's deterministic mode takes each sequence's key tiles from its last
// (key_block_scheduler.cuh says why). Records the launched list's length in
// plan.work_items.
struct VarlenWork {
  std::vector<int32_t> query_tiles, key_tiles;
};
VarlenWork schedule_varlen(const ForwardParams& p, const HostSequences& sequences, Plan& plan);

// The head dims CUDA's forward (backward: its backward) serves natively:
// those of sm80, every call's fallback; the backward's also those only the
// sm90 kernels serve (above d=128) where this device and build run them.
std::vector<int64_t> served_head_dims(bool backward);

// The head dim the forward (or backward) kernels run a call of q/k head dim
// d and v head dim d_v at: the smallest served one at least max(d, d_v) (the
// operators pad q, k and v with zeros to it). Throws std::invalid_argument
// above the largest.
int64_t kernel_head_dim(int64_t d, int64_t d_v, bool backward);

// The head dims a kernel is instantiated for, by generate_kernels.py's names
// ("sm80_forward", "sm80_backward", "sm90_forward", "sm90_forward_masked",
// "sm90_forward_capped", "sm90_backward", "decode"). Throws
// std::invalid_argument for another name.
std::vector<int64_t> instantiated_head_dims(const std::string& kernel);

}  // namespace fusedattn::cuda
