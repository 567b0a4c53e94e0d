"""Emulation of the warp-specialised sm90 forward (cpp/cuda/sm90/forward_kernel.cuh on wip/sm90-backward-ws @
1c251b0): a producer thread loading Q once and K, V tiles into two-stage rings (full/empty mbarriers), and
kConsumers consumer warpgroups (3 at d=64, 2 at d=128) that take turns issuing their wgmmas over named barriers
1..kConsumers (round robin; the last consumer gives the initial arrival and skips its final one).

Reuses the rung-2 backward's machinery (backward_ws_emu.py): every warp, the producer thread and every TMA copy is a
coroutine under a seeded random scheduler with skewed speeds; shared memory carries the vector-clock race detector
(mbarrier phases, bar.sync/bar.arrive, wgmma issue/wait); TMA 4-D boxes zero-filled outside (d, N, H, B); wgmma
executed by ptx_model (descriptors, absolute 128B swizzle, CLayout/ALayout fragments). Added here: a named-barrier
model with bar.arrive (counts, generations, arrivals left at exit), a stage oracle (a ring stage overwritten before
all 4 kConsumers warps released it), per-element write accounting of out and lse.

Line numbers (":NN") refer to forward_kernel.cuh @ 1c251b0; those marked 2f5de7d (attn_mask: add_mask, HasMask
dispatch) to that commit.
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
Hazard, Deadlock, Wait, Gen, MBarrier, Clocks = ws.Hazard, ws.Deadlock, ws.Wait, ws.Gen, ws.MBarrier, ws.Clocks


class Traits:                                                            # forward_traits.h:13-34
    def __init__(self, D, consumers=None):
        self.kConsumers = consumers or (3 if D == 64 else 2)
        self.kThreads = 128 * (1 + self.kConsumers)
        self.kBlockM = 64 * self.kConsumers
        self.kBlockN = 128
        self.kStages = 2
        self.kSlabs = D // 64
        self.kQBytes = self.kBlockM * D * 2
        self.kTileBytes = self.kBlockN * D * 2
        self.kProducerRegisters = 24
        self.kConsumerRegisters = 160 if self.kConsumers == 3 else 240
        self.kBarriersOffset = self.kQBytes + 2 * self.kStages * self.kTileBytes
        self.kSmemBytes = self.kBarriersOffset + (1 + 4 * self.kStages) * 8 + 1024


class Knobs:
    """Negative-control knobs; every default is the kernel's code."""
    def __init__(self, **kw):
        self.consumers = kw.get("consumers", None)                 # traits: 3 at d=64, 2 at d=128
        self.initial_by = kw.get("initial_by", None)               # :201 last consumer (None) or this one
        self.final_skip = kw.get("final_skip", True)               # :235 if (!last_consumer)
        self.next_turn = kw.get("next_turn", None)                 # :130 1 + (c + 1) % kC
        self.q_slab = kw.get("q_slab", None)                       # :141 consumer * 64 * 128
        self.q_box_rows = kw.get("q_box_rows", None)               # sm90_dispatch.cu:80 box height = kBlockM
        self.visible_plus = kw.get("visible_plus", 1)              # :176 ... - col0 + 1
        self.needs_masking = kw.get("needs_masking", None)         # :162 (None: kernel) or a replacement fn
        self.mask_mode = kw.get("mask_mode", "visible")            # "visible" (:172-183) or "old" (051b261)
        self.empty_xor = kw.get("empty_xor", 1)                    # :95
        self.empty_count = kw.get("empty_count", None)             # :74 4 * kConsumers
        self.release_k_early = kw.get("release_k_early", False)    # :223 moved above :221 wait<1>
        self.wait1 = kw.get("wait1", 1)                            # :221 wgmma_wait<1>
        self.tma_late = kw.get("tma_late", 0.0)
        # attn_mask (2f5de7d :163-193, :219): "kernel", or a broken variant for negative controls
        self.mask_variant = kw.get("mask_variant", "kernel")
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


def run_block(bx, G, fmt, rng, kn=None, oracle=None, tag_log=None, proto=None, dyn_base=0):
    """One CTA of sm90_forward_kernel<HeadDim, T, IsCausal> (forward_kernel.cuh:33-259)."""
    kn = kn or Knobs()
    D = G["d"]
    Tr = Traits(D, kn.consumers)
    kC, kBlockM, kBlockN, kStages = Tr.kConsumers, Tr.kBlockM, Tr.kBlockN, Tr.kStages
    kNTiles, kDTiles = kBlockN // 8, D // 8
    NW = 4 * kC
    assert NW <= MAXWARPS
    assert Tr.kSmemBytes <= 227 * 1024
    assert 128 * Tr.kProducerRegisters + 128 * kC * Tr.kConsumerRegisters <= 65536

    smem_ = ws.RaceSmem()
    base = ((be.WINDOW + dyn_base + 1023) & ~1023) - be.WINDOW            # :42
    sQ = base
    sK = sQ + Tr.kQBytes
    sV = sK + kStages * Tr.kTileBytes
    bars_at = base + Tr.kBarriersOffset
    assert bars_at + (1 + 4 * kStages) * 8 <= dyn_base + Tr.kSmemBytes and bars_at % 8 == 0

    nq, nk, hq, hkv = G["nq"], G["nk"], G["hq"], G["hkv"]
    m_blocks = (nq + kBlockM - 1) // kBlockM                              # :54
    bh = bx // m_blocks
    batch, head = bh // hq, bh % hq                                       # :56
    head_kv = head // (hq // hkv)                                         # :57
    m_index = bx % m_blocks
    row0 = ((m_blocks - 1 - m_index) if G["causal"] else m_index) * kBlockM   # :63
    rows = min(kBlockM, nq - row0)
    causal_offset = nk - nq
    key_end = max(0, min(nk, row0 + rows + causal_offset)) if G["causal"] else nk   # :66
    n_tiles = (key_end + kBlockN - 1) // kBlockN
    for v in (row0, rows, causal_offset, key_end, row0 + rows + causal_offset):
        assert -2 ** 31 <= v < 2 ** 31, "int overflow"
    if proto is not None:
        proto["n_tiles"] = n_tiles

    n_tma = Tr.kSlabs * (1 + 2 * n_tiles) + 4
    NC = 1 + MAXWARPS + n_tma
    clocks = Clocks(NC)
    q_full = MBarrier("q_full", 1)                                        # :70-76
    k_full = [MBarrier("k_full%d" % s, 1) for s in range(kStages)]
    v_full = [MBarrier("v_full%d" % s, 1) for s in range(kStages)]
    ecount = kn.empty_count or 4 * kC
    k_empty = [MBarrier("k_empty%d" % s, ecount) for s in range(kStages)]
    v_empty = [MBarrier("v_empty%d" % s, ecount) for s in range(kStages)]
    nb = NamedBarriers()
    start = np.ones(NC, np.int64)
    for a in range(1 + MAXWARPS):
        clocks.new(a, start)                                              # __syncthreads :79

    regs_log = {}
    agents = {}
    next_tma = [1 + MAXWARPS]
    landed = {}       # (ring, j) -> copies landed
    released = {}     # (ring, j) -> set of warps that released it

    # ---------------------------------------------------------------- TMA
    def tma(dst_bytes_fn, bar, nbytes, what, ring, j):
        k = next_tma[0]
        next_tma[0] += 1
        vc = clocks.new(k, clocks.vc[0])

        def body():
            if kn.tma_late and rng.random() < kn.tma_late:
                yield None
            yield None
            addr, data = dst_bytes_fn()
            if oracle is not None and ring in ("k", "v") and j >= kStages:
                if released.get((ring, j - kStages), set()) != set(range(1, 1 + NW)):
                    oracle.append("TMA %s tile %d into stage %d before all %d warps released tile %d (%d did)"
                                  % (ring, j, j % kStages, NW, j - kStages, len(released.get((ring, j - kStages), ()))))
            if kn.stats is not None and ring in ("k", "v") and j >= 1:
                key_ = "TMA %s lands while a warp still reads the previous tile" % ring
                kn.stats[key_] = kn.stats.get(key_, 0) + (released.get((ring, j - 1), set()) != set(range(1, 1 + NW)))
            smem_.write(addr, data, vc, k, True, "TMA " + what)
            landed[(ring, j)] = landed.get((ring, j), 0) + 1
            bar.complete_tx(nbytes, vc)
        agents["tma%d" % k] = Gen(body())

    def box_load(dst, name, col0, row, hd, b, box_rows, bar, ring, j):
        assert dst % 1024 == 0, "128B-swizzled TMA destination not 1024-aligned"
        assert box_rows <= 256, "TMA boxDim > 256"
        tma(lambda: ws.swizzled_box_bytes(dst, ws.tma_box_4d(G, name, col0, row, hd, b, box_rows)), bar,
            box_rows * 128, "%s box" % name, ring, j)

    q_box = kn.q_box_rows or kBlockM

    # ---------------------------------------------------------------- producer (:82-107)
    def producer():
        vc = clocks.vc[0]
        for w in range(4):
            regs_log[(0, w)] = Tr.kProducerRegisters                       # :84 whole warpgroup
        if n_tiles == 0:                                                  # :85
            return
        yield None
        q_full.arrive(vc, Tr.kQBytes); vc[0] += 1                         # :89
        for slab in range(Tr.kSlabs):                                     # :90-91
            box_load(sQ + slab * kBlockM * 128, "q", 64 * slab, row0, head, batch, q_box, q_full, "q", 0)

        def load_tile(name, ring, full, empty, j):                        # :93-100
            stage = j % kStages
            par = ((j // kStages) & 1) ^ kn.empty_xor
            yield Wait(lambda: empty[stage].test_parity(par), lambda: empty[stage].acquire(vc, par),
                       "%s_empty[%d] parity %d" % (name, stage, par))
            full[stage].arrive(vc, Tr.kTileBytes); vc[0] += 1
            for slab in range(Tr.kSlabs):
                box_load(ring + stage * Tr.kTileBytes + slab * kBlockN * 128, name, 64 * slab, j * kBlockN, head_kv,
                         batch, kBlockN, full[stage], name, j)
            yield None
        for j in range(n_tiles):                                          # :101-104
            yield from load_tile("k", sK, k_full, k_empty, j)
            if j > 0:
                yield from load_tile("v", sV, v_full, v_empty, j - 1)
        yield from load_tile("v", sV, v_full, v_empty, n_tiles - 1)       # :105

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
        # commit order per warp, to model wait_group<N>
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
            # a completed group leaves the list
            for k in need:
                keys.remove(k)
        return Wait(lambda: all(g_["done"] for g_ in grps), acq, "wgmma wait<%d> %s" % (pending, what))

    def tag_bits(a):
        a = np.asarray(a)
        return smem_.mem[a].astype(np.int64) | (smem_.mem[a + 1].astype(np.int64) << 8)

    def do_ss(c, desc_a, desc_b, kk, j):
        if tag_log is not None:
            tag_log.append(("S", bx, c, j, kk, tag_bits(kmajor_addresses(desc_a, 64)[0]),
                            tag_bits(kmajor_addresses(desc_b, kBlockN)[0]).T))
        RF[c]["s"] = wg_model.ss(RF[c]["s"], desc_a, desc_b, kBlockN, kk > 0, 1, 1, 0, 0)

    def do_rs(c, a_regs, desc_b, kk, j):
        if tag_log is not None:
            tag_log.append(("PV", bx, c, j, kk, a_regs.copy(), tag_bits(mnmajor_addresses(desc_b, D)[0])))
        RF[c]["acc"], _, _ = wg_model.rs(RF[c]["acc"], a_regs, desc_b, D, True, 1, 1, 1)

    scale_log2 = np.float32(np.float32(G["scale"]) * be.KLOG2E)           # :116

    def quad_max(x):                                                      # device_math.cuh:123-126
        ln = np.arange(32)
        x = np.maximum(x, x[ln ^ 1])
        return np.maximum(x, x[ln ^ 2])

    def quad_sum(x):
        ln = np.arange(32)
        x = (x + x[ln ^ 1]).astype(np.float32)
        return (x + x[ln ^ 2]).astype(np.float32)

    # ---------------------------------------------------------------- attn_mask (2f5de7d)
    M_ = G.get("mask")
    mask_base = (batch * M_["strides"][0] + head * M_["strides"][1]) if M_ is not None else 0   # :119

    def mask_value(M, idx):
        """The value_at lambdas of :183-191 (base-2 units, float32)."""
        if ((idx < 0) | (idx >= M["buf"].size)).any():
            M["oob"] += int(((idx < 0) | (idx >= M["buf"].size)).sum())
            idx = np.clip(idx, 0, M["buf"].size - 1)
        v = M["buf"][idx]
        if M["kind"] == "bool":
            return np.where(v != 0, np.float32(0), np.float32(-np.inf)).astype(np.float32)
        if M["kind"] == "f32":
            return (v.astype(np.float32) * be.KLOG2E).astype(np.float32)
        return (fmt.dec(v).astype(np.float32) * be.KLOG2E).astype(np.float32)   # to_float(T) * kLog2e

    def record_mask_reads(M, idx, r, cc):
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

    # ---------------------------------------------------------------- consumer warps (:109-255)
    def consumer_warp(c, w):
        agent = 1 + 4 * c + w
        vc = clocks.vc[agent]
        regs_log[(1 + c, w)] = Tr.kConsumerRegisters                       # :110
        lane = np.arange(32)
        g, t = lane // 4, lane % 4
        wg_row0 = row0 + 64 * c                                           # :114
        warp_row = w * 16
        mine = slice(32 * w, 32 * w + 32)
        RF[c].setdefault("acc", np.zeros((128, D // 2), np.float32))
        RF[c].setdefault("s", np.zeros((128, kBlockN // 2), np.float32))
        RF[c].setdefault("p_a", {})
        m_i = np.full((32, 2), -np.inf, np.float32)
        l_i = np.zeros((32, 2), np.float32)
        last = c == kC - 1                                                # :129
        my_turn = 1 + c
        next_turn = (1 + (c + 1) % kC) if kn.next_turn is None else kn.next_turn(c, kC)
        initial_by = (kC - 1) if kn.initial_by is None else kn.initial_by
        q_off = c * 64 * 128 if kn.q_slab is None else kn.q_slab(c)

        def take_turn():                                                  # :131 bar.sync my_turn, 256
            gen_ = nb.arrive(my_turn, 256, vc, (c, w), "sync")
            vc[agent] += 1

            def acq():
                np.maximum(vc, nb.released[(my_turn, gen_)], out=vc)
                vc[agent] += 1
            return Wait(lambda: (my_turn, gen_) in nb.released, acq, "bar.sync %d" % my_turn)

        def pass_turn():                                                  # :132 bar.arrive next_turn, 256
            nb.arrive(next_turn, 256, vc, (c, w), "arrive")
            vc[agent] += 1

        def issue_scores(j):                                              # :135-144
            k_tile = sK + (j % kStages) * Tr.kTileBytes

            def f():
                RF[c]["s"] = np.full((128, kBlockN // 2), np.nan, np.float32)
                for kk in range(D // 16):
                    do_ss(c, be.k_major_descriptor(sQ + q_off, kBlockM, kk),
                          be.k_major_descriptor(k_tile, kBlockN, kk), kk, j)
            wg_issue(c, w, ("S", j), f, "S_%d" % j)
            commit(c, w, ("S", j))

        def issue_pv(j):                                                  # :146-156
            v_tile = sV + (j % kStages) * Tr.kTileBytes

            def f():
                for kk in range(kBlockN // 16):
                    do_rs(c, RF[c]["p_a"][kk], be.mn_major_descriptor(v_tile, kBlockN, kk), kk, j)
            wg_issue(c, w, ("PV", j), f, "PV_%d" % j)
            commit(c, w, ("PV", j))

        def add_mask(col0, s, force=False):                               # 2f5de7d :167-193
            M = G["mask"]
            rs_, cs_ = M["strides"][2], M["strides"][3]
            var = kn.mask_variant
            row_offset = np.zeros((32, 2), np.int64)
            for h in range(2):                                            # :170-172
                row_offset[:, h] = (mask_base + (wg_row0 + warp_row + g + 8 * h).astype(np.int64) * rs_
                                    + (col0 + (t if var == "col_t" else 2 * t)).astype(np.int64) * cs_)
            row_valid = np.stack([wg_row0 + warp_row + g < nq, wg_row0 + warp_row + g + 8 < nq], 1)   # :173
            if var == "no_row_valid":
                row_valid[:] = True
            for nt in range(kNTiles):                                     # :174-181
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
                    record_mask_reads(M, idx, r, cc)
                    s[sel, nt, e] = (s[sel, nt, e] + mask_value(M, idx)).astype(np.float32)

        def softmax(j, s):                                                # :160-186
            col0 = j * kBlockN
            if kn.needs_masking is None:
                needs = col0 + kBlockN > key_end or (G["causal"] and col0 + kBlockN - 1 > wg_row0 + causal_offset)
            else:
                needs = kn.needs_masking(col0, key_end, wg_row0, causal_offset)
            s *= scale_log2
            if G.get("mask") is not None and kn.mask_variant == "before_hide":   # control: mask added, then hidden
                add_mask(col0, s, force=True)
            if needs:
                if kn.mask_mode == "visible":
                    vis = np.zeros((32, 2), np.int64)
                    for h in range(2):
                        v_ = np.full(32, key_end - col0, np.int64)
                        if G["causal"]:
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
                            hide = (cc >= cols) | ((cc - r > diagonal) if G["causal"] else False)
                            s[hide, nt, e] = -np.inf
            if G.get("mask") is not None:                                 # 2f5de7d :219 if constexpr (HasMask)
                if kn.mask_variant != "before_hide":
                    add_mask(col0, s)
            rescale = np.zeros((32, 2), np.float32)                       # online_softmax.cuh:21-44
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

        def pack(s):                                                      # :187-190
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

        def release(ring, empty, j):                                      # :194-196
            empty[j % kStages].arrive(vc)
            vc[agent] += 1
            released.setdefault((ring, j), set()).add(agent)

        def rescale_rows(rs):                                             # online_softmax.cuh:47-56
            acc = RF[c]["acc"][mine].reshape(32, kDTiles, 4)
            acc[:, :, 0] *= rs[:, 0:1]; acc[:, :, 1] *= rs[:, 0:1]
            acc[:, :, 2] *= rs[:, 1:2]; acc[:, :, 3] *= rs[:, 1:2]
            RF[c]["acc"][mine] = acc.reshape(32, -1)

        def read_s():
            return RF[c]["s"][mine].reshape(32, kNTiles, 4).copy()

        def full_wait(bar, par, what, ring, j):
            def acq():
                bar.acquire(vc, par)
                if oracle is not None and ring is not None:
                    want = Tr.kSlabs
                    if landed.get((ring, j), 0) != want:
                        oracle.append("consumer %d warp %d passes %s with %d/%d copies of %s tile %d landed"
                                      % (c, w, what, landed.get((ring, j), 0), want, ring, j))
            return Wait(lambda: bar.test_parity(par), acq, what)

        def phase(j):
            return (j // kStages) & 1

        yield None
        if n_tiles > 0:                                                   # :199
            yield full_wait(q_full, 0, "q_full", "q", 0)                  # :200
            if c == initial_by:                                           # :201
                pass_turn()
            yield full_wait(k_full[0], 0, "k_full[0]", "k", 0)            # :204
            yield take_turn()                                             # :205
            issue_scores(0)                                               # :206
            pass_turn()                                                   # :207
            yield wg_wait_group(c, w, 0, "S_0")                           # :208
            release("k", k_empty, 0)                                      # :210
            s = read_s()
            softmax(0, s)                                                 # :211
            pack(s)                                                       # :212
            yield None
            for j in range(1, n_tiles):                                   # :214
                yield full_wait(k_full[j % kStages], phase(j), "k_full[%d]" % (j % kStages), "k", j)
                yield take_turn()
                issue_scores(j)
                yield full_wait(v_full[(j - 1) % kStages], phase(j - 1), "v_full[%d]" % ((j - 1) % kStages), "v", j - 1)
                issue_pv(j - 1)
                pass_turn()                                               # :220
                if kn.release_k_early:
                    release("k", k_empty, j)
                yield wg_wait_group(c, w, kn.wait1, "S_%d" % j)           # :221
                if not kn.release_k_early:
                    release("k", k_empty, j)                              # :223
                s = read_s()
                rs = softmax(j, s)                                        # :224
                yield None
                yield wg_wait_group(c, w, 0, "PV_%d" % (j - 1))           # :225
                release("v", v_empty, j - 1)                              # :227
                rescale_rows(rs)                                          # :228
                pack(s)                                                   # :229
                yield None
            n = n_tiles
            yield full_wait(v_full[(n - 1) % kStages], phase(n - 1), "v_full[%d]" % ((n - 1) % kStages), "v", n - 1)
            yield take_turn()                                             # :233
            issue_pv(n - 1)                                               # :234
            if not last or not kn.final_skip:                             # :235
                pass_turn()
            yield wg_wait_group(c, w, 0, "PV_%d" % (n - 1))               # :236
            release("v", v_empty, n - 1)                                  # :238
        # epilogue (:242-255)
        acc = RF[c]["acc"][mine].reshape(32, kDTiles, 4)
        lse_base = (batch * hq + head) * nq
        ob = batch * G["o_strides"][0] + head * G["o_strides"][1]
        for h in range(2):
            l = quad_sum(l_i[:, h])
            with np.errstate(divide="ignore"):
                inv = np.where(l > 0, np.float32(1) / np.where(l > 0, l, 1), np.float32(0)).astype(np.float32)
            r = wg_row0 + warp_row + g + h * 8
            ok = r < row0 + rows                                          # :249
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
        if proto is not None:
            proto.setdefault("finished", set()).add((c, w))

    agents["producer"] = Gen(producer())
    for c in range(kC):
        for w in range(4):
            agents["c%dw%d" % (c, w)] = Gen(consumer_warp(c, w))
    with np.errstate(all="ignore"):
        ws.schedule(agents, rng)
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
    for bar in k_empty + v_empty:
        if bar.pending != bar.count:
            smem_.hz("mbarrier %s ends with %d of %d arrivals pending" % (bar.name, bar.pending, bar.count))
    if proto is not None:
        proto["nb_log"] = nb.log
        proto["nb_gen"] = dict(nb.gen)
    return smem_


# ============================================================ dispatch (2f5de7d)
SM90_HEAD_DIMS = (64, 128)              # forward_sm90.h kSm90HeadDims
SM90_MASKED_HEAD_DIM = 128              # forward_sm90.h kSm90MaskedHeadDim


def use_sm90_forward(d, mask_kind):     # attention_cuda_ops.cpp:69-78 (`takes`)
    masked = mask_kind != "none"
    return d in SM90_HEAD_DIMS and (not masked or d == SM90_MASKED_HEAD_DIM)


def launch_instantiation(d, mask_kind, causal):
    """launch_forward_sm90<HeadDim>: (IsCausal, HasMask) of the kernel it launches, or the exception it throws."""
    masked = mask_kind != "none"
    if d == SM90_MASKED_HEAD_DIM:                                        # if constexpr (kSm90MaskedHeadDim == HeadDim)
        if masked:
            return (causal, True)
    elif masked:
        return "invalid_argument"
    return (causal, False)


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
    """launch_sm90_forward_kernel: every block, in a random order; returns hazards (deadlock raises)."""
    rng = random.Random(seed)
    kC = Traits(G["d"], (kn or Knobs()).consumers).kConsumers
    kBlockM = 64 * kC
    assert max(G["nq"], G["nk"]) <= 2 ** 30                              # sm90_dispatch.cu:74
    if G.get("mask") is not None and G["d"] != SM90_MASKED_HEAD_DIM:    # 2f5de7d forward_kernel.cuh:320-321
        raise ValueError("fusedattn: the sm90 forward takes attn_mask at head dim 128 only")
    if G["B"] * G["hq"] == 0 or G["nq"] == 0:                             # sm90_dispatch.cu:72
        return []
    blocks = (G["nq"] + kBlockM - 1) // kBlockM * G["B"] * G["hq"]
    order = list(range(blocks))
    rng.shuffle(order)
    hazards = []
    for bx in order:
        proto = {} if protos is not None else None
        sm = run_block(bx, G, fmt, rng, kn, oracle=oracle, tag_log=tag_log, proto=proto, dyn_base=dyn_base)
        if protos is not None:
            protos.append(proto)
        hazards += sm.hazards
    return hazards


def results(G, fmt):
    shape = (G["B"], G["hq"], G["nq"], G["d"])
    out = fmt.dec(be.from_flat(G["out"], shape, G["o_strides"])).astype(np.float64)
    writes = be.from_flat(G["out_writes"], shape, G["o_strides"])
    lse = G["lse"].reshape(G["B"], G["hq"], G["nq"]).astype(np.float64)
    return out, lse, writes, G["lse_writes"].reshape(G["B"], G["hq"], G["nq"])
