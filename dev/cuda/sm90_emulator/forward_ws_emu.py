"""Emulation of the warp-specialised sm90 forward (cpp/cuda/sm90/forward_kernel.cuh on wip/sm90-d64-persistent
@ bd9a8a8: persistent blocks at d=128 and at d=64 under causal): a producer thread loading, per work item, Q and K, V
tiles of kBlockN keys into two-stage rings (full/empty mbarriers), and kConsumers consumer warpgroups (3 at d=64, 2 at
d=128) that take turns issuing their wgmmas over named barriers 1..kConsumers (round robin; the last consumer gives the
initial arrival, every turn ends with an arrival, consumer 0 takes one extra turn after its last item).
Work items are query blocks in BlockOrder::at<IsCausal> order (common/block_order.h, made by make_query_block_order
in launch_sm90_forward_kernel). Where kSm90Persistent<HeadDim, IsCausal> (forward_traits.h:35-36: d=128, and d=64
under causal) the grid is min(items, SM count) blocks (G["sms"], SM_COUNT = 132 by default; tests use 1-3 to keep
emulation fast): a block's first item is blockIdx.x, later ones gridDim.x + atomicAdd(p.work_counter, 1) (a Counter
the launch zeroes with cudaMemsetAsync only when the grid is smaller than the items; such blocks then run
concurrently under one scheduler), and the producer hands each item's index to the consumers through a shared-memory
slot guarded by q_full / q_empty (n_items: the end of the work). Every item starts at ring stage 0 with per-stage
phase bits carried across items (`phases`, end_item_phases); items without keys (causal Nq > Nk) get a plain q_full
arrival and an immediate q_empty release. At d=64 non-causal a block per item (the producer returns, the consumers
break after one item).
kBlockN = sm90_forward_block_n(HeadDim, IsCausal, HasMask, Nk) (forward_traits.h:24-27): 176 at d=128 without
attn_mask, under causal from CAUSAL_WIDE_TILE_KEYS keys, 128 elsewhere; the kernel takes it as its BlockN template
argument and the host encodes K/V boxes of that height (sm90_dispatch.cu:87-88).

Reuses the rung-2 backward's machinery (backward_ws_emu.py): every warp, the producer thread and every TMA copy is a
coroutine under a seeded random scheduler with skewed speeds; shared memory carries the vector-clock race detector
(mbarrier phases, bar.sync/bar.arrive, wgmma issue/wait); TMA 4-D boxes zero-filled outside (d, N, H, B); wgmma
executed by ptx_model (descriptors, absolute 128B swizzle, CLayout/ALayout fragments, shape validity). Added here: a
named-barrier model with bar.arrive (counts, generations, arrivals left at exit), a stage oracle (a ring stage or sQ
overwritten, or the item slot rewritten, before all 4 kConsumers warps released the previous use; a full barrier
passed before its copies landed; producer and consumers disagreeing on a load's stage), per-element write accounting
of out and lse, per-item/per-tile expect-tx vs delivered-bytes accounting of every full barrier, the item slot as
race-checked shared memory (written by the producer, read by lane 0 of each consumer warp; warp granularity, so a
read by another lane is not told apart), and the work counter (every item taken exactly once, atomics only on a
zeroed counter and none in a grid of one block per item). acc, m_i and l_i start as NaN (uninitialised) until each
item's reset.

Line numbers (":NN") refer to forward_kernel.cuh @ bd9a8a8 unless another file is named.
"""
import random

import numpy as np

import backward_emu as be
import backward_ws_emu as ws
import ptx_model
from ptx_model import kmajor_addresses, mnmajor_addresses

MAXWARPS = 12
ws.NWARPS = MAXWARPS          # RaceSmem tracks reads of up to 12 consumer warps (agents 1..12)
KLN2 = np.float32(0.6931471805599453)
Hazard, Deadlock, Wait, MBarrier, Clocks = ws.Hazard, ws.Deadlock, ws.Wait, ws.MBarrier, ws.Clocks
Agents, schedule = ws.Agents, ws.schedule


CAUSAL_WIDE_TILE_KEYS = 16384  # forward_traits.h kSm90CausalWideTileKeys; a run may lower it to emulate the wide causal
                               # kernel on small problems


def sm90_forward_block_n(head_dim, is_causal, has_mask, seqlen_k=0):     # forward_traits.h sm90_forward_block_n
    if head_dim != 128 or has_mask:
        return 128
    return 176 if not is_causal or seqlen_k >= CAUSAL_WIDE_TILE_KEYS else 128


def sm90_persistent(head_dim, is_causal):                                # forward_traits.h:35-36 kSm90Persistent
    return head_dim == 128 or is_causal


class Traits:                                                            # forward_traits.h:38-65
    def __init__(self, D, is_causal=False, has_mask=False, consumers=None, block_n=None):
        self.kConsumers = consumers or (3 if D == 64 else 2)
        self.kThreads = 128 * (1 + self.kConsumers)
        self.kBlockM = 64 * self.kConsumers
        # block_n: the BlockN template argument (launch_forward_sm90), or a negative-control override (Knobs.block_n)
        self.kBlockN = block_n or sm90_forward_block_n(D, is_causal, has_mask)
        self.kStages = 2
        self.kSlabs = D // 64
        self.kQBytes = self.kBlockM * D * 2
        self.kTileBytes = self.kBlockN * D * 2
        self.kProducerRegisters = 24
        self.kConsumerRegisters = 160 if self.kConsumers == 3 else 240
        assert 128 * self.kProducerRegisters + 128 * self.kConsumers * self.kConsumerRegisters <= 65536   # :55-56
        self.kBarriersOffset = self.kQBytes + 2 * self.kStages * self.kTileBytes   # :61
        self.kSmemBytes = self.kBarriersOffset + (2 + 4 * self.kStages) * 8 + 4 + 1024   # :62 (+ the item slot)
        assert D in (64, 128)                                            # :63


# ============================================================ block order (common/block_order.h @ a91ea4f)
class BlockOrder:                                                        # block_order.h:31-50
    def __init__(self, blocks_per_pair, pairs, pairs_per_group=1):
        u32 = lambda x: int(x) & 0xFFFFFFFF                              # the fields are unsigned
        self.blocks_per_pair, self.pairs, self.pairs_per_group = u32(blocks_per_pair), u32(pairs), u32(pairs_per_group)

    def at(self, reverse, index):                                        # :39-47 (unsigned arithmetic)
        M = 0xFFFFFFFF
        group_blocks = (self.pairs_per_group * self.blocks_per_pair) & M
        group, within = index // group_blocks, index % group_blocks
        first_pair = (group * self.pairs_per_group) & M
        left = (self.pairs - first_pair) & M
        group_pairs = left if left < self.pairs_per_group else self.pairs_per_group
        rank = within // group_pairs
        return ((first_pair + within % group_pairs) & M,
                ((self.blocks_per_pair - 1 - rank) & M) if reverse else rank)

    def blocks(self):                                                    # :49
        return self.blocks_per_pair * self.pairs


SM_COUNT = 132                          # cudaDevAttrMultiProcessorCount of an H200; G["sms"] overrides
L2_BYTES_H200 = 50 * 1024 * 1024        # cudaDevAttrL2CacheSize of an H100/H200 (GH100: 50 MiB); G["l2_bytes"] overrides


def make_block_order(pairs, blocks_per_pair, bytes_per_pair, group_for_l2, what, l2_bytes):   # block_order.h:57-71
    if pairs * blocks_per_pair > 2147483647:
        raise RuntimeError("fusedattn: " + what + " exceeds one launch (2^31 - 1 blocks)")
    pairs_per_group = 1
    if group_for_l2 and pairs > 1:
        if bytes_per_pair > 0:
            pairs_per_group = int(l2_bytes) // 2 // bytes_per_pair
        pairs_per_group = min(max(pairs_per_group, 1), pairs)          # std::clamp(ppg, 1, pairs)
    return BlockOrder(blocks_per_pair, pairs, pairs_per_group)


def make_query_block_order(G, block_m, element_bytes, is_causal):        # block_order.h:75-80
    group_size = G["hq"] // G["hkv"]
    return make_block_order(G["B"] * G["hq"], (G["nq"] + block_m - 1) // block_m,
                            2 * G["nk"] * G["d"] * element_bytes // group_size, is_causal, "B x Hq x query blocks",
                            G.get("l2_bytes", L2_BYTES_H200))


class Knobs:
    """Negative-control knobs; every default is the kernel's code."""
    def __init__(self, **kw):
        self.consumers = kw.get("consumers", None)                 # traits: 3 at d=64, 2 at d=128
        self.initial_by = kw.get("initial_by", None)               # :292 last consumer (None) or this one
        self.final_skip = kw.get("final_skip", False)              # :344 (True: c1dfc5c's `if (!last_consumer)`)
        self.next_turn = kw.get("next_turn", None)                 # :182 1 + (c + 1) % kC
        self.q_slab = kw.get("q_slab", None)                       # :193 consumer * 64 * 128
        self.q_box_rows = kw.get("q_box_rows", None)               # sm90_dispatch.cu:87 box height = kBlockM
        self.visible_plus = kw.get("visible_plus", 1)              # :265 ... - col0 + 1
        self.needs_masking = kw.get("needs_masking", None)         # :249 (None: kernel) or a replacement fn
        self.mask_mode = kw.get("mask_mode", "visible")            # "visible" (:257-273) or "old" (051b261)
        self.empty_xor = kw.get("empty_xor", 1)                    # :127 phase(j) ^ 1
        self.empty_count = kw.get("empty_count", None)             # :106, :110-111 4 * kConsumers
        self.release_k_early = kw.get("release_k_early", False)    # :331 moved above :329 wait<1>
        self.wait1 = kw.get("wait1", 1)                            # :329 wgmma_wait<1>
        self.tma_late = kw.get("tma_late", 0.0)
        # the key tile (c1dfc5c): every default is the kernel's / host's code
        self.block_n = kw.get("block_n", None)                     # :47 kBlockN (None: the launch's BlockN)
        self.kv_box_rows = kw.get("kv_box_rows", None)             # sm90_dispatch.cu:88 K/V box height
        self.k_desc_rows = kw.get("k_desc_rows", None)             # :194 k_major_descriptor(k_tile, kBlockN, kk)
        self.v_desc_rows = kw.get("v_desc_rows", None)             # :206 mn_major_descriptor(v_tile, kBlockN, kk)
        self.tile_expect = kw.get("tile_expect", None)             # :128 expect kTileBytes
        self.pv_steps = kw.get("pv_steps", None)                   # :205 kBlockN / 16 k-steps of P V
        # attn_mask (:216-243, :274-275): "kernel", or a broken variant for negative controls
        self.mask_variant = kw.get("mask_variant", "kernel")
        # persistent blocks (0351716): every default is the kernel's / host's code
        self.persistent = kw.get("persistent", None)               # launch and kernel: kSm90Persistent (None) or this
        self.q_release = kw.get("q_release", "kernel")             # :318/:332 q_empty after the wait completing the
        #   item's last S; "early": before that wait; "first": after S_0 whatever n_tiles
        self.slot_before_wait = kw.get("slot_before_wait", False)  # :135-136 slot written before the q_empty wait
        self.q_empty_wait = kw.get("q_empty_wait", True)           # :135 the producer's q_empty wait
        self.extra_turn = kw.get("extra_turn", True)               # :368 consumer 0's extra turn
        self.carry_phases = kw.get("carry_phases", True)           # :98-102, :153, :348 end_item_phases
        self.q_full_parity = kw.get("q_full_parity", None)         # :294 item & 1 (None) or fn(item)
        self.memset = kw.get("memset", True)                       # :389 cudaMemsetAsync of the counter
        self.sentinel = kw.get("sentinel", True)                   # :137-140 the n_items slot and its q_full arrival
        # kernel sites ("producer" :155, "consumers" :366) that keep the d=128-only rule of b7c24d3 (Tr::kPersistent)
        # while the launch (:385) follows kSm90Persistent: they differ at d=64 causal only
        self.d128_only_at = kw.get("d128_only_at", ())
        self.tags = kw.get("tags", False)
        self.stats = kw.get("stats", None)


class NamedBarriers:
    """bar.sync / bar.arrive id, 256: hardware barrier `id` completes a generation when `threads` threads have
    arrived (sync or arrive); sync waits for the generation it joined. Warp granularity (32 threads)."""
    def __init__(self):
        self.count = {}
        self.acc = {}
        self.gen = {}
        self.released = {}
        self.log = []

    def arrive(self, bid, total, vc, who, kind):
        cnt = self.count.get(bid, 0) + 32
        acc = vc.copy() if self.acc.get(bid) is None else np.maximum(self.acc[bid], vc)
        g = self.gen.get(bid, 0)
        self.log.append((bid, g, who, kind))
        if cnt == total:
            self.released[(bid, g)] = acc
            self.gen[bid] = g + 1
            self.count[bid], self.acc[bid] = 0, None
        else:
            self.count[bid], self.acc[bid] = cnt, acc
        return g

    def leftovers(self):
        return {b: c for b, c in self.count.items() if c}


class Counter:
    """p.work_counter: one device unsigned that attention_cuda_ops.cpp:110 allocates uninitialised (at::empty);
    launch_sm90_forward_kernel zeroes it (cudaMemsetAsync, :389) only when the grid is smaller than the items."""
    POISON = 0x5EEDF00D

    def __init__(self):
        self.value, self.zeroed, self.adds = self.POISON, False, 0

    def atomic_add(self, x):                                              # atomicAdd(unsigned*, unsigned): old value
        old = self.value
        self.value = (old + x) & 0xFFFFFFFF
        self.adds += 1
        return old


def run_block(bx, G, fmt, rng, kn=None, oracle=None, tag_log=None, proto=None, dyn_base=0, launch=None,
              agents=None, counter=None, tma_bound=None):
    """One CTA (blockIdx.x = bx) of sm90_forward_kernel<HeadDim, BlockN, T, IsCausal, HasMask>
    (forward_kernel.cuh:42-372); `launch` is what host_launch returns (instantiation, block order, box heights, grid,
    persistence). With `agents` (an Agents) the block's coroutines join it, named "b<bx>:...", and the caller
    schedules them (blocks of one launch that share the work counter) and then calls the returned finish(), which
    runs the exit checks and returns the block's RaceSmem; without, the block runs alone and its RaceSmem returns."""
    kn = kn or Knobs()
    launch = launch or host_launch(G, kn)
    alone = agents is None
    if alone:
        agents = Agents()
    counter = counter or Counter()
    D = G["d"]
    IsCausal, HasMask = launch["inst"]
    Tr = Traits(D, IsCausal, HasMask, kn.consumers, kn.block_n or launch["block_n"])   # :46 (BlockN: the launch's)
    kC, kBlockM, kBlockN, kStages = Tr.kConsumers, Tr.kBlockM, Tr.kBlockN, Tr.kStages   # :47
    kNTiles, kDTiles = kBlockN // 8, D // 8                               # :48
    persistent = launch["persistent"]                                     # :49 kPersistent (or Knobs.persistent)
    producer_persistent = D == 128 if "producer" in kn.d128_only_at else persistent
    consumers_persistent = D == 128 if "consumers" in kn.d128_only_at else persistent
    grid = launch["grid"]                                                 # gridDim.x
    order = launch["order"]
    n_items = order.blocks()                                              # :68
    NW = 4 * kC
    assert NW <= MAXWARPS
    assert Tr.kSmemBytes <= 227 * 1024     # cudaFuncSetAttribute(MaxDynamicSharedMemorySize) limit on sm_90 (:378)
    assert 128 * Tr.kProducerRegisters + 128 * kC * Tr.kConsumerRegisters <= 65536
    pre = "b%d:" % bx

    smem_ = ws.RaceSmem()
    base = ((be.WINDOW + dyn_base + 1023) & ~1023) - be.WINDOW            # :52
    sQ = base                                                             # :53
    sK = sQ + Tr.kQBytes                                                  # :54
    sV = sK + kStages * Tr.kTileBytes                                     # :55
    bars_at = base + Tr.kBarriersOffset                                   # :56-61
    slot_at = bars_at + (2 + 4 * kStages) * 8                             # :64 item_slot = v_empty + kStages
    assert slot_at + 4 <= dyn_base + Tr.kSmemBytes and bars_at % 8 == 0 and slot_at % 4 == 0

    nq, nk, hq, hkv = G["nq"], G["nk"], G["hq"], G["hkv"]
    causal_offset = nk - nq                                               # :74

    class Item:                                                           # begin_item (:77-86)
        def __init__(self, index):
            pair, qblock = order.at(IsCausal, index)                      # :78 args.order.at<IsCausal>(index)
            self.index = index
            self.batch, self.head = pair // hq, pair % hq                 # :79-80 (unsigned)
            self.head_kv = self.head // (hq // hkv)                       # :81
            self.row0 = qblock * kBlockM                                  # :82
            self.rows = min(kBlockM, nq - self.row0)                      # :83
            self.key_end = max(0, min(nk, self.row0 + self.rows + causal_offset)) if IsCausal else nk   # :84
            self.n_tiles = (self.key_end + kBlockN - 1) // kBlockN        # :85
            for v in (self.row0, self.rows, causal_offset, self.key_end, self.row0 + self.rows + causal_offset,
                      self.batch, self.head, qblock):
                assert -2 ** 31 <= v < 2 ** 31, "int overflow"
            assert 0 <= self.batch < G["B"] and 0 <= self.row0 < nq and self.rows > 0, "item outside the problem"

    def phase_fns():
        """`phases`, phase(j), end_item_phases (:95-102): per thread, the same arithmetic in both roles."""
        st = [0]

        def phase(j):
            return ((st[0] >> (j % kStages)) ^ (j // kStages)) & 1

        def end_item(n_tiles):
            if not kn.carry_phases:
                return
            for s_ in range(kStages):
                if ((n_tiles + kStages - 1 - s_) // kStages) & 1:
                    st[0] ^= 1 << s_
        return phase, end_item

    if proto is not None:
        proto["items"] = []

    n_tma = tma_bound if tma_bound is not None else Tr.kSlabs * (1 + 2 * Item(bx).n_tiles) + 4
    NC = 1 + MAXWARPS + n_tma
    clocks = Clocks(NC)
    q_full = MBarrier("q_full", 1)                                        # :105-112
    q_empty = MBarrier("q_empty", kn.empty_count or 4 * kC)
    k_full = [MBarrier("k_full%d" % s, 1) for s in range(kStages)]
    v_full = [MBarrier("v_full%d" % s, 1) for s in range(kStages)]
    ecount = kn.empty_count or 4 * kC
    k_empty = [MBarrier("k_empty%d" % s, ecount) for s in range(kStages)]
    v_empty = [MBarrier("v_empty%d" % s, ecount) for s in range(kStages)]
    nb = NamedBarriers()
    start = np.ones(NC, np.int64)
    for a in range(1 + MAXWARPS):
        clocks.new(a, start)                                              # __syncthreads :115

    regs_log = {}
    next_tma = [1 + MAXWARPS]
    ALL = set(range(1, 1 + NW))
    # Oracle bookkeeping, counted independently by each side (not through the kernel's stage/phase arithmetic):
    # the producer's n-th load of ring r is load (r, n); a consumer warp's n-th full wait / n-th release of ring r
    # refers to load (r, n); Q and the item slot by the loop's item count.
    landed = {}       # ("k"|"v", n) / ("q", item) -> copies landed
    released = {}     # ("k"|"v", n) / ("q", item) -> set of warps that released it
    load_stage = {}   # ("k"|"v", n) -> the stage the producer loaded it into
    last_load = {}    # (ring, stage) -> the producer's latest load n into it
    expected, delivered = {}, {}   # (ring, item, j) -> bytes announced by expect-tx / completed by the boxes

    # ---------------------------------------------------------------- TMA
    def tma(dst_bytes_fn, bar, nbytes, what, lkey, dkey, need, prev):
        k = next_tma[0]
        next_tma[0] += 1
        assert k < NC, "more TMA copies than the clock bound"
        vc = clocks.new(k, clocks.vc[0])

        def body():
            if kn.tma_late and rng.random() < kn.tma_late:
                yield None
            yield None
            addr, data = dst_bytes_fn()
            if oracle is not None and need is not None and released.get(need, set()) != ALL:
                oracle.append("TMA %s (load %s) before all %d warps released %s (%d did)"
                              % (what, lkey, NW, need, len(released.get(need, ()))))
            if kn.stats is not None and prev is not None:
                key_ = "TMA %s lands while a warp still reads the previous tile" % lkey[0]
                kn.stats[key_] = kn.stats.get(key_, 0) + (released.get(prev, set()) != ALL)
            smem_.write(addr, data, vc, k, True, "TMA " + what)
            landed[lkey] = landed.get(lkey, 0) + 1
            delivered[dkey] = delivered.get(dkey, 0) + nbytes
            bar.complete_tx(nbytes, vc)
        agents[pre + "tma%d" % k] = body()

    def box_load(dst, name, col0, row, hd, b, box_rows, bar, lkey, dkey, need=None, prev=None):   # tma.cuh
        # cp.async.bulk.tensor.4d ... mbarrier::complete_tx::bytes (PTX ISA 9.7.9.25.5.1): the box of the map,
        # {64, box_rows, 1, 1} 16-bit elements, lands at dst with CU_TENSOR_MAP_SWIZZLE_128B and completes
        # box_rows * 64 * 2 bytes on the mbarrier, the whole box even where it lies past the tensor (those
        # elements are written as zeros: CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE). The 128B swizzle is a function of
        # the absolute smem address bits [9:7] -> [6:4] (alt_swizzle_model.py), so a slab that the wgmma
        # descriptors read with base_offset 0 must start on a 1024-byte boundary (PTX ISA 9.7.15.5.1.2.2,
        # "base offset": 0 when the pattern starts 1024-aligned); 176 rows x 128 bytes = 22528 = 22 x 1024.
        assert dst % 1024 == 0, "128B-swizzled TMA destination not 1024-aligned"
        # cuTensorMapEncodeTiled: 0 < boxDim[i] <= 256; inner box 64 x 2 = 128 bytes <= the 128B swizzle span
        assert 0 < box_rows <= 256, "TMA boxDim > 256"
        tma(lambda: ws.swizzled_box_bytes(dst, ws.tma_box_4d(G, name, col0, row, hd, b, box_rows)), bar,
            box_rows * 128, "%s box" % name, lkey, dkey, need, prev)

    q_box = kn.q_box_rows or launch["q_box"]                              # sm90_dispatch.cu:87 (Q map's box)
    kv_box = kn.kv_box_rows or launch["kv_box"]                           # sm90_dispatch.cu:88 (K, V maps' box)
    slot_bytes = np.arange(slot_at, slot_at + 4)

    # ---------------------------------------------------------------- producer (:118-159)
    def producer():
        vc = clocks.vc[0]
        for w in range(4):
            regs_log[(0, w)] = Tr.kProducerRegisters                       # :120 whole warpgroup
        yield None                                                        # :121 threads 1..127 return
        phase, end_item = phase_fns()
        seq = {"k": 0, "v": 0}

        def load_tile(name, ring, full, empty, j, it, item):              # :126-132
            stage = j % kStages
            par = phase(j) ^ kn.empty_xor                                 # :127
            yield Wait(lambda: empty[stage].test_parity(par), lambda: empty[stage].acquire(vc, par),
                       "%s_empty[%d] parity %d" % (name, stage, par))
            tile_bytes = kn.tile_expect or Tr.kTileBytes
            full[stage].arrive(vc, tile_bytes); vc[0] += 1                # :128
            expected[(name, item, j)] = tile_bytes
            n = seq[name]
            seq[name] += 1
            need = last_load.get((name, stage))
            need = None if need is None else (name, need)
            last_load[(name, stage)] = n
            load_stage[(name, n)] = stage
            for slab in range(Tr.kSlabs):                                 # :129-131 (box height: the host's map)
                box_load(ring + stage * Tr.kTileBytes + slab * kBlockN * 128, name, 64 * slab, j * kBlockN,
                         it.head_kv, it.batch, kv_box, full[stage], (name, n), (name, item, j), need,
                         (name, n - 1) if n >= 1 else None)
            yield None

        def write_slot(value, item):                                      # :136 *item_slot = index
            if oracle is not None and item >= 1 and released.get(("q", item - 1), set()) != ALL:
                oracle.append("item slot of item %d written before all %d warps released item %d (%d did)"
                              % (item, NW, item - 1, len(released.get(("q", item - 1), ()))))
            smem_.write(slot_bytes, np.frombuffer(np.uint32(value & 0xFFFFFFFF).tobytes(), np.uint8), vc, 0, False,
                        "the producer's item-slot write")
            vc[0] += 1

        index = bx                                                        # :133 blockIdx.x
        item = 0
        while True:                                                       # :134
            qpar = (item & 1) ^ 1
            if kn.slot_before_wait:
                write_slot(index, item)
            if kn.q_empty_wait:
                yield Wait(lambda qpar=qpar: q_empty.test_parity(qpar),
                           lambda qpar=qpar: q_empty.acquire(vc, qpar), "q_empty parity %d" % qpar)   # :135
            if not kn.slot_before_wait:
                write_slot(index, item)                                   # :136
            if index >= n_items:                                          # :137
                if kn.sentinel:
                    q_full.arrive(vc); vc[0] += 1                         # :138
                return                                                    # :139
            it = Item(index)                                              # :141 begin_item
            if proto is not None:
                proto["items"].append(dict(index=index, n_tiles=it.n_tiles, block=(it.batch, it.head, it.row0)))
            if it.n_tiles == 0:                                           # :142
                q_full.arrive(vc); vc[0] += 1                             # :143
            else:
                q_full.arrive(vc, Tr.kQBytes); vc[0] += 1                 # :145
                expected[("q", item, 0)] = Tr.kQBytes
                for slab in range(Tr.kSlabs):                             # :146-147
                    box_load(sQ + slab * kBlockM * 128, "q", 64 * slab, it.row0, it.head, it.batch, q_box, q_full,
                             ("q", item), ("q", item, 0), ("q", item - 1) if item >= 1 else None)
                for j in range(it.n_tiles):                               # :148-151
                    yield from load_tile("k", sK, k_full, k_empty, j, it, item)
                    if j > 0:
                        yield from load_tile("v", sV, v_full, v_empty, j - 1, it, item)
                yield from load_tile("v", sV, v_full, v_empty, it.n_tiles - 1, it, item)   # :152
                end_item(it.n_tiles)                                      # :153
            if not producer_persistent:                                   # :155 a block per item
                return
            if grid < n_items:                                            # :157
                if not counter.zeroed:
                    smem_.hz("atomicAdd on p.work_counter, which this launch did not zero (value %#x)" % counter.value)
                index = (grid + counter.atomic_add(1)) & 0xFFFFFFFF       # warp_uniform(.., 1u): thread 0's value
            else:
                index = n_items
            item += 1
            yield None

    # ---------------------------------------------------------------- wgmma plumbing
    RF = [dict() for _ in range(kC)]
    groups = [dict() for _ in range(kC)]
    wg_model = ptx_model.Wgmma(None, fmt)

    class CheckSmem:
        def __init__(self):
            self.mem = smem_.mem
            self.ctx = None

        def check_async_read(self, addrs):
            b = np.asarray(addrs, np.int64).ravel()
            b = np.concatenate([b, b + 1])
            c, vcs, what = self.ctx
            for v in vcs:
                smem_._raw(b, v, True, what)
            smem_.r_pending[b[:, None], np.arange(4 * c, 4 * c + 4)[None, :]] = True
            self.read_bytes.append(b)
    csm = CheckSmem()
    wg_model.smem = csm

    def wg_issue(c, w, key, fn, what):
        """Warp w of consumer c reaches the wgmma group `key` (.sync.aligned): the 4th warp's issue executes it."""
        grp = groups[c].setdefault(key, dict(vcs={}, done=False, reads=None, order=None))
        grp["vcs"][w] = clocks.vc[1 + 4 * c + w].copy()
        if len(grp["vcs"]) == 4:
            csm.ctx = (c, list(grp["vcs"].values()), what)
            csm.read_bytes = []
            with np.errstate(all="ignore"):
                fn()
            grp["reads"] = np.concatenate(csm.read_bytes) if csm.read_bytes else np.zeros(0, np.int64)
            grp["done"] = True

    committed = {}   # (c, w) -> list of group keys in commit order

    def commit(c, w, key):
        committed.setdefault((c, w), []).append(key)

    def wg_wait_group(c, w, pending, what):
        """wgmma.wait_group pending: every group of this warp but the newest `pending` is complete."""
        agent = 1 + 4 * c + w
        keys = committed.get((c, w), [])
        need = keys[:len(keys) - pending] if pending else list(keys)
        grps = [groups[c][k] for k in need]

        def acq():
            for grp in grps:
                b = grp["reads"]
                smem_.r_pending[b, agent - 1] = False
                smem_.r_epoch[b, agent - 1] = np.maximum(smem_.r_epoch[b, agent - 1], clocks.vc[agent][agent])
            for k in need:
                keys.remove(k)
        return Wait(lambda: all(g_["done"] for g_ in grps), acq, "wgmma wait<%d> %s" % (pending, what))

    def tag_bits(a):
        a = np.asarray(a)
        return smem_.mem[a].astype(np.int64) | (smem_.mem[a + 1].astype(np.int64) << 8)

    def do_ss(c, desc_a, desc_b, kk, j, index):                           # wgmma_ss<T, kBlockN> (wgmma.cuh:169-182)
        assert kBlockN == 64 or kBlockN in (128, 176), "wgmma.cuh:171 static_assert"   # TransB = false here
        # kBlockN 176: wgmma_ss_m64n176k16_{f16,bf16} (wgmma.cuh:90-97, 139-146): .m64n176k16.f32.{f16,bf16}
        # with 88 f32 D registers, scale-d = accumulate, imm-scale-a/b 1, imm-trans-a/b 0 (both K-major).
        # Valid because PTX ISA 9.7.15.5.1 allows .m64nNk16 for N = 8..256 in steps of 8 for .f16/.bf16 with f32
        # D; ptx_model.Wgmma.ss checks that, reads B through the K-major canonical layout over N = 176 rows
        # (22 core-matrix groups of 8 rows, SBO = 1024 apart, ptx_model.kmajor_addresses) and places D by
        # CLayout_64xN with N = 176 (the PTX ISA's D fragment: row 16 warp + g + 8 (i%4 >= 2), column
        # 8 (i / 4) + 2 t + i % 2 for register i < N/2 = 88, ptx_model.clayout_64xN).
        if tag_log is not None:       # keyed by the work item (the block of the one-block-per-item grid)
            tag_log.append(("S", index, c, j, kk, tag_bits(kmajor_addresses(desc_a, 64)[0]),
                            tag_bits(kmajor_addresses(desc_b, kBlockN)[0]).T))
        RF[c]["s"] = wg_model.ss(RF[c]["s"], desc_a, desc_b, kBlockN, kk > 0, 1, 1, 0, 0)

    def do_rs(c, a_regs, desc_b, kk, j, index):                           # wgmma_rs<T, HeadDim> (wgmma.cuh:184-194)
        assert D in (64, 128), "wgmma.cuh:186 static_assert"
        # B = V read MN-major (imm-trans-b 1) from a [key][d] slab pair: canonical MN-major 128B layout
        # ((T,8,m),(8,k)) : ((1,T,LBO),(8T,SBO)) (PTX ISA 9.7.15.5.1.2.1.3), k-step kk at +2048 kk (16 key rows of
        # 128 bytes), SBO 1024 (8 key rows), LBO = kBlockN * 128 to the next 64 columns of d (the second slab):
        # 22528 at kBlockN = 176, within the descriptor's 14-bit (x >> 4) field. kBlockN / 16 = 11 k-steps at 176;
        # the last reads key rows 160-175, bytes [20480, 22528) of each slab, the slab's end.
        if tag_log is not None:
            tag_log.append(("PV", index, c, j, kk, a_regs.copy(), tag_bits(mnmajor_addresses(desc_b, D)[0])))
        RF[c]["acc"], _, _ = wg_model.rs(RF[c]["acc"], a_regs, desc_b, D, True, 1, 1, 1)

    scale_log2 = np.float32(np.float32(G["scale"]) * be.KLOG2E)           # :167

    def quad_max(x):                                                      # device_math.cuh:142-145
        ln = np.arange(32)
        x = np.maximum(x, x[ln ^ 1])
        return np.maximum(x, x[ln ^ 2])

    def quad_sum(x):
        ln = np.arange(32)
        x = (x + x[ln ^ 1]).astype(np.float32)
        return (x + x[ln ^ 2]).astype(np.float32)

    # ---------------------------------------------------------------- attn_mask (:216-243, :274-276)
    def mask_value(M, idx):
        """The value_at lambdas of :233-241 (base-2 units, float32)."""
        if ((idx < 0) | (idx >= M["buf"].size)).any():
            M["oob"] += int(((idx < 0) | (idx >= M["buf"].size)).sum())
            idx = np.clip(idx, 0, M["buf"].size - 1)
        v = M["buf"][idx]
        if M["kind"] == "bool":
            return np.where(v != 0, np.float32(0), np.float32(-np.inf)).astype(np.float32)
        if M["kind"] == "f32":
            return (v.astype(np.float32) * be.KLOG2E).astype(np.float32)
        return (fmt.dec(v).astype(np.float32) * be.KLOG2E).astype(np.float32)   # to_float(T) * kLog2e

    def record_mask_reads(M, idx, r, cc, batch, head):
        """Each read: its buffer index must be one some in-range position maps to (M["allowed"]), and the logical
        (row, col) of the register must be in range and visible (row < Nq, col < Nk, causal col <= row + Nk - Nq);
        counts[b, h, row, col] += 1 for the exactly-once check."""
        inb = (idx >= 0) & (idx < M["buf"].size)
        M["outside"] += int((~inb).sum()) + int((~M["allowed"][idx[inb]]).sum())
        bad = (r >= nq) | (cc >= nk) | (r < 0) | (cc < 0)
        if G["causal"]:
            bad |= cc > r + (nk - nq)
        M["hidden_reads"] += int(bad.sum())
        ok = ~bad
        np.add.at(M["counts"], (batch, head, r[ok], cc[ok]), 1)

    # ---------------------------------------------------------------- consumer warps (:161-368)
    def consumer_warp(c, w):
        agent = 1 + 4 * c + w
        vc = clocks.vc[agent]
        regs_log[(1 + c, w)] = Tr.kConsumerRegisters                       # :162
        lane = np.arange(32)
        g, t = lane // 4, lane % 4                                        # :165
        warp_row = w * 16                                                 # :166
        mine = slice(32 * w, 32 * w + 32)
        RF[c].setdefault("acc", np.full((128, D // 2), np.nan, np.float32))   # :170 uninitialised until :303
        RF[c].setdefault("s", np.zeros((128, kBlockN // 2), np.float32))
        RF[c].setdefault("p_a", {})
        m_i = np.full((32, 2), np.nan, np.float32)                       # :171 uninitialised until :304-305
        l_i = np.full((32, 2), np.nan, np.float32)
        my_turn = 1 + c                                                   # :182
        next_turn = (1 + (c + 1) % kC) if kn.next_turn is None else kn.next_turn(c, kC)
        initial_by = (kC - 1) if kn.initial_by is None else kn.initial_by
        last = c == kC - 1                                                # :181
        q_off = c * 64 * 128 if kn.q_slab is None else kn.q_slab(c)
        phase, end_item = phase_fns()
        waits_n = {"k": 0, "v": 0}     # this warp's full waits / releases per ring (oracle: the producer's load n)
        rels_n = {"k": 0, "v": 0}
        cur = {}                       # the current item (begin_item :300) and wg_row0 (:301)

        def take_turn():                                                  # :183 bar.sync my_turn, 256
            gen_ = nb.arrive(my_turn, 256, vc, (c, w), "sync")
            vc[agent] += 1

            def acq():
                np.maximum(vc, nb.released[(my_turn, gen_)], out=vc)
                vc[agent] += 1
            return Wait(lambda: (my_turn, gen_) in nb.released, acq, "bar.sync %d" % my_turn)

        def pass_turn():                                                  # :184 bar.arrive next_turn, 256
            nb.arrive(next_turn, 256, vc, (c, w), "arrive")
            vc[agent] += 1

        def issue_scores(j):                                              # :187-196
            k_tile = sK + (j % kStages) * Tr.kTileBytes
            index = cur["it"].index

            def f():
                RF[c]["s"] = np.full((128, kBlockN // 2), np.nan, np.float32)
                for kk in range(D // 16):                                 # :192-194
                    do_ss(c, be.k_major_descriptor(sQ + q_off, kBlockM, kk),
                          be.k_major_descriptor(k_tile, kn.k_desc_rows or kBlockN, kk), kk, j, index)
            wg_issue(c, w, ("S", index, j), f, "S_%d of item %d" % (j, index))
            commit(c, w, ("S", index, j))

        def issue_pv(j):                                                  # :198-208
            v_tile = sV + (j % kStages) * Tr.kTileBytes
            index = cur["it"].index

            def f():
                for kk in range(kn.pv_steps or kBlockN // 16):            # :205-206
                    do_rs(c, RF[c]["p_a"][kk], be.mn_major_descriptor(v_tile, kn.v_desc_rows or kBlockN, kk), kk, j,
                          index)
            wg_issue(c, w, ("PV", index, j), f, "PV_%d of item %d" % (j, index))
            commit(c, w, ("PV", index, j))

        def add_mask(col0, s, force=False):                               # :216-243
            M = G["mask"]
            it, wg_row0 = cur["it"], cur["wg_row0"]
            b0 = cur["first"] if kn.mask_variant == "stale_base" else it   # control: the first item's base
            mask_base = b0.batch * M["strides"][0] + b0.head * M["strides"][1]   # :217
            rs_, cs_ = M["strides"][2], M["strides"][3]
            var = kn.mask_variant
            row_offset = np.zeros((32, 2), np.int64)
            for h in range(2):                                            # :219-222
                row_offset[:, h] = (mask_base + (wg_row0 + warp_row + g + 8 * h).astype(np.int64) * rs_
                                    + (col0 + (t if var == "col_t" else 2 * t)).astype(np.int64) * cs_)
            row_valid = np.stack([wg_row0 + warp_row + g < nq, wg_row0 + warp_row + g + 8 < nq], 1)   # :223
            if var == "no_row_valid":
                row_valid[:] = True
            for nt in range(kNTiles):                                     # :224-231
                for e in range(4):
                    sel = row_valid[:, e >> 1] & (s[:, nt, e] != -np.inf)
                    if var in ("no_hidden_test", "before_hide") or force:
                        sel = row_valid[:, e >> 1].copy()
                    if not sel.any():
                        continue
                    idx = row_offset[sel, e >> 1] + (nt * 8 + (e & 1)) * cs_
                    # independent bookkeeping: the logical (row, col) this register holds
                    r = (wg_row0 + warp_row + g + 8 * (e >> 1))[sel]
                    cc = (col0 + nt * 8 + 2 * t + (e & 1))[sel]
                    record_mask_reads(M, idx, r, cc, it.batch, it.head)
                    s[sel, nt, e] = (s[sel, nt, e] + mask_value(M, idx)).astype(np.float32)

        def softmax(j, s):                                                # :247-280
            it, wg_row0 = cur["it"], cur["wg_row0"]
            key_end = it.key_end
            col0 = j * kBlockN
            if kn.needs_masking is None:                                  # :249
                needs = col0 + kBlockN > key_end or (IsCausal and col0 + kBlockN - 1 > wg_row0 + causal_offset)
            else:
                needs = kn.needs_masking(col0, key_end, wg_row0, causal_offset)
            s *= scale_log2                                               # :250-256 (or the exponent's FFMA, :278)
            if HasMask and kn.mask_variant == "before_hide":   # control: mask added, then hidden
                add_mask(col0, s, force=True)
            if needs:
                if kn.mask_mode == "visible":                             # :257-273
                    vis = np.zeros((32, 2), np.int64)
                    for h in range(2):
                        v_ = np.full(32, key_end - col0, np.int64)
                        if IsCausal:
                            v_ = np.minimum(v_, wg_row0 + warp_row + g + 8 * h + causal_offset - col0 + kn.visible_plus)
                        vis[:, h] = v_ - 2 * t
                    for nt in range(kNTiles):
                        for e in range(4):
                            hide = nt * 8 + (e & 1) >= vis[:, e >> 1]
                            s[hide, nt, e] = -np.inf
                else:                                                     # 051b261's per-element test
                    cols = min(kBlockN, key_end - col0)
                    diagonal = max(-64 - kBlockN, min(64 + kBlockN, wg_row0 + causal_offset - col0))
                    for nt in range(kNTiles):
                        for e in range(4):
                            r = warp_row + g + (e >> 1) * 8
                            cc = nt * 8 + 2 * t + (e & 1)
                            hide = (cc >= cols) | ((cc - r > diagonal) if IsCausal else False)
                            s[hide, nt, e] = -np.inf
            if HasMask:                                                   # :274-275 if constexpr (HasMask)
                if kn.mask_variant != "before_hide":
                    add_mask(col0, s)
            rescale = np.zeros((32, 2), np.float32)                       # :276/:278, online_softmax.cuh
            for h in range(2):
                row_max = np.full(32, -np.inf, np.float32)
                for nt in range(kNTiles):
                    row_max = np.maximum(row_max, np.maximum(s[:, nt, 2 * h], s[:, nt, 2 * h + 1]))
                m_new = np.maximum(m_i[:, h], quad_max(row_max))
                shift = np.where(m_new == -np.inf, np.float32(0), m_new).astype(np.float32)
                rescale[:, h] = np.exp2(m_i[:, h] - shift)
                row_sum = np.zeros(32, np.float32)
                for nt in range(kNTiles):
                    s[:, nt, 2 * h] = np.exp2(s[:, nt, 2 * h] - shift)
                    s[:, nt, 2 * h + 1] = np.exp2(s[:, nt, 2 * h + 1] - shift)
                    row_sum = (row_sum + s[:, nt, 2 * h] + s[:, nt, 2 * h + 1]).astype(np.float32)
                l_i[:, h] = l_i[:, h] * rescale[:, h] + row_sum
                m_i[:, h] = m_new
            return rescale

        def pack(s):                                                      # :281-284, online_softmax.cuh:79-87
            for kk in range(kBlockN // 16):
                a = np.zeros((32, 4), np.uint32)
                a[:, 0] = be.pack2(s[:, 2 * kk, 0], s[:, 2 * kk, 1], fmt)
                a[:, 1] = be.pack2(s[:, 2 * kk, 2], s[:, 2 * kk, 3], fmt)
                a[:, 2] = be.pack2(s[:, 2 * kk + 1, 0], s[:, 2 * kk + 1, 1], fmt)
                a[:, 3] = be.pack2(s[:, 2 * kk + 1, 2], s[:, 2 * kk + 1, 3], fmt)
                if kn.tags:   # P tag: 0x8000 | consumer << 13 | warp row-block << 11 | kk << 7 | lane << 2 | reg
                    a = (0x8000 | (c << 13) | (w << 11) | (kk << 7) | (lane[:, None] << 2) | np.arange(4)[None, :])
                    a = (a | (a << 16)).astype(np.uint32)
                RF[c]["p_a"].setdefault(kk, np.zeros((128, 4), np.uint32))[mine] = a

        def release(ring, empty, j):                                      # :288-290 lane 0 arrives
            empty[j % kStages].arrive(vc)
            vc[agent] += 1
            released.setdefault((ring, rels_n[ring]), set()).add(agent)
            rels_n[ring] += 1

        def release_q(item):                                              # :288-290 on q_empty
            q_empty.arrive(vc)
            vc[agent] += 1
            released.setdefault(("q", item), set()).add(agent)

        def rescale_rows(rs):                                             # online_softmax.cuh:57-67
            acc = RF[c]["acc"][mine].reshape(32, kDTiles, 4)
            acc[:, :, 0] *= rs[:, 0:1]; acc[:, :, 1] *= rs[:, 0:1]
            acc[:, :, 2] *= rs[:, 1:2]; acc[:, :, 3] *= rs[:, 1:2]
            RF[c]["acc"][mine] = acc.reshape(32, -1)

        def read_s():
            return RF[c]["s"][mine].reshape(32, kNTiles, 4).copy()

        def full_wait(bar, par, what, ring, stage):
            def acq():
                bar.acquire(vc, par)
                if oracle is not None:
                    n = waits_n[ring]
                    if landed.get((ring, n), 0) != Tr.kSlabs:
                        oracle.append("consumer %d warp %d passes %s with %d/%d copies of %s load %d landed"
                                      % (c, w, what, landed.get((ring, n), 0), Tr.kSlabs, ring, n))
                    elif load_stage.get((ring, n)) != stage:
                        oracle.append("consumer %d warp %d reads %s load %d at stage %d, loaded into stage %s"
                                      % (c, w, ring, n, stage, load_stage.get((ring, n))))
                waits_n[ring] += 1
            return Wait(lambda: bar.test_parity(par), acq, what)

        yield None
        if c == initial_by:                                               # :292
            pass_turn()
        item = 0
        while True:                                                       # :293
            qpar = (item & 1) if kn.q_full_parity is None else kn.q_full_parity(item)
            yield Wait(lambda qpar=qpar: q_full.test_parity(qpar), lambda qpar=qpar: q_full.acquire(vc, qpar),
                       "q_full parity %d" % qpar)                         # :294
            # :298 lane 0 reads the slot (a generic shared-memory read, race-checked), __shfl_sync to the warp
            index = int(np.frombuffer(smem_.read_generic(slot_bytes, vc, agent, "consumer %d warp %d's item-slot read"
                                                         % (c, w)).tobytes(), np.uint32)[0])
            if index >= n_items:                                          # :299
                break
            it = Item(index)                                              # :300
            cur["it"], cur["wg_row0"] = it, it.row0 + 64 * c              # :301
            cur.setdefault("first", it)
            wg_row0, n_tiles = cur["wg_row0"], it.n_tiles
            RF[c]["acc"][mine] = 0                                        # :303
            m_i[:] = -np.inf                                              # :304
            l_i[:] = 0                                                    # :305
            if oracle is not None and n_tiles > 0 and landed.get(("q", item), 0) != Tr.kSlabs:
                oracle.append("consumer %d warp %d passes q_full of item %d with %d/%d Q copies landed"
                              % (c, w, item, landed.get(("q", item), 0), Tr.kSlabs))
            early, first = kn.q_release == "early", kn.q_release == "first"
            if n_tiles == 0:                                              # :307
                release_q(item)                                           # :308
            else:
                yield full_wait(k_full[0], phase(0), "k_full[0] parity %d" % phase(0), "k", 0)   # :311
                yield take_turn()                                         # :312
                issue_scores(0)                                           # :313
                pass_turn()                                               # :314
                if early and n_tiles == 1:
                    release_q(item)
                yield wg_wait_group(c, w, 0, "S_0")                       # :315
                release("k", k_empty, 0)                                  # :317
                if (n_tiles == 1 and kn.q_release == "kernel") or first:
                    release_q(item)                                       # :318
                s = read_s()
                softmax(0, s)                                             # :319
                pack(s)                                                   # :320
                yield None
                for j in range(1, n_tiles):                               # :322
                    st = j % kStages
                    yield full_wait(k_full[st], phase(j), "k_full[%d] parity %d" % (st, phase(j)), "k", st)   # :323
                    yield take_turn()                                     # :324
                    issue_scores(j)                                       # :325
                    st1 = (j - 1) % kStages
                    yield full_wait(v_full[st1], phase(j - 1), "v_full[%d] parity %d" % (st1, phase(j - 1)), "v",
                                    st1)                                  # :326
                    issue_pv(j - 1)                                       # :327
                    pass_turn()                                           # :328
                    if kn.release_k_early:
                        release("k", k_empty, j)
                    if early and j == n_tiles - 1:
                        release_q(item)
                    yield wg_wait_group(c, w, kn.wait1, "S_%d" % j)       # :329
                    if not kn.release_k_early:
                        release("k", k_empty, j)                          # :331
                    if j == n_tiles - 1 and kn.q_release == "kernel":
                        release_q(item)                                   # :332
                    s = read_s()
                    rs = softmax(j, s)                                    # :333
                    yield None
                    yield wg_wait_group(c, w, 0, "PV_%d" % (j - 1))       # :334
                    release("v", v_empty, j - 1)                          # :336
                    rescale_rows(rs)                                      # :337
                    pack(s)                                               # :338
                    yield None
                n = n_tiles
                st = (n - 1) % kStages
                yield full_wait(v_full[st], phase(n - 1), "v_full[%d] parity %d" % (st, phase(n - 1)), "v", st)   # :341
                yield take_turn()                                         # :342
                issue_pv(n - 1)                                           # :343
                if not (last and kn.final_skip):                          # :344
                    pass_turn()
                yield wg_wait_group(c, w, 0, "PV_%d" % (n - 1))           # :345
                release("v", v_empty, n - 1)                              # :347
                end_item(n)                                               # :348
            # epilogue (:351-365)
            acc = RF[c]["acc"][mine].reshape(32, kDTiles, 4)
            lse_base = (it.batch * hq + it.head) * nq
            ob = it.batch * G["o_strides"][0] + it.head * G["o_strides"][1]
            for h in range(2):
                l = quad_sum(l_i[:, h])
                with np.errstate(divide="ignore"):
                    inv = np.where(l > 0, np.float32(1) / np.where(l > 0, l, 1), np.float32(0)).astype(np.float32)
                r = wg_row0 + warp_row + g + h * 8
                ok = r < it.row0 + it.rows                                # :359
                for ln in np.nonzero(ok)[0]:
                    if t[ln] == 0:
                        with np.errstate(divide="ignore"):
                            val = (m_i[ln, h] + np.log2(l[ln])) * KLN2 if l[ln] > 0 else -np.inf
                        G["lse"][lse_base + r[ln]] = np.float32(val)
                        G["lse_writes"][lse_base + r[ln]] += 1
                    for dt in range(kDTiles):
                        o = ob + int(r[ln]) * G["o_strides"][2] + dt * 8 + 2 * int(t[ln])
                        G["out"][o] = fmt.enc(np.float32(acc[ln, dt, 2 * h] * inv[ln]))
                        G["out"][o + 1] = fmt.enc(np.float32(acc[ln, dt, 2 * h + 1] * inv[ln]))
                        G["out_writes"][o:o + 2] += 1
            if not consumers_persistent:                                  # :366 a block per item
                break
            item += 1
            yield None
        if c == 0 and kn.extra_turn:                                      # :368
            yield take_turn()
        if proto is not None:
            proto.setdefault("finished", set()).add((c, w))

    agents[pre + "producer"] = producer()
    for c in range(kC):
        for w in range(4):
            agents[pre + "c%dw%d" % (c, w)] = consumer_warp(c, w)

    def finish():
        for wgi in range(1 + kC):
            vals = [regs_log.get((wgi, w)) for w in range(4)]
            if len(set(vals)) != 1 or vals[0] is None:
                smem_.hz("setmaxnreg not warpgroup-uniform in warpgroup %d: %s" % (wgi, vals))
        left = nb.leftovers()
        if left:
            smem_.hz("named barrier arrivals left at exit: %s" % left)
        for bar in [q_full] + k_full + v_full:
            if bar.tx != 0:
                smem_.hz("mbarrier %s ends with tx-count %d" % (bar.name, bar.tx))
        for bar in [q_full, q_empty] + k_empty + v_empty:
            if bar.pending != bar.count:
                smem_.hz("mbarrier %s ends with %d of %d arrivals pending" % (bar.name, bar.pending, bar.count))
        for key in sorted(set(expected) | set(delivered)):
            if expected.get(key) != delivered.get(key):
                smem_.hz("expect-tx of %s item %d tile %d: %s bytes announced, %s delivered by its boxes"
                         % (key[0], key[1], key[2], expected.get(key), delivered.get(key)))
        if proto is not None:
            proto["tx"] = (dict(expected), dict(delivered))
            proto["nb_log"] = nb.log
            proto["nb_gen"] = dict(nb.gen)
        return smem_

    if not alone:
        return finish
    with np.errstate(all="ignore"):
        schedule(agents, rng)
    return finish()


# ============================================================ dispatch and launch (host side)
SM90_HEAD_DIMS = (64, 128)              # forward_sm90.h:12 kSm90HeadDims
SM90_MASKED_HEAD_DIM = 128              # forward_sm90.h:15 kSm90MaskedHeadDim


def use_sm90_forward(d, mask_kind):     # attention_cuda_ops.cpp:74-78 (`takes`)
    masked = mask_kind != "none"
    return d in SM90_HEAD_DIMS and (not masked or d == SM90_MASKED_HEAD_DIM)


def launch_instantiation(d, mask_kind, causal):
    """launch_forward_sm90<HeadDim> (forward_kernel.cuh:398-426): (IsCausal, HasMask) of the kernel it launches, or
    the exception it throws."""
    masked = mask_kind != "none"
    if d == SM90_MASKED_HEAD_DIM:                                        # :402 if constexpr (kSm90MaskedHeadDim == HeadDim)
        if masked:
            return (causal, True)                                        # :403-410
    elif masked:
        return "invalid_argument"                                        # :412-413
    return (causal, False)                                               # :415-425


def host_box_heights(d, causal, mask_kind, consumers=None, nk=0):
    """forward_sm90 (sm90_dispatch.cu:87-88): the box heights encode_operand_maps gives the Q map
    (Sm90ForwardTraits<kHeadDim, 128>::kBlockM) and the K, V maps (sm90_forward_block_n(kHeadDim,
    p.is_causal, masked)). `consumers`: the traits' kConsumers changed on both sides (Knobs.consumers)."""
    masked = mask_kind != "none"
    return Traits(d, False, False, consumers).kBlockM, sm90_forward_block_n(d, causal, masked, nk)


def host_launch(G, kn=None):
    """forward_sm90 (sm90_dispatch.cu:76-94) -> launch_forward_sm90 (:398-426) -> launch_sm90_forward_kernel
    (:374-394): None where nothing is launched (B Hq = 0 or Nq = 0); raises ValueError where launch_forward_sm90
    throws; else the instantiation (IsCausal, HasMask), the block order the launch makes with that instantiation's
    kBlockM, the maps' box heights, the items, the grid (min(items, G["sms"]) when persistent) and whether the launch
    zeroes the work counter."""
    kn = kn or Knobs()
    if G["B"] * G["hq"] == 0 or G["nq"] == 0:                             # sm90_dispatch.cu:78
        return None
    assert max(G["nq"], G["nk"]) <= 2 ** 30                              # sm90_dispatch.cu:81 (else sm80 takes it)
    mask_kind = "none" if G.get("mask") is None else G["mask"]["kind"]
    q_box, kv_box = host_box_heights(G["d"], G["causal"], mask_kind, kn.consumers, G["nk"])   # sm90_dispatch.cu:87-88
    inst = launch_instantiation(G["d"], mask_kind, G["causal"])
    if inst == "invalid_argument":
        raise ValueError("fusedattn: the sm90 forward takes attn_mask at head dim 128 only")
    block_n = sm90_forward_block_n(G["d"], G["causal"], mask_kind != "none", G["nk"])   # launch_forward_sm90's BlockN
    Tr = Traits(G["d"], inst[0], inst[1], kn.consumers, kn.block_n or block_n)     # :376
    assert Tr.kSmemBytes <= 227 * 1024                                   # :378 cudaFuncSetAttribute
    order = make_query_block_order(G, Tr.kBlockM, 2, inst[0])            # :380 (sizeof(T) = 2)
    items = order.blocks()
    grid, memset = items, False                                          # :384
    # one block per SM where persistent (:381-383) follows from registers, not from shared memory (two d=64 blocks'
    # would fit in 227 KiB); run_forward_ws_tests section 0 checks it
    persistent = sm90_persistent(G["d"], inst[0]) if kn.persistent is None else kn.persistent
    if persistent:                                                       # :385
        sms = G.get("sms", SM_COUNT)                                     # :386 current_device_sms()
        if items > sms:                                                  # :387-390
            grid = sms
            memset = kn.memset
    return dict(inst=inst, order=order, q_box=q_box, kv_box=kv_box, blocks=grid, grid=grid, items=items,
                persistent=persistent, memset=memset, traits=Tr, block_n=block_n)


# ============================================================ problem + driver
def make_problem(rng, B, hq, hkv, nq, nk, d, causal, fmt):
    Qb = fmt.enc(rng.standard_normal((B, hq, nq, d)).astype(np.float32))
    Kb = fmt.enc((rng.standard_normal((B, hkv, nk, d)) * 1.5).astype(np.float32))
    Vb = fmt.enc(rng.standard_normal((B, hkv, nk, d)).astype(np.float32))
    Q, K, V = (fmt.dec(x).astype(np.float64) for x in (Qb, Kb, Vb))
    qs, ks = be.bshd_strides(hq, nq, d), be.bshd_strides(hkv, nk, d)
    G = dict(B=B, hq=hq, hkv=hkv, nq=nq, nk=nk, d=d, causal=causal, scale=1.0 / np.sqrt(d),
             Q=Q, K=K, V=V, q=be.to_flat(Qb, qs), k=be.to_flat(Kb, ks), v=be.to_flat(Vb, ks),
             q_strides=qs, k_strides=ks, v_strides=ks, o_strides=qs)
    reset_outputs(G)
    return G


def reset_outputs(G):
    G["out"] = np.full(G["B"] * G["o_strides"][0], 0x7E00, np.uint16)     # NaN sentinel
    G["out_writes"] = np.zeros(G["B"] * G["o_strides"][0], np.int64)
    G["lse"] = np.full(G["B"] * G["hq"] * G["nq"], np.nan, np.float32)
    G["lse_writes"] = np.zeros(G["B"] * G["hq"] * G["nq"], np.int64)


def reference(G):
    Q, K, V = G["Q"], G["K"], G["V"]
    B, hq, nq, d = Q.shape
    if G["nk"] == 0:
        return np.zeros(Q.shape), np.full((B, hq, nq), -np.inf)
    if G.get("mask") is None:
        O, lse, _, _ = be.forward_reference(Q, K, V, G["scale"], G["causal"])
        return O, lse
    # float64 softmax(Q K^T scale + mask) V over the visible keys; hidden entries -inf whatever the mask holds
    g_ = hq // G["hkv"]
    Kr, Vr = np.repeat(K, g_, axis=1), np.repeat(V, g_, axis=1)
    s = np.einsum("bhqd,bhkd->bhqk", Q, Kr) * G["scale"]
    nq, nk = G["nq"], G["nk"]
    vis = np.ones((nq, nk), bool)
    if G["causal"]:
        vis = np.arange(nk)[None, :] <= np.arange(nq)[:, None] + (nk - nq)
    with np.errstate(invalid="ignore"):
        s = np.where(vis, s + G["mask"]["logical"], -np.inf)
    mx = s.max(-1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0)
    p = np.exp(s - mx)
    l = p.sum(-1, keepdims=True)
    P = np.where(l > 0, p / np.where(l > 0, l, 1), 0)
    O = np.einsum("bhqk,bhkd->bhqd", P, Vr)
    lse = np.where(l[..., 0] > 0, np.log(np.where(l[..., 0] > 0, l[..., 0], 1)) + mx[..., 0], -np.inf)
    return O, lse


def run_forward(G, fmt, seed=0, kn=None, oracle=None, tag_log=None, protos=None, dyn_base=0):
    """forward_sm90 and the launch: returns hazards (deadlock raises). A grid of one block per item runs its blocks
    one after another in a random order (they share nothing but disjoint outputs); a persistent grid smaller than
    the items runs all its blocks concurrently under one scheduler, sharing the work counter."""
    rng = random.Random(seed)
    launch = host_launch(G, kn)
    if launch is None:
        return []
    kn = kn or Knobs()
    counter = Counter()                                                  # attention_cuda_ops.cpp:110 at::empty
    if launch["memset"]:
        counter.value, counter.zeroed = 0, True                          # :389 cudaMemsetAsync
    grid, n_items = launch["grid"], launch["items"]
    hazards = []
    blocks = list(range(grid))                                           # :392 <<<blocks, ...>>>
    rng.shuffle(blocks)
    protos_ = []
    if grid < n_items:
        Tr = launch["traits"]
        total = 0
        for i in range(n_items):                                         # the clock bound: every item in one block
            pair, qblock = launch["order"].at(launch["inst"][0], i)
            row0 = qblock * Tr.kBlockM
            rows = min(Tr.kBlockM, G["nq"] - row0)
            key_end = max(0, min(G["nk"], row0 + rows + G["nk"] - G["nq"])) if launch["inst"][0] else G["nk"]
            total += 1 + 2 * ((key_end + (kn.block_n or Tr.kBlockN) - 1) // (kn.block_n or Tr.kBlockN))
        agents = Agents()
        fins = []
        for bx in blocks:
            proto = {} if protos is not None else None
            fins.append(run_block(bx, G, fmt, rng, kn, oracle=oracle, tag_log=tag_log, proto=proto,
                                  dyn_base=dyn_base, launch=launch, agents=agents, counter=counter,
                                  tma_bound=Tr.kSlabs * total + 4))
            protos_.append(proto)
        with np.errstate(all="ignore"):
            schedule(agents, rng)
        for fin in fins:
            hazards += fin().hazards
    else:
        for bx in blocks:
            proto = {} if protos is not None else None
            sm = run_block(bx, G, fmt, rng, kn, oracle=oracle, tag_log=tag_log, proto=proto, dyn_base=dyn_base,
                           launch=launch, counter=counter)
            protos_.append(proto)
            hazards += sm.hazards
    # the work counter: every item taken by exactly one block; no atomic in a grid of one block per item; in a
    # smaller grid, one atomicAdd per item (each block's last one finds the end)
    if protos is not None:
        taken = {}
        for p_ in protos_:
            for it in p_["items"]:
                taken[it["index"]] = taken.get(it["index"], 0) + 1
        if taken != {i: 1 for i in range(n_items)}:
            hazards.append("work items not taken exactly once: %d distinct of %d, %d taken twice or more"
                           % (len(taken), n_items, sum(1 for v in taken.values() if v > 1)))
        protos.extend(protos_)
    if grid >= n_items and counter.adds:
        hazards.append("a grid of one block per item touched the work counter (%d atomics)" % counter.adds)
    if grid < n_items and counter.adds != n_items:
        hazards.append("%d atomicAdds on the work counter for %d items over %d blocks" % (counter.adds, n_items, grid))
    return hazards


def results(G, fmt):
    shape = (G["B"], G["hq"], G["nq"], G["d"])
    out = fmt.dec(be.from_flat(G["out"], shape, G["o_strides"])).astype(np.float64)
    writes = be.from_flat(G["out_writes"], shape, G["o_strides"])
    lse = G["lse"].reshape(G["B"], G["hq"], G["nq"]).astype(np.float64)
    return out, lse, writes, G["lse_writes"].reshape(G["B"], G["hq"], G["nq"])
