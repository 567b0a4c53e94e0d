#include "plan.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "common/backward_passes.cuh"
#include "common/band.cuh"
#include "common/instantiation_dispatch.h"
#include "common/launch_check.h"
#include "common/mask_tiles.h"
#include "common/varlen_tile_list.h"
#include "decode/forward_kvcache.h"
#include "sm90/forward_sm90.h"
#include "hopper/tensor_maps.h"
#include "tile_size.h"

namespace fusedattn::cuda {
namespace {

template <int... HeadDims>
std::vector<int64_t> values_of(HeadDimList<HeadDims...>) {
  return {HeadDims...};
}

template <typename List>
std::string dims_text(List list) {
  std::string s;
  for (int64_t d : values_of(list)) s += (s.empty() ? "[" : ", ") + std::to_string(d);
  return s + "]";
}

// The family for a call: sm90 where this build and device have it and
// refusal() (why sm90 cannot take the call; empty when it can) is empty,
// else sm80; a forced sm90 that cannot run is an error.
template <typename Refusal>
Family choose_family(PlanRequest::FamilyChoice choice, Refusal refusal) {
  using Choice = PlanRequest::FamilyChoice;
  if (choice == Choice::Gemm)
    throw std::invalid_argument("fusedattn: family gemm was forced, but it serves fusedattn.forward and "
                                "fusedattn.backward only");
  if (choice == Choice::Sm80) return Family::Sm80;
  const bool available = sm90_available();
  if (choice == Choice::Sm90) {
    if (!available)
      throw std::invalid_argument("fusedattn: family sm90 was forced, but this build or device has no sm90 kernels "
                                  "(they need compute capability 9.0 and a build for sm_90a)");
    const std::string why = refusal();
    if (!why.empty()) throw std::invalid_argument("fusedattn: family sm90 was forced, but " + why);
    return Family::Sm90;
  }
  return available && refusal().empty() ? Family::Sm90 : Family::Sm80;
}

// The sm90 forward's keys per tile for this call (tile_size.h): a window's
// items span its width, not Nk, and a packed call's Nk is its total (its
// sequences may be short), so both take the short tiles.
int sm90_forward_tile_keys(const ForwardParams& p) {
  return sm90_forward_block_n(static_cast<int>(p.shape.head_dim), p.banded(), p.mask.kind != MaskKind::None,
                              p.has_window() || p.varlen.on() ? 0 : p.shape.seqlen_k);
}

// A failure of encode_*_operand_maps as a refusal. The refusals below encode
// the maps the launch will (scratch maps, the kernel's boxes), so the
// planner's answer and the launcher's cannot differ.
std::string tensor_map_refusal(const std::string& why) {
  return why.empty() ? why : "the tensor memory accelerator cannot describe " + why;
}

// The sm90 kernels test their band in 32 bits (Band32). Packed calls'
// lengths are their totals here, which bound each sequence.
std::string band32_length_refusal(const AttentionShape& sh, const char* kernel) {
  if (std::max(sh.seqlen_q, sh.seqlen_k) > kBand32MaxLength)
    return std::string("the sm90 ") + kernel + " takes at most 2^30 - 256 keys and queries (packed: in all)";
  return {};
}

std::string sm90_forward_refusal(const ForwardParams& p) {
  const AttentionShape& sh = p.shape;
  const bool masked = p.mask.kind != MaskKind::None;
  // Its K and V tensor maps describe [B, Hkv, N, d] batches, not a cache's rows from b x cache_rows.
  if (p.varlen.seqused_k != nullptr) return "the sm90 forward takes no packed queries against a KV cache yet";
  if (!instantiated(Sm90ForwardHeadDims{}, sh.head_dim))
    return "the sm90 forward has head dims " + dims_text(Sm90ForwardHeadDims{}) + ", got " +
           std::to_string(sh.head_dim);
  if (masked && !instantiated(Sm90ForwardMaskedHeadDims{}, sh.head_dim))
    return "the sm90 forward takes attn_mask at head dims " + dims_text(Sm90ForwardMaskedHeadDims{}) +
           ", got head dim " + std::to_string(sh.head_dim);
  // The kernel folds the scale into its exponent (on every tile attn_mask
  // leaves whole): below FLT_MIN fast math flushes it to 0, and 0 times a
  // hidden score's -inf is NaN. sm80 scales before it masks.
  if (!(p.scale >= FLT_MIN))
    return "the sm90 forward takes a scale of at least FLT_MIN, got " + std::to_string(p.scale);
  // Soft-capped kernels exist without attn_mask only (forward_kernel.cuh).
  if (p.softcap > 0.0f && !instantiated(Sm90ForwardCappedHeadDims{}, sh.head_dim))
    return "the sm90 forward soft-caps at head dims " + dims_text(Sm90ForwardCappedHeadDims{}) + ", got " +
           std::to_string(sh.head_dim);
  if (p.softcap > 0.0f && masked) return "the sm90 forward soft-caps calls without attn_mask only";
  // Its items hold their mask list's offset in 32 bits (registers).
  if (masked) {
    const MaskTiles lists =
        mask_tiles_layout(p, sm90_forward_block_m(static_cast<int>(sh.head_dim)), sm90_forward_tile_keys(p));
    if (lists.rows * lists.capacity >= (int64_t(1) << 31))
      return "the sm90 forward's mask tile lists hold fewer than 2^31 entries, this call's " +
             std::to_string(lists.rows * lists.capacity);
  }
  if (sh.batch * sh.heads_q * sh.seqlen_q == 0) return {};  // nothing is loaded
  // The kernel does row arithmetic in int (and TMA coordinates are int).
  if (std::string why = band32_length_refusal(sh, "forward"); !why.empty()) return why;
  CUtensorMap q_map, k_map, v_map;
  return tensor_map_refusal(encode_forward_operand_maps(
      p, &q_map, &k_map, &v_map, sm90_forward_block_m(static_cast<int>(sh.head_dim)),
      sm90_forward_tile_keys(p)));
}

// Why the sm90 backward cannot take a call at its kernel head dim, short of
// the tensor maps: what the backward's gemm-or-kernel choice can tell before
// the operators pad q, k and v (their padded copies are contiguous).
std::string sm90_backward_rule_refusal(const ForwardParams& p, bool deterministic) {
  const AttentionShape& sh = p.shape;
  // The mode's writers add staged dQ tiles, which at d=256 do not fit (backward_wide_traits.h).
  if (deterministic && (p.mask.kind != MaskKind::None || sh.head_dim > 192))
    return "the sm90 backward's deterministic mode (torch.use_deterministic_algorithms) takes head dims up to 192, "
           "without attn_mask";
  if (!instantiated(Sm90BackwardHeadDims{}, sh.head_dim))
    return "the sm90 backward has head dims " + dims_text(Sm90BackwardHeadDims{}) + ", got " +
           std::to_string(sh.head_dim);
  if (p.mask.kind != MaskKind::None && !instantiated(Sm90BackwardMaskedHeadDims{}, sh.head_dim))
    return "the sm90 backward takes attn_mask at head dims " + dims_text(Sm90BackwardMaskedHeadDims{}) + ", got " +
           std::to_string(sh.head_dim);
  if (p.softcap > 0.0f && !instantiated(Sm90BackwardCappedHeadDims{}, sh.head_dim))
    return "the sm90 backward soft-caps at head dims " + dims_text(Sm90BackwardCappedHeadDims{}) + ", got " +
           std::to_string(sh.head_dim);
  // Soft-capped kernels exist without attn_mask only (backward_kernel.cuh).
  if (p.softcap > 0.0f && p.mask.kind != MaskKind::None)
    return "the sm90 backward soft-caps calls without attn_mask only";
  // TMA coordinates are int, the rows of lse and delta included.
  const int64_t rows = sh.batch * sh.heads_q * sh.seqlen_q;
  if (rows >= (int64_t(1) << 31) || sh.seqlen_k >= (int64_t(1) << 31))
    return "the sm90 backward takes B x Hq x Nq and Nk below 2^31";
  return band32_length_refusal(sh, "backward");  // its softmax tests positions in int
}

std::string sm90_backward_refusal(const BackwardParams& p) {
  const AttentionShape& sh = p.fwd.shape;
  if (std::string why = sm90_backward_rule_refusal(p.fwd, p.deterministic); !why.empty()) return why;
  const int64_t rows = sh.batch * sh.heads_q * sh.seqlen_q;
  // lse's rows are loaded as a 1-D map (the backward's delta and dQ accumulator are its own, aligned).
  if (rows > 0 && reinterpret_cast<uintptr_t>(p.fwd.lse) % 16 != 0)
    return "the tensor memory accelerator cannot describe lse: its data does not start on 16 bytes";
  CUtensorMap q_map, grad_out_map, k_map, v_map;
  return tensor_map_refusal(encode_backward_operand_maps(p, &q_map, &grad_out_map, &k_map, &v_map,
                                                         sm90_backward_block_m(static_cast<int>(sh.head_dim)),
                                                         sm90_backward_block_n(static_cast<int>(sh.head_dim))));
}

// How many blocks share each kv head's query heads per key block (a divisor
// of Hq / Hkv; 1 when deterministic, as the splits' sums are float32
// atomics; and for packed sequences, whose work lists hold no splits):
// enough for B x Hkv x key blocks x splits to fill the device's SMs twice,
// for blocks of keys_per_block keys, blocks_per_sm resident per SM.
int backward_head_splits(const BackwardParams& p, int keys_per_block, int blocks_per_sm) {
  const AttentionShape& sh = p.fwd.shape;
  const int64_t group = sh.heads_q / sh.heads_kv;
  if (p.deterministic || group == 1 || p.fwd.varlen.on()) return 1;
  const int64_t target = 2 * int64_t(blocks_per_sm) * device_sms();
  const int64_t blocks = (sh.seqlen_k + keys_per_block - 1) / keys_per_block * sh.heads_kv * sh.batch;
  for (int64_t s = 1; s < group; ++s)
    if (group % s == 0 && blocks * s >= target) return static_cast<int>(s);
  return static_cast<int>(group);
}

// Decode splits. Once the GPU is full a split streams at least
// kMinTilesPerSplit tiles (a block's start and end cost about two tiles of
// streaming) and at most kMaxTilesPerSplit (in one long wave the slowest
// blocks leave a tail), as far as kMaxSplitsPerResidentBlock allows. Within
// those bounds, FlashAttention 2's rule: the fewest splits whose last wave is
// at least 85% as full as the best choice's.
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
// A grid already this many waves deep has no long single wave to cut up (and
// its partials would only cost memory: B x Hq x Nq x d floats per split).
constexpr int64_t kMaxWaves = 4;

int splits_for_waves(int64_t blocks_per_split, int64_t sms, int64_t per_sm, int64_t tiles) {
  const int64_t slots = sms * per_sm;
  // Below a full wave, more (shorter) splits are free parallelism.
  const int64_t fill = std::max<int64_t>(1, slots / std::max<int64_t>(1, blocks_per_split));
  const int64_t max_splits = std::clamp<int64_t>(
      std::min(tiles, std::max(tiles / kMinTilesPerSplit, fill)), 1, kMaxDecodeSplits);
  auto splits_of = [&](int64_t tiles_per_split) { return (tiles + tiles_per_split - 1) / tiles_per_split; };
  const int64_t capped = std::max(kMaxSplitsPerResidentBlock * per_sm, splits_of(kMaxTilesPerLongSplit));
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

// 8 warps (128-key tiles) where the device holds their ring; at d=128 on a
// device that cannot (sm_80's 163 KB per block), 4.
template <int HeadDim, typename Element>
int decode_warps_for(int requested) {
  if (requested == 0) {
    if (decode_warps_fit<HeadDim, Element>(8)) return 8;
    if (HeadDim > 64 && decode_warps_fit<HeadDim, Element>(4)) return 4;
    throw std::invalid_argument("fusedattn: no decode block fits this device's shared memory per block at head dim " +
                                std::to_string(HeadDim));
  }
  if (!decode_warps_fit<HeadDim, Element>(requested))
    throw std::invalid_argument("fusedattn: decode blocks of " + std::to_string(requested) + " warps were forced, "
                                "but at head dim " + std::to_string(HeadDim) + " this device runs " +
                                (HeadDim > 64 ? "4 or, where a block's shared memory holds them, 8" : "8 only"));
  return requested;
}

// Whether the splits of a row tile merge in a thread block cluster: 2-8
// splits, the kernel's sm_90 code, and every cluster of the grid running at
// once (clusters are scheduled whole; in waves they would be correct but
// slower than the global merge).
template <int HeadDim, typename Element>
bool merges_in_cluster(const KVCacheParams& p, const Plan& plan, int requested) {
  const int64_t clusters = decode_items(p.attn.shape);
  // One split merges nothing; an empty grid launches nothing.
  if (requested == 0 || plan.num_splits < 2 || clusters == 0) return false;
  const int fit = decode_max_active_clusters<HeadDim, Element>(plan.warps, plan.num_splits);
  const bool merges = clusters <= fit;
  if (requested == 1 && !merges) {
    const std::string why =
        plan.num_splits > kMaxClusterSplits
            ? "it has " + std::to_string(plan.num_splits) + " splits, a cluster holds 2-" +
                  std::to_string(kMaxClusterSplits)
        : fit == 0 ? std::string("the decode kernel has no sm_90 code for this device")
                   : "its grid has " + std::to_string(clusters) + " clusters, the GPU runs " + std::to_string(fit) +
                         " at once";
    throw std::invalid_argument("fusedattn: the merge in clusters was forced, but this call's splits cannot merge "
                                "in clusters: " + why);
  }
  return merges;
}

// The kernels run d_v == d at a served head dim: the operators pad to kernel_head_dim.
void check_kernel_head_dims(const AttentionShape& sh, bool backward) {
  if (sh.head_dim != sh.head_dim_v || kernel_head_dim(sh.head_dim, sh.head_dim_v, backward) != sh.head_dim)
    throw std::logic_error("fusedattn: the CUDA kernels take q, k and v padded to kernel_head_dim, got d = " +
                           std::to_string(sh.head_dim) + " and d_v = " + std::to_string(sh.head_dim_v));
}

// Why no fused kernel takes a dense call (empty when one does). Backward
// head dims that only sm90 serves (above sm80's largest) need sm90 to take
// the call at its kernel head dim.
std::string unfused_reason(const ForwardParams& p, const PlanRequest& request, bool backward) {
  const AttentionShape& sh = p.shape;
  if (p.dtype == DType::Float32) return "the CUDA kernels take float16 and bfloat16, got float32";
  const int64_t largest = served_head_dims(backward).back();
  if (std::max(sh.head_dim, sh.head_dim_v) > largest)
    return std::string("the CUDA ") + (backward ? "backward" : "forward") + " kernels take head dims up to " +
           std::to_string(largest) + ", got d = " + std::to_string(sh.head_dim) + " and d_v = " +
           std::to_string(sh.head_dim_v);
  const int64_t kernel_dim = kernel_head_dim(sh.head_dim, sh.head_dim_v, backward);
  if (backward && !instantiated(Sm80BackwardHeadDims{}, kernel_dim)) {
    if (request.family == PlanRequest::FamilyChoice::Sm80)
      return "the sm80 backward has head dims " + dims_text(Sm80BackwardHeadDims{}) + ", got " +
             std::to_string(kernel_dim);
    ForwardParams padded = p;
    padded.shape.head_dim = padded.shape.head_dim_v = kernel_dim;
    return sm90_backward_rule_refusal(padded, request.deterministic);
  }
  return {};
}

// The gemm family's blocks on the GPU: 2^26 float32 scores (256 MB) keep the
// products large and the blocks few (tens of launches each).
Plan gemm_blocks(const AttentionShape& sh, bool backward) {
  return fusedattn::plan_gemm(sh.batch * sh.heads_q, sh.seqlen_q, sh.seqlen_k, sh.head_dim, int64_t(1) << 26,
                              backward);
}

}  // namespace

std::optional<Plan> plan_gemm(const ForwardParams& p, const PlanRequest& request, bool backward) {
  using Choice = PlanRequest::FamilyChoice;
  const std::string why = request.family == Choice::Gemm ? std::string() : unfused_reason(p, request, backward);
  if (request.family != Choice::Gemm && why.empty()) return std::nullopt;
  if (request.family == Choice::Sm80 || request.family == Choice::Sm90)
    throw std::invalid_argument(std::string("fusedattn: family ") + (request.family == Choice::Sm80 ? "sm80" : "sm90") +
                                " was forced, but " + why);
  return gemm_blocks(p.shape, backward);
}

std::optional<Plan> plan_backward_gemm(const BackwardParams& p, const PlanRequest& request) {
  if (std::optional<Plan> plan = plan_gemm(p.fwd, request, /*backward=*/true)) return plan;
  // A call at a head dim only sm90 serves, not padded (a padded copy is
  // contiguous): its tensor maps must take the operands as given (a broadcast
  // k has a stride of 0), else the gemm family.
  const AttentionShape& sh = p.fwd.shape;
  if (instantiated(Sm80BackwardHeadDims{}, kernel_head_dim(sh.head_dim, sh.head_dim_v, true)) ||
      sh.head_dim != sh.head_dim_v || !instantiated(Sm90BackwardHeadDims{}, sh.head_dim))
    return std::nullopt;
  BackwardParams call = p;
  call.deterministic = request.deterministic;
  const std::string why = sm90_backward_refusal(call);
  if (why.empty()) return std::nullopt;
  if (request.family == PlanRequest::FamilyChoice::Sm90)
    throw std::invalid_argument("fusedattn: family sm90 was forced, but " + why);
  return gemm_blocks(sh, /*backward=*/true);
}

std::optional<Plan> plan_kvcache_gemm(const ForwardParams& p, bool packed) {
  const AttentionShape& sh = p.shape;
  // The caches are read (and appended to) in place: no padded copy, so only built head dims and d_v = d.
  const bool built = packed ? instantiated(Sm80ForwardHeadDims{}, sh.head_dim)
                            : instantiated(DecodeHeadDims{}, sh.head_dim);
  if (p.dtype != DType::Float32 && built && sh.head_dim_v == sh.head_dim) return std::nullopt;
  return gemm_blocks(sh, /*backward=*/false);
}

Plan plan_forward(const ForwardParams& p, const PlanRequest& request) {
  const AttentionShape& sh = p.shape;
  check_kernel_head_dims(sh, /*backward=*/false);
  const bool masked = p.mask.kind != MaskKind::None;
  // Causal calls and windows run the banded kernels (common/band.cuh).
  const bool banded = p.banded();
  Plan plan;
  plan.family = choose_family(request.family, [&] { return sm90_forward_refusal(p); });
  if (plan.family == Family::Sm90) {
    const int d = static_cast<int>(sh.head_dim);
    plan.block_m = sm90_forward_block_m(d);
    plan.block_n = sm90_forward_tile_keys(p);
    plan.warps = 4 * (1 + sm90_forward_consumers(d));
    plan.persistent = sm90_forward_persistent(d, banded);
    plan.resident_blocks = plan.persistent ? device_sms() : 0;
  } else {
    plan.block_m = kSm80ForwardBlockM;
    plan.block_n = kSm80ForwardBlockN;
    plan.warps = kSm80Warps;
  }
  plan.mask_tiles = masked;
  plan.head_dim = static_cast<int>(sh.head_dim);
  plan.varlen = p.varlen.on();
  if (plan.varlen && masked) throw_planner_bug("packed sequences take no attn_mask");
  return plan;
}

Plan plan_backward(const BackwardParams& p, const PlanRequest& request) {
  check_kernel_head_dims(p.fwd.shape, /*backward=*/true);
  if (const std::string why = backward_passes_refusal(p.fwd.shape); !why.empty())
    throw std::invalid_argument("fusedattn: " + why);
  const int d = static_cast<int>(p.fwd.shape.head_dim);
  Plan plan;
  plan.backward = true;
  plan.deterministic = p.deterministic;
  plan.family = choose_family(request.family, [&] { return sm90_backward_refusal(p); });
  // plan_gemm sent a head dim only sm90 serves here by sm90's rules; its tensor maps may still refuse.
  if (plan.family == Family::Sm80 && !instantiated(Sm80BackwardHeadDims{}, d))
    throw std::invalid_argument("fusedattn: the CUDA backward at head dim " + std::to_string(d) +
                                " runs on the sm90 kernels only, which cannot take this call: " +
                                sm90_backward_refusal(p));
  int blocks_per_sm = 0;
  if (plan.family == Family::Sm90) {
    plan.block_m = sm90_backward_block_m(d);
    plan.block_n = sm90_backward_block_n(d);
    plan.warps = 4 * (1 + kSm90BackwardConsumers);
    blocks_per_sm = kSm90BackwardBlocksPerSm;
  } else {
    plan.block_m = sm80_backward_block_m(d);
    plan.block_n = kSm80BackwardBlockN;
    plan.warps = kSm80Warps;
    blocks_per_sm = kSm80BackwardBlocksPerSm;
  }
  plan.head_splits = backward_head_splits(p, plan.block_n, blocks_per_sm);
  plan.mask_tiles = p.fwd.mask.kind != MaskKind::None;
  plan.head_dim = d;
  plan.varlen = p.fwd.varlen.on();
  if (plan.varlen && plan.mask_tiles) throw_planner_bug("packed sequences take no attn_mask");
  return plan;
}

Plan plan_decode(const KVCacheParams& p, const PlanRequest& request) {
  const AttentionShape& sh = p.attn.shape;
  // A warp's keys of a tile lie in one page (decode_kernel's PageCursor).
  if (p.block_table != nullptr && (p.page_size <= 0 || p.page_size % kDecodeKeysPerWarp != 0))
    throw std::invalid_argument("fusedattn: on CUDA a paged KV cache's pages hold a multiple of " +
                                std::to_string(kDecodeKeysPerWarp) + " positions (k_cache [pages, Hkv, page_size, d]),"
                                " got page_size " + std::to_string(p.page_size));
  // A window's left side bounds the keys a sequence reads whatever its length.
  const int64_t keys_read = p.attn.window_left >= 0 ? std::min(sh.seqlen_k, p.attn.window_left + sh.seqlen_q)
                                                    : sh.seqlen_k;
  Plan plan;
  plan.family = Family::Decode;
  plan.block_m = kDecodeBlockM;
  plan.head_dim = static_cast<int>(sh.head_dim);
  dispatch_instantiation(DecodeHeadDims{}, "decode kernel", p.attn.dtype, sh.head_dim, [&](auto head_dim,
                                                                                            auto element) {
    constexpr int kHeadDim = decltype(head_dim)::value;
    using Element = decltype(element);
    plan.warps = decode_warps_for<kHeadDim, Element>(request.warps);
    plan.block_n = decode_block_n(plan.warps);
    const int64_t tiles = (keys_read + kDecodeBlockN - 1) / kDecodeBlockN;
    plan.num_splits =
        request.num_splits > 0
            ? static_cast<int>(std::min<int64_t>(request.num_splits, std::clamp<int64_t>(tiles, 1, kMaxDecodeSplits)))
            : splits_for_waves(decode_items(sh), device_sms(), decode_blocks_per_sm<kHeadDim, Element>(plan.warps),
                               tiles);
    plan.merge_in_cluster = merges_in_cluster<kHeadDim, Element>(p, plan, request.merge_in_cluster);
    plan.dependent_launch = decode_dependent_launch<kHeadDim, Element>(plan.warps);
  });
  if (decode_items(sh) * plan.num_splits > kMaxDecodeGrid)
    throw std::invalid_argument("fusedattn: B x Hkv x splits x query row tiles of a KV-cache call must fit one launch "
                                "(2^31 - 1 blocks), got " + std::to_string(decode_items(sh) * plan.num_splits));
  return plan;
}

VarlenWork schedule_varlen(const ForwardParams& p, const HostSequences& sequences, Plan& plan) {
  if (!plan.varlen) throw_planner_bug("schedule_varlen takes a packed call's plan");
  if (sequences.cu_q[sequences.batch] >= (int64_t(1) << 31) || sequences.cu_k[sequences.batch] >= (int64_t(1) << 31))
    throw std::invalid_argument("fusedattn: packed sequences take fewer than 2^31 rows");
  VarlenWork work;
  if (!plan.backward) {
    work.query_tiles = tile_list(p, sequences, plan.block_m, plan.block_n, /*by_keys=*/false);
    plan.work_items = static_cast<int64_t>(work.query_tiles.size() / 2);
    return work;
  }
  work.key_tiles = tile_list(p, sequences, plan.block_n, plan.block_m, /*by_keys=*/true, plan.ordered_dq());
  if (plan.deterministic && plan.family == Family::Sm80)  // the dQ pass's
    work.query_tiles = tile_list(p, sequences, kSm80DqBlockM, plan.block_n, false);
  plan.work_items = static_cast<int64_t>(work.key_tiles.size() / 2);
  return work;
}

std::vector<int64_t> served_head_dims(bool backward) {
  if (!backward) return values_of(Sm80ForwardHeadDims{});
  std::vector<int64_t> dims = values_of(Sm80BackwardHeadDims{});
  if (sm90_available())
    for (int64_t d : values_of(Sm90BackwardHeadDims{}))
      if (std::find(dims.begin(), dims.end(), d) == dims.end()) dims.push_back(d);
  std::sort(dims.begin(), dims.end());
  return dims;
}

int64_t kernel_head_dim(int64_t d, int64_t d_v, bool backward) {
  const std::vector<int64_t> served = served_head_dims(backward);
  for (int64_t dim : served)
    if (dim >= std::max(d, d_v)) return dim;
  throw std::invalid_argument(std::string("fusedattn: on CUDA the ") + (backward ? "backward" : "forward") +
                              " takes head dims d and d_v up to " + std::to_string(served.back()) + ", got d = " +
                              std::to_string(d) + " and d_v = " + std::to_string(d_v));
}

std::vector<int64_t> instantiated_head_dims(const std::string& kernel) {
  std::string names;
  for (const NamedHeadDims& list : kNamedHeadDims) {
    if (kernel == list.name) return std::vector<int64_t>(list.dims, list.dims + list.count);
    names += (names.empty() ? "" : ", ") + std::string(list.name);
  }
  throw std::invalid_argument("fusedattn: no kernel named '" + kernel + "'; the kernels are " + names);
}

}  // namespace fusedattn::cuda
