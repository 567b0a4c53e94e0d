// A plan: which kernel serves a call and how it is cut up. One planner per
// device decides it (cpp/cuda/plan.h, cpp/cpu/attention_cpu.h); launchers
// execute it and decide nothing; fusedattn.plan() shows it to Python.
// Nothing here depends on ATen or CUDA.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace fusedattn {

enum class Family : int { Cpu, Sm80, Sm90, Decode, Gemm };

inline const char* family_name(Family f) {
  switch (f) {
    case Family::Cpu: return "cpu";
    case Family::Sm80: return "sm80";
    case Family::Sm90: return "sm90";
    case Family::Decode: return "decode";
    case Family::Gemm: return "gemm";
  }
  return "unknown";
}

// What the caller fixes; every field left at its default is the planner's.
// Users choose num_splits (as FlashAttention 3 does); tests and benchmarks
// force the rest (fusedattn.backends.force).
struct PlanRequest {
  enum class FamilyChoice : int { Auto, Sm80, Sm90, Gemm };
  FamilyChoice family = FamilyChoice::Auto;  // forward and backward
  int num_splits = 0;                        // decode: 0 = the planner's count
  int merge_in_cluster = -1;                 // decode: -1 the planner's answer, 0 never, 1 required
  int warps = 0;                             // decode: 0 = the planner's count, else 4 or 8
  bool deterministic = false;                // backward: torch.use_deterministic_algorithms(True)
};

struct Plan {
  Family family = Family::Cpu;
  int block_m = 0;  // queries per tile (decode: rows of (query head, query) per block; gemm: per block of rows)
  int block_n = 0;  // keys per tile
  int warps = 0;    // per thread block (CPU: 0)
  int head_dim = 0;  // CUDA: the kernel's head dim; q, k, v (d_v) below it are padded with zeros to it
  bool persistent = false;        // sm90 forward: resident blocks that take work items
  int resident_blocks = 0;        // persistent: how many (one per SM; 65536 registers a block leave no room for two)
  bool mask_tiles = false;        // attn_mask sorted into tile lists first (MaskTiles, params.h;
                                  // the backwards' by key tiles)
  bool backward = false;          // a plan of the backward
  int head_splits = 1;            // backward: blocks sharing a kv head's query heads per key block
  bool deterministic = false;     // backward: dQ summed in a fixed order
  int num_splits = 1;             // decode: blocks splitting each sequence's keys
  bool merge_in_cluster = false;  // decode: the splits merge in a thread block cluster
  bool dependent_launch = false;  // decode: blocks may start while the kernel before them ends (sm_90 code)
  bool varlen = false;            // packed sequences (VarlenParams, params.h)
  int64_t work_items = 0;         // varlen: the work list's (sequence, tile) items (cuda/plan.h's order)

  // The backward's dQ added at turns (sm90's deterministic kernels): a turn
  // counter per query tile, and a packed call's key tiles listed last first.
  bool ordered_dq() const { return backward && deterministic && family == Family::Sm90; }

  // "family=sm90 block_m=128 ...": the fields a family uses, for fusedattn.plan().
  std::string describe() const {
    std::string s = std::string("family=") + family_name(family) + " block_m=" + std::to_string(block_m) +
                    " block_n=" + std::to_string(block_n) + " warps=" + std::to_string(warps);
    if (family != Family::Cpu) s += " head_dim=" + std::to_string(head_dim);
    auto flag = [](bool b) { return b ? "true" : "false"; };
    if (family == Family::Sm90) s += std::string(" persistent=") + flag(persistent);
    if (persistent) s += " resident_blocks=" + std::to_string(resident_blocks);
    if (family == Family::Sm80 || family == Family::Sm90) s += std::string(" mask_tiles=") + flag(mask_tiles);
    if (family == Family::Decode)
      s += " num_splits=" + std::to_string(num_splits) + " merge_in_cluster=" + flag(merge_in_cluster) +
           " dependent_launch=" + flag(dependent_launch);
    if (backward) s += " head_splits=" + std::to_string(head_splits) + " deterministic=" + flag(deterministic);
    if (varlen) s += " varlen=true";
    // Packed calls of the CPU and the gemm family run a sequence at a time, the kernels' from a work list.
    if (varlen && family != Family::Cpu && family != Family::Gemm)
      s += std::string(" schedule=") + (ordered_dq() ? "last-first" : "longest-first") +
           " work_items=" + std::to_string(work_items);
    return s;
  }
};

// The gemm family's plan (cpp/ops/gemm_attention.h): as many query rows per
// block as keep a block's float32 scores, batch x heads_q x rows x seqlen_k,
// within score_elements (one row at least; every row when they fit).
inline Plan plan_gemm(int64_t batch_heads_q, int64_t seqlen_q, int64_t seqlen_k, int64_t head_dim,
                      int64_t score_elements, bool backward) {
  const int64_t per_row = batch_heads_q * seqlen_k;
  int64_t rows = per_row > 0 ? score_elements / per_row : seqlen_q;
  rows = rows < 1 ? 1 : rows > seqlen_q ? seqlen_q : rows;
  Plan p;
  p.family = Family::Gemm;
  p.backward = backward;
  p.deterministic = backward;  // no atomics: every sum runs in a fixed order
  p.block_m = static_cast<int>(rows < (int64_t(1) << 30) ? rows : int64_t(1) << 30);
  p.block_n = static_cast<int>(seqlen_k < (int64_t(1) << 30) ? seqlen_k : int64_t(1) << 30);
  p.head_dim = static_cast<int>(head_dim);
  return p;
}

// A launcher handed a plan it cannot run: the planner decided wrongly.
[[noreturn]] inline void throw_planner_bug(const std::string& what) {
  throw std::logic_error("fusedattn: planner bug: " + what);
}

}  // namespace fusedattn
