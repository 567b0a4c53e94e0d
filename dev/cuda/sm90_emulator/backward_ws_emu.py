"""Emulation of the sm90 backward (cpp/cuda/sm90/backward_kernel.cuh @ 92ea09c, branch wip/sm90-bwd-d64: kBlockM =
128 queries per step at d=64, 64 at d=128; each consumer's dQ a 64 x 64 quarter over all 128 keys): a producer
thread issuing TMA loads into a two-stage ring guarded by full/empty mbarriers, two consumer warpgroups of 4 warps
each, a named barrier, dS double-buffered, dQ = dS K. Tile constants come from Traits (backward_traits.h), the
tensor maps' boxes from encode_maps (sm90_dispatch.cu), the grid order from make_key_block_order (block_order.h).
Line references "# :NNN" are backward_kernel.cuh's.

Every warp (and the producer thread, and every TMA copy in flight) is a separate agent run as a coroutine by a
seeded random scheduler, so each run is one random interleaving. Shared memory is a byte array with a
vector-clock race detector (happens-before through mbarrier phases, the named barrier, wgmma issue/wait and
fence.proxy.async), plus real-time oracles (a stage overwritten before all 8 consumer warps released it, a dS
buffer rewritten while a dQ product may still read it) and deadlock detection (no agent can move).

Hardware pieces (not the kernel's helpers): ptx_model.py (descriptors, 128B swizzle on absolute addresses,
wgmma fragments), backward_emu.STSM_T (stmatrix .trans, CUTLASS SM90_U16x8_STSM_T), and below: TMA tiled
loads (box written row r at +128 r, 16-byte chunk c at the address-swizzled position, rows outside the
tensor's dims zero; 1-D box: start on 16 bytes, elements past the end zero; complete_tx counts the full box),
mbarrier (pending count, tx-count, phase; try_wait.parity(P) succeeds iff the current phase's parity != P, so a
fresh barrier passes parity 1), bar.sync (id, threads counted in warps).
"""
import random

import numpy as np

import backward_emu as be
import ptx_model
from ptx_model import kmajor_addresses, mnmajor_addresses

NWARPS = 8          # consumer warps: agents 1..8 (consumer c, warp w -> 1 + 4c + w); agent 0 = producer thread
SMEM = 232448


class Hazard(Exception):
    pass


class Deadlock(Exception):
    pass


# ============================================================ happens-before machinery
class Clocks:
    def __init__(self, n):
        self.n = n
        self.vc = {}

    def new(self, agent, base=None):
        v = np.zeros(self.n, np.int64) if base is None else base.copy()
        v[agent] = max(v[agent], 1)
        self.vc[agent] = v
        return v


class RaceSmem:
    """Shared memory bytes + last write (agent, epoch, proxy, fence epoch) + reads per consumer warp."""

    def __init__(self, size=SMEM):
        self.mem = np.zeros(size, np.uint8)
        self.w_agent = np.full(size, -1, np.int64)
        self.w_epoch = np.zeros(size, np.int64)
        self.w_async = np.zeros(size, bool)
        self.w_fence = np.zeros(size, np.int64)       # generic write: epoch of the writer's later fence.proxy.async
        self.r_epoch = np.zeros((size, NWARPS), np.int64)
        self.r_pending = np.zeros((size, NWARPS), bool)
        self.hazards = []

    def hz(self, msg):
        if len(self.hazards) < 200:
            self.hazards.append(msg)

    def write(self, b, data, vc, agent, is_async, what):
        b = np.asarray(b, np.int64).ravel()
        if self.r_pending[b].any():
            self.hz("WAR: %s overwrites bytes a wgmma still reads (not waited)" % what)
        if (self.r_epoch[b] > vc[1:1 + NWARPS][None, :]).any():
            self.hz("WAR: %s overwrites bytes read by a warp with no happens-before" % what)
        wa = self.w_agent[b]
        known = wa >= 0
        if known.any() and (vc[wa[known]] < self.w_epoch[b][known]).any():
            self.hz("WAW: %s over an unordered earlier write" % what)
        self.mem[b] = np.asarray(data, np.uint8).ravel()
        self.w_agent[b] = agent
        self.w_epoch[b] = vc[agent]
        self.w_async[b] = is_async
        self.w_fence[b] = 0
        self.r_epoch[b] = 0

    def _raw(self, b, vc, by_async, what):
        wa = self.w_agent[b]
        known = wa >= 0
        if not known.any():
            return
        b, wa = b[known], wa[known]
        if (vc[wa] < self.w_epoch[b]).any():
            self.hz("RAW: %s reads bytes whose write is not ordered before it" % what)
        if by_async:
            gen = ~self.w_async[b]
            if gen.any():
                f = self.w_fence[b][gen]
                if (f == 0).any():
                    self.hz("RAW: %s (async proxy) reads generic writes with no fence.proxy.async" % what)
                elif (vc[wa[gen]] < f).any():
                    self.hz("RAW: %s reads generic writes whose fence is not ordered before it" % what)

    def read_generic(self, b, vc, agent, what):
        b = np.asarray(b, np.int64).ravel()
        self._raw(b, vc, False, what)
        self.r_epoch[b, agent - 1] = np.maximum(self.r_epoch[b, agent - 1], vc[agent])
        return self.mem[b]

    def fence_proxy_async(self, vc, agent):
        m = (self.w_agent == agent) & ~self.w_async & (self.w_fence == 0)
        self.w_fence[m] = vc[agent]


class MBarrier:
    def __init__(self, name, count):
        self.name, self.count, self.pending, self.tx, self.n = name, count, count, 0, 0
        self.acc = None
        self.done = []

    def _join(self, vc):
        self.acc = vc.copy() if self.acc is None else np.maximum(self.acc, vc)

    def _check(self):
        if self.pending == 0 and self.tx == 0:
            self.done.append(self.acc)
            self.n += 1
            self.pending, self.acc = self.count, None

    def arrive(self, vc, expect_tx=0):
        self.tx += expect_tx                   # expect-tx happens before the arrive-on
        self.pending -= 1
        self._join(vc)
        self._check()

    def complete_tx(self, nbytes, vc):
        self.tx -= nbytes
        self._join(vc)
        self._check()

    def test_parity(self, parity):
        return (self.n & 1) != parity

    def acquire(self, vc, parity):
        if self.n >= 1:                        # the latest completed phase has parity (n - 1) & 1 == parity
            np.maximum(vc, self.done[self.n - 1], out=vc)


class NamedBarrier:
    def __init__(self):
        self.arrived = {}   # id -> (threads, vc join, generation)
        self.gen = {}
        self.released = {}  # (id, generation) -> vc

    def arrive(self, bid, threads, total, vc):
        cnt, acc = self.arrived.get(bid, (0, None))
        cnt += threads
        acc = vc.copy() if acc is None else np.maximum(acc, vc)
        g = self.gen.get(bid, 0)
        if cnt > total:
            raise Hazard("named barrier %d over-arrived" % bid)
        if cnt == total:
            self.released[(bid, g)] = acc
            self.gen[bid] = g + 1
            self.arrived[bid] = (0, None)
        else:
            self.arrived[bid] = (cnt, acc)
        return g


class Wait:
    """A blocking point: ready() pure; acquire() runs once when the scheduler resumes the agent."""
    def __init__(self, ready, acquire=lambda: None, what=""):
        self.ready, self.acquire, self.what = ready, acquire, what


class Agents(dict):
    """The scheduler's agents, name -> generator; TMA copies join while it runs (their names queue in `fresh`)."""
    def __init__(self):
        super().__init__()
        self.fresh = []

    def __setitem__(self, k, v):
        super().__setitem__(k, v)
        self.fresh.append(k)


def schedule(agents, rng, max_steps=10 ** 7):
    """Random interleaving of an Agents: every agent, TMA copies included, gets a random speed in [0.01, 1],
    log-uniform, so some run far ahead of others; the next agent is drawn among the ready ones by speed;
    new agents are admitted from Agents.fresh; raises Deadlock when none can move."""
    speed, waits, live = {}, {}, {}

    def admit():
        for k in agents.fresh:
            live[k], waits[k], speed[k] = agents[k], None, 10 ** rng.uniform(-2, 0)
        agents.fresh.clear()
    admit()
    for _ in range(max_steps):
        if not live:
            return
        ready = [a for a in live if waits[a] is None or waits[a].ready()]
        if not ready:
            raise Deadlock("; ".join("%s waits %s" % (a, waits[a].what) for a in live))
        a = rng.choices(ready, weights=[speed[x] for x in ready])[0]
        if waits[a] is not None:
            waits[a].acquire()
        try:
            waits[a] = next(live[a])
        except StopIteration:
            del live[a]
            del waits[a]
        admit()
    raise Deadlock("step limit")


# ============================================================ knobs (defaults = the kernel)
class Knobs:
    def __init__(self, **kw):
        self.ds_slab = kw.get("ds_slab", None)            # :199 consumer * kBlockM * 128
        self.dq_query_offset = kw.get("dq_query_offset", None)    # :232 Tr::kDqQueryOffset (None: the traits')
        self.dq_column_offset = kw.get("dq_column_offset", None)  # :232 Tr::kDqColumnOffset (None: the traits')
        self.dq_a_offset = kw.get("dq_a_offset", None)    # :233 query0 * 128 (a function of query0)
        self.kb_slab = kw.get("kb_slab", None)            # :234 column0 / 64 * kBlockN * 128 (a function of c)
        self.dq_row_query0 = kw.get("dq_row_query0", True)  # :249 query0 + warp_row + g + 8 h
        self.named_barrier = kw.get("named_barrier", True)  # :227
        self.empty_xor = kw.get("empty_xor", 1)            # :98 phase ^ 1
        self.ds_double = kw.get("ds_double", True)         # :143 (s % 2)
        self.expect_delta = kw.get("expect_delta", 0)      # :99 + delta bytes
        self.empty_count = kw.get("empty_count", 8)        # :77 4 * kConsumers
        self.release_before_wait = kw.get("release_before_wait", False)  # :224 arrive moved above :221
        self.ds_fence = kw.get("ds_fence", True)           # :201
        self.mask_query = kw.get("mask_query", True)       # :178
        self.setmaxnreg_before_return = kw.get("setmaxnreg_before_return", True)  # :86-87 order
        self.rows_slot = kw.get("rows_slot", None)         # backward_traits.h:34 kRowsSlot (None: the traits')
        self.rows_align = kw.get("rows_align", True)       # :110 & ~3 and :140 & 3 (False: the box at the row)
        self.host_box_m = kw.get("host_box_m", None)       # sm90_dispatch.cu Q/dO box rows (None: Tr::kBlockM)
        self.tma_late = kw.get("tma_late", 0.0)            # scheduler bias: probability TMA copies are deferred
        self.tags = kw.get("tags", False)
        self.stats = kw.get("stats", None)                 # coverage counters (dict) or None


# ============================================================ backward_traits.h, block_order.h, sm90_dispatch.cu
class Traits:                                                           # backward_traits.h:12-52
    def __init__(self, D):
        self.kConsumers = 2
        self.kThreads = 128 * (1 + self.kConsumers)
        self.kBlockN = 64 * self.kConsumers
        self.kBlockM = 128 if D == 64 else 64
        self.kStages = 2
        self.kSlabs = D // 64
        self.kKVTileBytes = self.kBlockN * D * 2
        self.kQTileBytes = self.kBlockM * D * 2
        self.kDsBytes = self.kBlockM * self.kBlockN * 2
        self.kRowsBox = self.kBlockM + 4
        self.kRowsSlot = 2 * self.kBlockM
        assert self.kRowsBox <= self.kRowsSlot
        self.kFloatsOffset = 2 * self.kKVTileBytes + 2 * self.kStages * self.kQTileBytes + 2 * self.kDsBytes
        self.kSmemBytes = self.kFloatsOffset + 2 * self.kStages * self.kRowsSlot * 4 + (1 + 2 * self.kStages) * 8 + 1024
        self.kProducerRegisters, self.kConsumerRegisters = 24, 240
        self.kDsWrittenBarrier = 1
        assert D in (64, 128)
        assert self.kConsumers == 2 and self.kBlockM * D == 2 * 64 * 64
        self.kDqQueryOffset = 64 if self.kBlockM == 128 else 0
        self.kDqColumnOffset = 64 if D == 128 else 0


def make_key_block_order(G, block_n, l2_bytes=None):                   # block_order.h:58-72, 86-92
    """(blocks_per_pair, pairs, pairs_per_group). Causal: as many pairs per group as fit half the L2
    (G["l2_bytes"], default 50 MiB, the H200's), else one."""
    d, group = G["d"], G["hq"] // G["hkv"]
    pairs = G["B"] * G["hkv"] * G["head_splits"]
    blocks_per_pair = (G["nk"] + block_n - 1) // block_n
    bytes_per_pair = group // G["head_splits"] * G["nq"] * (2 * d * 2 + 8)
    assert pairs * blocks_per_pair <= 2147483647
    ppg = 1
    if G["causal"] and pairs > 1:
        l2 = G.get("l2_bytes", 50 * 2 ** 20) if l2_bytes is None else l2_bytes
        if bytes_per_pair > 0:
            ppg = l2 // 2 // bytes_per_pair
        ppg = min(max(ppg, 1), pairs)
    return blocks_per_pair, pairs, ppg


def block_order_at(order, index):                                      # block_order.h:40-48, Reverse = false
    blocks_per_pair, pairs, ppg = order
    group_blocks = ppg * blocks_per_pair
    group, within = index // group_blocks, index % group_blocks
    first_pair = group * ppg
    group_pairs = min(pairs - first_pair, ppg)
    rank = within // group_pairs
    return first_pair + within % group_pairs, rank


def block_walk(bx, G, Tr, order):
    """KeyBlockWalk(p, order) of blockIdx.x = bx (backward_passes.cuh:90-110): backward_emu.KeyBlockWalk decodes
    its flat index as pair * blocks_per_pair + block, which is what order.at<false>(bx) gives here."""
    pair, block = block_order_at(order, bx)
    return be.KeyBlockWalk(pair * order[0] + block, G, BlockN=Tr.kBlockN, BlockM=Tr.kBlockM)


def encode_maps(G, Tr, kn):
    """backward_sm90's tensor maps (sm90_dispatch.cu:96-113): box rows of q, do (Tr::kBlockM), k, v (kBlockN) and
    the 1-D lse, delta boxes (kRowsBox floats), checked as cuTensorMapEncodeTiled checks them."""
    box = dict(q=Tr.kBlockM if kn.host_box_m is None else kn.host_box_m, k=Tr.kBlockN, v=Tr.kBlockN)
    box["do"] = box["q"]
    box["rows"] = Tr.kRowsBox
    for k_, v_ in box.items():
        assert 0 < v_ <= 256, "boxDim[%s] = %d outside 1..256" % (k_, v_)
    assert Tr.kRowsBox * 4 % 16 == 0, "1-D box of %d floats not a multiple of 16 bytes" % Tr.kRowsBox
    return box


# ============================================================ hardware: TMA
def tma_box_4d(G, name, col0, row0, head, batch, box_rows):
    """64 columns x box_rows rows of the map (d, N, H, B) at (col0, row0, head, batch) -> (box_rows, 64) uint16;
    elements outside the dims are zero."""
    st = G[name + "_strides"]
    d = G["d"]
    N = G["nq"] if name in ("q", "do") else G["nk"]
    H = G["hq"] if name in ("q", "do") else G["hkv"]
    out = np.zeros((box_rows, 64), np.uint16)
    if not (0 <= head < H and 0 <= batch < G["B"]):
        return out
    for r in range(box_rows):
        if 0 <= row0 + r < N:
            cols = col0 + np.arange(64)
            ok = cols < d
            o = batch * st[0] + head * st[1] + (row0 + r) * st[2]
            out[r, ok] = G[name][o + cols[ok]]
    return out


def swizzled_box_bytes(dst, box):
    """Byte addresses and data of a (rows, 64) 16-bit box written with CU_TENSOR_MAP_SWIZZLE_128B at dst."""
    rows = box.shape[0]
    r = np.arange(rows)[:, None]
    ch = np.arange(8)[None, :]
    lin = dst + r * 128 + ch * 16
    phys = ptx_model.swizzle128(lin)                           # absolute-address swizzle
    addr = (phys[..., None] + np.arange(16)).reshape(-1)
    data = box.reshape(rows, 8, 8).astype("<u2").view(np.uint8).reshape(-1)
    return addr, data


# ============================================================ the kernel
def run_block(bx, G, fmt, rng, dyn_base=0, kn=None, log=None, oracle=None, tag_log=None, order=None):
    """One CTA (blockIdx.x = bx) of sm90_backward_kernel<HeadDim, T, IsCausal> (backward_kernel.cuh:40-260)."""
    kn = kn or Knobs()
    D = G["d"]
    Tr = Traits(D)                                                     # :44-45
    kConsumers, kBlockN, kBlockM, kStages = Tr.kConsumers, Tr.kBlockN, Tr.kBlockM, Tr.kStages
    kSlabs, kKVTileBytes, kQTileBytes, kDsBytes = Tr.kSlabs, Tr.kKVTileBytes, Tr.kQTileBytes, Tr.kDsBytes
    kFloatsOffset, kSmemBytes, kRowsBox = Tr.kFloatsOffset, Tr.kSmemBytes, Tr.kRowsBox
    kRowsSlot = Tr.kRowsSlot if kn.rows_slot is None else kn.rows_slot
    kMTiles, kDTiles = kBlockM // 8, D // 8                            # :46-47
    assert dyn_base + kSmemBytes <= SMEM
    box = encode_maps(G, Tr, kn)                                       # the host's tensor maps
    order = order or make_key_block_order(G, kBlockN)                  # :268

    smem_ = RaceSmem()
    base = ((be.WINDOW + dyn_base + 1023) & ~1023) - be.WINDOW        # :50
    sK = base                                                          # :51-58
    sV = sK + kKVTileBytes
    sQ = sV + kKVTileBytes
    sdO = sQ + kStages * kQTileBytes
    sdS = sdO + kStages * kQTileBytes
    sLse = base + kFloatsOffset
    sDelta = sLse + kStages * kRowsSlot * 4
    bars_at = sDelta + kStages * kRowsSlot * 4
    assert bars_at + (1 + 2 * kStages) * 8 <= dyn_base + kSmemBytes, "overruns kSmemBytes"
    assert sdS + 2 * kDsBytes <= sLse and bars_at % 8 == 0

    walk = block_walk(bx, G, Tr, order)                                # :65
    nq, nk = G["nq"], G["nk"]
    steps = walk.steps
    n_tma = 2 * 2 * kSlabs + steps * (2 * kSlabs + 2) + 4
    NC = 1 + NWARPS + n_tma
    clocks = Clocks(NC)
    # mbarrier init by thread 0, fence.mbarrier_init, __syncthreads: every agent starts ordered after it
    kv_full = MBarrier("kv_full", 1)
    step_full = [MBarrier("full%d" % i, 1) for i in range(kStages)]
    step_empty = [MBarrier("empty%d" % i, kn.empty_count) for i in range(kStages)]
    nb = NamedBarrier()
    start = np.ones(NC, np.int64)
    for a in range(1 + NWARPS):
        clocks.new(a, start)

    regs_log = {}   # setmaxnreg per (warpgroup, warp)
    agents = Agents()
    next_tma = [1 + NWARPS]
    stage_landed = {}   # oracle: (step) -> number of TMA copies of the step landed
    released = {}       # oracle: step -> set of warps that released its stage
    dq_done = {}        # oracle: step -> set of warps whose dQ product of that step completed

    # ---------------------------------------------------------------- TMA copies (agents of their own)
    def tma(dst_bytes_fn, bar, nbytes, what, step):
        k = next_tma[0]
        next_tma[0] += 1
        vc = clocks.new(k, clocks.vc[0])      # issued by the producer: ordered after its past

        def body():
            if kn.tma_late and rng.random() < kn.tma_late:
                yield None
            yield None                        # lands at some later point
            addr, data = dst_bytes_fn()
            if oracle is not None and step >= 2:
                if released.get(step - 2, set()) != set(range(1, 1 + NWARPS)):
                    oracle.append("TMA of step %d into stage %d before all 8 warps released step %d (%s)"
                                  % (step, step % 2, step - 2, sorted(released.get(step - 2, set()))))
            if kn.stats is not None and step >= 1:
                kn.stats["TMA lands while a warp still reads the previous step"] = kn.stats.get(
                    "TMA lands while a warp still reads the previous step", 0) + (
                    released.get(step - 1, set()) != set(range(1, 1 + NWARPS)))
            smem_.write(addr, data, vc, k, True, "TMA " + what)
            if step >= 0:
                stage_landed[step] = stage_landed.get(step, 0) + 1
            bar.complete_tx(nbytes, vc)
        agents["tma%d" % k] = body()

    def box_load(dst, name, col0, row0, head, batch, bar, step):     # tma.cuh:22-29, the map's box
        rows = box[name]
        assert dst % 1024 == 0, "128B-swizzled TMA destination not 1024-aligned"
        tma(lambda: swizzled_box_bytes(dst, tma_box_4d(G, name, col0, row0, head, batch, rows)), bar,
            rows * 128, "%s box" % name, step)

    def row_load(dst, arr, index, bar, step):                          # tma.cuh:32-38, kRowsBox floats
        n = box["rows"]
        assert dst % 128 == 0, "TMA shared destination not 128-aligned"
        if index % 4 != 0:                                             # bc8b924: illegal instruction on the H200
            smem_.hz("TMA 1-D box starts at float %d, not on 16 bytes" % index)

        def fn():
            idx = index + np.arange(n)
            vals = np.zeros(n, np.float32)
            ok = (idx >= 0) & (idx < len(arr))
            vals[ok] = arr[idx[ok]]
            return dst + np.arange(n * 4), vals.astype("<f4").view(np.uint8)
        tma(fn, bar, n * 4, "1-D row", step)

    def flat_row(head, m0):                                            # :69-71
        r = (walk.batch * G["hq"] + head) * nq + m0
        assert r < 2 ** 31
        return r

    # ---------------------------------------------------------------- producer (warpgroup 0)
    def producer():
        vc = clocks.vc[0]
        if kn.setmaxnreg_before_return:
            for w in range(4):
                regs_log[(0, w)] = 24                                   # :86 whole warpgroup
        else:
            regs_log[(0, 0)] = 24                                       # only warp 0 reaches it
        if steps == 0:                                                 # :87
            return
        yield None
        key0, batch = walk.key0, walk.batch
        kv_full.arrive(vc, 2 * kKVTileBytes); vc[0] += 1               # :91
        for slab in range(kSlabs):                                     # :92-95
            box_load(sK + slab * kBlockN * 128, "k", 64 * slab, key0, walk.head_kv, batch, kv_full, -1)
            box_load(sV + slab * kBlockN * 128, "v", 64 * slab, key0, walk.head_kv, batch, kv_full, -1)
        for s in range(steps):                                         # :96
            stage = s % kStages
            phase = (s // kStages) & 1
            par = phase ^ kn.empty_xor
            yield Wait(lambda st=stage, p=par: step_empty[st].test_parity(p),      # :98
                       lambda st=stage, p=par: step_empty[st].acquire(vc, p), "empty[%d] parity %d" % (stage, par))
            exp = 2 * kQTileBytes + 2 * kRowsBox * 4 + kn.expect_delta
            step_full[stage].arrive(vc, exp); vc[0] += 1               # :99
            head, m0 = walk.head(s), walk.m0(s)                        # :100
            for slab in range(kSlabs):                                 # :101-106
                box_load(sQ + stage * kQTileBytes + slab * kBlockM * 128, "q", 64 * slab, m0, head, batch,
                         step_full[stage], s)
                box_load(sdO + stage * kQTileBytes + slab * kBlockM * 128, "do", 64 * slab, m0, head, batch,
                         step_full[stage], s)
            row = flat_row(head, m0) & (~3 if kn.rows_align else ~0)   # :110
            row_load(sLse + stage * kRowsSlot * 4, G["lse"], row, step_full[stage], s)      # :111
            row_load(sDelta + stage * kRowsSlot * 4, G["delta"], row, step_full[stage], s)  # :112
            yield None

    # ---------------------------------------------------------------- consumers: warp programs
    RF = [dict() for _ in range(kConsumers)]          # warpgroup register files, (128, n) per name
    groups = [dict() for _ in range(kConsumers)]      # wgmma group key -> dict(issued VCs, done flag)
    wg_model = be.Wgmma(smem_, fmt)

    class CheckSmem:
        """Adapter for ptx_model.Wgmma: race-checks async reads against the 4 issuing warps' clocks."""
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
        """Warp w of consumer c issues the wgmma group `key`; the 4th warp's issue executes it."""
        grp = groups[c].setdefault(key, dict(vcs={}, done=False, reads=None))
        grp["vcs"][w] = clocks.vc[1 + 4 * c + w].copy()
        if len(grp["vcs"]) == 4:
            csm.ctx = (c, list(grp["vcs"].values()), what)
            csm.read_bytes = []
            with np.errstate(all="ignore"):
                fn()
            grp["reads"] = np.concatenate(csm.read_bytes) if csm.read_bytes else np.zeros(0, np.int64)
            grp["done"] = True

    def wg_wait(c, w, key, what):
        agent = 1 + 4 * c + w
        grp = groups[c][key]

        def acq():
            b = grp["reads"]
            smem_.r_pending[b, agent - 1] = False
            smem_.r_epoch[b, agent - 1] = np.maximum(smem_.r_epoch[b, agent - 1], clocks.vc[agent][agent])
        return Wait(lambda: grp["done"], acq, "wgmma %s" % what)

    def tag_call(kind, c, s, prod, idx, A, B):
        if tag_log is not None:
            tag_log.append((bx, c, s, prod, idx, kind, A, B))

    def do_ss(c, name, desc_a, desc_b, N, scale_d, trans_b, s, prod, idx):
        if tag_log is not None:
            A = tag_bits(kmajor_addresses(desc_a, 64)[0])
            B = tag_bits(kmajor_addresses(desc_b, N)[0]).T if trans_b == 0 else tag_bits(mnmajor_addresses(desc_b, N)[0])
            tag_call("ss", c, s, prod, idx, A, B)
        RF[c][name] = wg_model.ss(RF[c][name], desc_a, desc_b, N, scale_d, 1, 1, 0, trans_b)

    def do_rs(c, name, a_regs, desc_b, N, s, prod, idx):
        if tag_log is not None:
            B = tag_bits(mnmajor_addresses(desc_b, N)[0])
            tag_call("rs", c, s, prod, idx, a_regs.copy(), B)
        RF[c][name], _, _ = wg_model.rs(RF[c][name], a_regs, desc_b, N, True, 1, 1, 1)

    def tag_bits(a):
        a = np.asarray(a)
        return smem_.mem[a].astype(np.int64) | (smem_.mem[a + 1].astype(np.int64) << 8)

    scale_log2 = np.float32(G["scale"]) * be.KLOG2E
    causal_offset = nk - nq

    def consumer_warp(c, w):
        agent = 1 + 4 * c + w
        vc = clocks.vc[agent]
        regs_log[(1 + c, w)] = 240                                     # :118
        lane = np.arange(32)                                           # :119-127
        g, t = lane // 4, lane % 4
        warp_row = w * 16
        my_key0 = walk.key0 + 64 * c
        k_mine = sK + c * 64 * 128
        v_mine = sV + c * 64 * 128
        mine = slice(32 * w, 32 * w + 32)
        RF[c].setdefault("dk", np.zeros((128, kDTiles * 4), np.float32))   # :129-131
        RF[c].setdefault("dv", np.zeros((128, kDTiles * 4), np.float32))
        RF[c].setdefault("p_a", {}); RF[c].setdefault("ds_a", {})
        yield None
        if steps > 0:                                                  # :132
            yield Wait(lambda: kv_full.test_parity(0), lambda: kv_full.acquire(vc, 0), "kv_full")
        for s in range(steps):                                         # :134
            stage = s % kStages
            phase = (s // kStages) & 1
            yield Wait(lambda st=stage, p=phase: step_full[st].test_parity(p),      # :136
                       lambda st=stage, p=phase: step_full[st].acquire(vc, p), "full[%d] parity %d" % (stage, phase))
            if oracle is not None and stage_landed.get(s, 0) != 2 * kSlabs + 2:
                oracle.append("consumer %d warp %d reads step %d with %d of its copies landed"
                              % (c, w, s, stage_landed.get(s, 0)))
            head, m0 = walk.head(s), walk.m0(s)                        # :137
            q_tile = sQ + stage * kQTileBytes
            do_tile = sdO + stage * kQTileBytes
            row_skew = flat_row(head, m0) & 3 if kn.rows_align else 0   # :140
            lse_at = sLse + (stage * kRowsSlot + row_skew) * 4         # :141
            delta_at = sDelta + (stage * kRowsSlot + row_skew) * 4     # :142
            ds_tile = sdS + ((s % 2) if kn.ds_double else 0) * kDsBytes   # :143
            if row_skew + kBlockM > kRowsBox:
                smem_.hz("lse/delta rows %d..%d past the step's %d-float box" % (row_skew, row_skew + kBlockM, kRowsBox))

            # :145-163 S^T = K Q^T and dP^T = V dO^T, m64n{kBlockM}k16
            def f_sdp(s=s, q_tile=q_tile, do_tile=do_tile):
                RF[c]["st"] = np.full((128, kMTiles * 4), np.nan, np.float32)
                RF[c]["dpt"] = np.full((128, kMTiles * 4), np.nan, np.float32)
                for kk in range(D // 16):
                    do_ss(c, "st", be.k_major_descriptor(k_mine, kBlockN, kk), be.k_major_descriptor(q_tile, kBlockM, kk),
                          kBlockM, kk > 0, 0, s, "S", kk)
                for kk in range(D // 16):
                    do_ss(c, "dpt", be.k_major_descriptor(v_mine, kBlockN, kk), be.k_major_descriptor(do_tile, kBlockM, kk),
                          kBlockM, kk > 0, 0, s, "dP", kk)
            wg_issue(c, w, (s, "sdp"), f_sdp, "S^T/dP^T")
            yield wg_wait(c, w, (s, "sdp"), "S^T/dP^T")
            st = RF[c]["st"][mine].reshape(32, kMTiles, 4).copy()
            dpt = RF[c]["dpt"][mine].reshape(32, kMTiles, 4).copy()
            yield None

            # :165-184 P^T and dS^T
            needs_masking = (my_key0 + 64 > nk or m0 + kBlockM > nq
                             or (G["causal"] and my_key0 + 63 > m0 + causal_offset))
            lse_all = smem_.read_generic(lse_at + np.arange(4 * kBlockM), vc, agent, "ld.shared lse").view("<f4")
            delta_all = smem_.read_generic(delta_at + np.arange(4 * kBlockM), vc, agent, "ld.shared delta").view("<f4")
            for nt in range(kMTiles):
                for e in range(4):
                    r = warp_row + g + (e >> 1) * 8
                    cc = nt * 8 + 2 * t + (e & 1)
                    x = (st[:, nt, e] * scale_log2).astype(np.float32)
                    # kernel: a hidden entry is 0 in P^T and dS^T outright
                    kill = np.zeros(x.shape, bool)
                    if needs_masking:
                        key, query = my_key0 + r, m0 + cc
                        kill = key >= nk
                        if kn.mask_query:
                            kill = kill | (query >= nq)
                        if G["causal"]:
                            kill = kill | (key > query + causal_offset)
                        kill = np.broadcast_to(kill, x.shape)
                    lse_c = lse_all[cc]
                    lse_log2 = np.where(lse_c == -np.inf, np.float32(np.inf), lse_c * be.KLOG2E).astype(np.float32)
                    with np.errstate(all="ignore"):
                        prob = np.where(kill, np.float32(0), np.exp2(x - lse_log2)).astype(np.float32)
                        st[:, nt, e] = prob
                        dpt[:, nt, e] = np.where(kill, np.float32(0),
                                                 prob * (dpt[:, nt, e] - delta_all[cc])).astype(np.float32)
            full_st = np.zeros((128, kMTiles, 4), np.float32); full_st[mine] = st
            full_dpt = np.zeros((128, kMTiles, 4), np.float32); full_dpt[mine] = dpt
            for kq in range(kBlockM // 16):                            # :185-190
                RF[c]["p_a"].setdefault(kq, np.zeros((128, 4), np.uint32))[mine] = be.probabilities_as_a(full_st, kq, fmt)[mine]
                dsa = be.probabilities_as_a(full_dpt, kq, fmt)[mine]
                if kn.tags:
                    dsa = ds_tag_regs(kq, 64 * c)[mine]
                RF[c]["ds_a"].setdefault(kq, np.zeros((128, 4), np.uint32))[mine] = dsa
            RF[c].setdefault("dst_check", np.zeros((128, kMTiles, 4), np.float32))[mine] = dpt
            RF[c].setdefault("pt_check", np.zeros((128, kMTiles, 4), np.float32))[mine] = st
            yield None

            # :192-200 stmatrix .trans of dS^T into slab `consumer` of the [kBlockM queries][128 keys] tile
            if oracle is not None and s >= 2 and dq_done.get(s - 2, set()) != set(range(1, 1 + NWARPS)):
                oracle.append("step %d: consumer %d warp %d rewrites dS buffer %d before every warp's dQ of step %d"
                              % (s, c, w, s % 2, s - 2))
            if kn.stats is not None and s >= 1:
                key_ = "dS store of step s while another warp's dQ of step s-1 is not done"
                kn.stats[key_] = kn.stats.get(key_, 0) + (dq_done.get(s - 1, set()) != set(range(1, 1 + NWARPS)))
            slab_off = c * kBlockM * 128 if kn.ds_slab is None else kn.ds_slab(c)
            for kq in range(kBlockM // 16):
                i = lane // 8
                query = (2 * kq + i // 2) * 8 + lane % 8
                key_chunk = 2 * w + i % 2
                addr = ds_tile + slab_off + be.swizzled_chunk_offset(query, key_chunk, kBlockM)
                rows = np.zeros((32, 8), np.uint16)
                regs = RF[c]["ds_a"][kq][mine]
                for l in range(32):
                    for j in range(4):
                        for h in range(2):
                            rr, ee = be.STSM_T[l, j, h]
                            rows[rr, ee] = (int(regs[l, j]) >> (16 * h)) & 0xFFFF
                for rr in range(32):
                    assert addr[rr] % 16 == 0
                b = (addr[:, None] + np.arange(16)[None, :]).ravel()
                smem_.write(b, rows.astype("<u2").view(np.uint8).ravel(), vc, agent, False, "stmatrix dS")
                yield None
            if kn.ds_fence:
                smem_.fence_proxy_async(vc, agent)                     # :201

            # :203-218 dV += P^T dO, dK += dS^T Q
            def f_kv(s=s, q_tile=q_tile, do_tile=do_tile):
                for kq in range(kBlockM // 16):
                    do_rs(c, "dv", RF[c]["p_a"][kq], be.mn_major_descriptor(do_tile, kBlockM, kq), D, s, "dV", kq)
                for kq in range(kBlockM // 16):
                    do_rs(c, "dk", RF[c]["ds_a"][kq], be.mn_major_descriptor(q_tile, kBlockM, kq), D, s, "dK", kq)
            wg_issue(c, w, (s, "kv"), f_kv, "dV/dK")

            def release():
                step_empty[stage].arrive(vc)                            # :224 lane 0 of the warp
                vc[agent] += 1
                released.setdefault(s, set()).add(agent)
            if kn.release_before_wait:
                release()
            yield wg_wait(c, w, (s, "kv"), "dV/dK")                    # :221
            if not kn.release_before_wait:
                release()
            yield None
            # :227 named barrier 1, 256 threads
            if kn.named_barrier:
                gen_ = nb.arrive(Tr.kDsWrittenBarrier, 32, 128 * kConsumers, vc)
                vc[agent] += 1

                def nb_acq(gg=gen_):
                    np.maximum(vc, nb.released[(Tr.kDsWrittenBarrier, gg)], out=vc)
                    vc[agent] += 1
                yield Wait(lambda gg=gen_: (Tr.kDsWrittenBarrier, gg) in nb.released, nb_acq, "bar.sync 1")

            # :229-245 dQ = dS K over all 128 keys for this warpgroup's 64 x 64 quarter
            query0 = (Tr.kDqQueryOffset if kn.dq_query_offset is None else kn.dq_query_offset) * c   # :232
            column0 = (Tr.kDqColumnOffset if kn.dq_column_offset is None else kn.dq_column_offset) * c
            ds_a_tile = ds_tile + (query0 * 128 if kn.dq_a_offset is None else kn.dq_a_offset(query0))  # :233
            k_b_tile = sK + (column0 // 64 * kBlockN * 128 if kn.kb_slab is None else kn.kb_slab(c))   # :234

            def f_dq(s=s, ds_a_tile=ds_a_tile, k_b_tile=k_b_tile):
                RF[c]["dq"] = np.full((128, 32), np.nan, np.float32)
                for kk in range(kBlockN // 16):                        # :240-242
                    do_ss(c, "dq", be.k_major_descriptor(ds_a_tile, kBlockM, kk),
                          be.mn_major_descriptor(k_b_tile, kBlockN, kk), 64, kk > 0, 1, s, "dQ", kk)
            wg_issue(c, w, (s, "dq"), f_dq, "dQ")
            yield wg_wait(c, w, (s, "dq"), "dQ")                       # :244
            dq_done.setdefault(s, set()).add(agent)
            dq = RF[c]["dq"][mine]
            accum_base = ((walk.batch * G["hq"] + head) * nq + m0) * D + column0   # :246
            for h in range(2):                                         # :248-254
                r = (query0 if kn.dq_row_query0 else 0) + warp_row + g + 8 * h
                ok = m0 + r < nq
                for dt in range(8):
                    idx = accum_base + r * D + dt * 8 + 2 * t
                    assert (idx % 2 == 0).all()
                    ii = idx[ok]
                    np.add.at(G["grad_q_accum"], ii, dq[ok, dt * 4 + 2 * h])
                    np.add.at(G["grad_q_accum"], ii + 1, dq[ok, dt * 4 + 2 * h + 1])
            if log is not None:
                log.append((c, w, s))
            yield None
        # :256 store_key_gradients
        dk = RF[c]["dk"][mine].reshape(32, kDTiles, 4)
        dv = RF[c]["dv"][mine].reshape(32, kDTiles, 4)
        be.store_key_gradients(G, fmt, walk, my_key0 + warp_row, dk, dv, g, t)

    agents["producer"] = producer()
    for c in range(kConsumers):
        for w in range(4):
            agents["c%dw%d" % (c, w)] = consumer_warp(c, w)
    with np.errstate(all="ignore"):
        schedule(agents, rng)
    # setmaxnreg: .sync.aligned over the warpgroup -> every warp of a warpgroup, same value
    for wgi in range(3):
        vals = [regs_log.get((wgi, w)) for w in range(4)]
        if len(set(vals)) != 1 or vals[0] is None:
            smem_.hz("setmaxnreg not warpgroup-uniform in warpgroup %d: %s" % (wgi, vals))
    if 128 * 24 + 256 * 240 > 65536:
        smem_.hz("register pool exceeded")
    for i, bar in enumerate(step_full + [kv_full]):
        if bar.tx != 0:
            smem_.hz("mbarrier %s ends with tx-count %d" % (bar.name, bar.tx))
    return smem_


def ds_tag(key, query):
    """Byte tag of dS element (query, key), key and query < 128: bit 6 set (no tensor tag at d=64 has it, its
    columns being < 64), query's low 6 bits in bits 0-5 and bit 6 in bit 7, key in bits 8-14."""
    key, query = np.asarray(key), np.asarray(query)
    return (key << 8) | ((query >> 6) << 7) | 0x40 | (query & 63)


def ds_tag_regs(kq, key_base):
    """dS^T A fragment whose element (m, k) = ds_tag(key key_base + m, query 16 kq + k)."""
    ma, ka = ptx_model.alayout_64x16()
    tags = ds_tag(key_base + ma, 16 * kq + ka)
    a = np.zeros((128, 4), np.uint32)
    for j in range(4):
        a[:, j] = tags[:, 2 * j].astype(np.uint32) | (tags[:, 2 * j + 1].astype(np.uint32) << 16)
    return a


def run_backward(G, fmt, seed=0, dyn_base=0, kn=None, oracle=None, tag_log=None):
    """run_backward_passes + launch_sm90_backward_kernel (blocks in a random order); returns hazards."""
    rng = random.Random(seed)
    be.preprocess(G, fmt)
    kv_size = G["B"] * G["hkv"] * G["nk"] * G["d"]
    if G["head_splits"] > 1:
        G["grad_kv_accum"] = np.zeros(2 * kv_size, np.float32)
    Tr = Traits(G["d"])
    order = make_key_block_order(G, Tr.kBlockN)                        # backward_kernel.cuh:268
    blocks = order[0] * order[1]                                       # :269 order.blocks()
    hazards = []
    tiles = sorted(block_order_at(order, bx) for bx in range(blocks))
    if tiles != [(p_, b_) for p_ in range(order[1]) for b_ in range(order[0])]:
        hazards.append("grid order %s does not visit every (pair, key block) once" % (order,))
    grid = list(range(blocks))
    rng.shuffle(grid)
    for bx in grid:
        sm = run_block(bx, G, fmt, rng, dyn_base, kn, oracle=oracle, tag_log=tag_log, order=order)
        hazards += sm.hazards
    d = G["d"]
    if G["head_splits"] > 1:
        for pair in range(kv_size // 2):
            row, col = pair * 2 // d, pair * 2 % d
            b, h, key = row // (G["hkv"] * G["nk"]), row // G["nk"] % G["hkv"], row % G["nk"]
            ik = b * G["gk_strides"][0] + h * G["gk_strides"][1] + key * G["gk_strides"][2] + col
            iv = b * G["gv_strides"][0] + h * G["gv_strides"][1] + key * G["gv_strides"][2] + col
            G["grad_k"][ik:ik + 2] = fmt.enc(G["grad_kv_accum"][pair * 2:pair * 2 + 2])
            G["grad_v"][iv:iv + 2] = fmt.enc(G["grad_kv_accum"][kv_size + pair * 2:kv_size + pair * 2 + 2])
    rows = G["B"] * G["hq"] * G["nq"]
    acc = G["grad_q_accum"].reshape(rows, d) * np.float32(G["scale"])
    for row in range(rows):
        b, h, q = row // (G["hq"] * G["nq"]), row // G["nq"] % G["hq"], row % G["nq"]
        o = b * G["gq_strides"][0] + h * G["gq_strides"][1] + q * G["gq_strides"][2]
        G["grad_q"][o:o + d] = fmt.enc(acc[row])
    return hazards
