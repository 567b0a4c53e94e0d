// forward_kvcache on CUDA: runtime (dtype, head dim) -> the compile-time
// instantiation, the choice of splits, and the order of the kernels.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <string_view>

#include "../common/instantiation_dispatch.h"
#include "../common/launch_check.h"
#include "decode_steps.h"
#include "forward_kvcache.h"

namespace fusedattn::cuda {
namespace {

// f(std::integral_constant<int, head dim>{}, Element{}) for p's instantiation.
template <typename F>
decltype(auto) dispatch_decode(const KVCacheParams& p, F&& f) {
  return dispatch_instantiation<32, 64, 128>("decode kernel", p.attn.dtype, p.attn.shape.head_dim, f);
}

// Once the GPU is full a split streams at least kMinTilesPerSplit tiles
// (a block's start and end cost about two tiles of streaming) and at most
// kMaxTilesPerSplit (in one long wave the slowest blocks leave a tail), as far
// as kMaxSplitsPerResidentBlock allows. Within those bounds, FlashAttention
// 2's rule: the fewest splits whose last wave is at least 85% as full as the
// best choice's. Figures behind the constants: docs/tuning.md.
constexpr int64_t kMinTilesPerSplit = 16;
constexpr int64_t kMaxTilesPerSplit = 64;
// The host knows the cache's capacity, not cache_seqlens, and the kernel
// divides each sequence's actual keys among the splits, so a cache much longer
// than its lengths would get many short splits: the tile cap forces at most
// this many splits per block an SM holds. More splits pay their start, end and
// merge without reading faster; where two blocks share an SM one streams
// while the other starts or ends, so the cap scales with blocks per SM.
// Caches longer still take splits of at most kMaxTilesPerLongSplit (16K
// keys), beyond which a split leaves a tail again. Filling a wave may ask
// for more.
constexpr int64_t kMaxSplitsPerResidentBlock = 8;
constexpr int64_t kMaxTilesPerLongSplit = 256;

struct BlockSlots {
  int64_t sms, per_sm;  // SMs, and blocks of the instantiation resident on each
};

int splits_for_waves(int64_t blocks_per_split, BlockSlots device, int64_t tiles) {
  const int64_t slots = device.sms * device.per_sm;
  // Below a full wave, more (shorter) splits are free parallelism.
  const int64_t fill = std::max<int64_t>(1, slots / std::max<int64_t>(1, blocks_per_split));
  const int64_t max_splits = std::clamp<int64_t>(
      std::min(tiles, std::max(tiles / kMinTilesPerSplit, fill)), 1, kMaxDecodeSplits);
  // A grid already kMaxWaves deep has no long single wave to cut up (and its
  // partials would only cost memory: B x Hq x Nq x d floats per split).
  constexpr int64_t kMaxWaves = 4;
  auto splits_of = [&](int64_t tiles_per_split) { return (tiles + tiles_per_split - 1) / tiles_per_split; };
  const int64_t capped = std::max(kMaxSplitsPerResidentBlock * device.per_sm, splits_of(kMaxTilesPerLongSplit));
  const int64_t min_splits = blocks_per_split >= kMaxWaves * slots
                                 ? 1
                                 : std::clamp<int64_t>(splits_of(kMaxTilesPerSplit), 1, std::min(capped, max_splits));
  auto efficiency = [&](int64_t s) {
    const double waves = double(blocks_per_split) * s / double(slots);
    return waves / std::ceil(waves);
  };
  double best = 0.0;
  for (int64_t s = min_splits; s <= max_splits; ++s) best = std::max(best, efficiency(s));
  for (int64_t s = min_splits; s <= max_splits; ++s)
    if (efficiency(s) >= 0.85 * best) return static_cast<int>(s);
  return static_cast<int>(min_splits);
}

// The current device's SMs and the instantiation's resident blocks per SM,
// asked of the driver once per device.
template <int HeadDim, typename Element>
BlockSlots block_slots() {
  static std::atomic<int64_t> sms[kMaxCachedDevices], per_sm[kMaxCachedDevices];
  return {once_per_device(sms, [](int) { return int64_t(current_device_sms()); }),
          once_per_device(per_sm, [](int) { return int64_t(std::max(decode_blocks_per_sm<HeadDim, Element>(), 1)); })};
}

}  // namespace

int decode_num_splits(const KVCacheParams& p) {
  const AttentionShape& sh = p.attn.shape;
  const int64_t tiles = (sh.seqlen_k + kDecodeBlockN - 1) / kDecodeBlockN;
  if (const char* forced = std::getenv("FUSEDATTN_DECODE_SPLITS"))
    return static_cast<int>(std::clamp<int64_t>(std::atoi(forced), 1, std::clamp<int64_t>(tiles, 1, kMaxDecodeSplits)));
  const BlockSlots device = dispatch_decode(p, [](auto head_dim, auto element) {
    return block_slots<decltype(head_dim)::value, decltype(element)>();
  });
  return splits_for_waves(decode_items(sh), device, tiles);
}

bool decode_merges_in_cluster(const KVCacheParams& p) {
  const char* env = std::getenv("FUSEDATTN_DECODE_CLUSTER_MERGE");
  const std::string_view mode = env ? env : "";
  if (!mode.empty() && mode != "0" && mode != "1")
    throw std::invalid_argument("fusedattn: FUSEDATTN_DECODE_CLUSTER_MERGE must be 0, 1 or unset, got '" +
                                std::string(mode) + "'");
  const int64_t clusters = decode_items(p.attn.shape);
  // One split merges nothing; an empty grid launches nothing.
  if (mode == "0" || p.num_splits < 2 || clusters == 0) return false;
  const int fit = dispatch_decode(p, [&](auto head_dim, auto element) {
    return decode_max_active_clusters<decltype(head_dim)::value, decltype(element)>(p.num_splits);
  });
  const bool merges = clusters <= fit;
  if (mode == "1" && !merges) {
    // Clusters of a larger grid would run in waves, correctly but slower than
    // the global merge: this rule is the automatic one, required.
    const std::string why =
        p.num_splits > kMaxClusterSplits
            ? "it has " + std::to_string(p.num_splits) + " splits, a cluster holds 2-" +
                  std::to_string(kMaxClusterSplits)
        : fit == 0 ? std::string("the decode kernel has no sm_90 code for this device")
                   : "its grid has " + std::to_string(clusters) + " clusters, the GPU runs " + std::to_string(fit) +
                         " at once";
    throw std::invalid_argument(
        "fusedattn: FUSEDATTN_DECODE_CLUSTER_MERGE=1, but this call's splits cannot merge in clusters: " + why);
  }
  return merges;
}

void forward_kvcache(const KVCacheParams& p, cudaStream_t stream) {
  const AttentionShape& sh = p.attn.shape;
  // Checked before the append, so that a call that throws leaves the caches as they were.
  const bool attends = sh.batch * sh.heads_q * sh.seqlen_q > 0;
  if (attends) {
    dispatch_decode(p, [](auto head_dim, auto element) {  // FUSEDATTN_DECODE_WARPS
      return decode_warps<decltype(head_dim)::value, decltype(element)>();
    });
    if (p.num_splits < 1 || p.num_splits > kMaxDecodeSplits)  // merge_splits: two split LSEs per lane
      throw std::invalid_argument("fusedattn: num_splits must be in [1, kMaxDecodeSplits]");
    if (p.merge_in_cluster && (p.num_splits < 2 || p.num_splits > kMaxClusterSplits))
      throw std::invalid_argument("fusedattn: merge_in_cluster needs 2 to kMaxClusterSplits splits");
    if (p.num_splits > 1 && !p.merge_in_cluster &&
        (p.partial_out == nullptr || p.partial_lse == nullptr || p.split_arrivals == nullptr))
      throw std::invalid_argument("fusedattn: num_splits > 1 needs partial_out, partial_lse and split_arrivals");
  }
  if (p.n_new > 0) launch_append(p, stream);
  if (!attends) return;
  dispatch_decode(p, [&](auto head_dim, auto element) {
    launch_decode<decltype(head_dim)::value, decltype(element)>(p, stream);
  });
}

}  // namespace fusedattn::cuda
