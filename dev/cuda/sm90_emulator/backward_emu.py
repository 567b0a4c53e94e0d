"""Per-thread emulation of cpp/cuda/sm90/backward_kernel.cuh (branch wip/sm90-backward @ 656d3ed) and the
passes around it (common/backward_passes.cuh), with the hardware (cp.async, wgmma, descriptors, fragments,
stmatrix) supplied by ptx_model.py plus the stmatrix model below.

"transcribed" = line-by-line copy of the code under test (file:line given); "hardware" = written from the PTX ISA /
CUTLASS traits, not from the kernel's helpers.
"""
import functools

import numpy as np

import ptx_model
from ptx_model import Fmt, Smem, Wgmma, cute_eval

# clayout_64xN is a pure function evaluated per call in ptx_model; cache it (same values, much faster).
ptx_model.clayout_64xN = functools.lru_cache(maxsize=None)(ptx_model.clayout_64xN)

WINDOW = 1 << 40  # generic address of shared offset 0 (at least 1024-aligned)
KLOG2E = np.float32(1.4426950408889634)


# ============================================================ hardware additions
class BwSmem(Smem):
    """ptx_model.Smem plus: generic (ld/st.shared, stmatrix) accesses, 4-byte cp.async, and WAR checks against
    reads by other threads not yet ordered by a barrier."""

    def __init__(self, size=232448):
        super().__init__(size)
        self.gen_read = np.zeros(size, dtype=np.int8)   # read through the generic proxy since the last barrier

    def _war(self, lo, hi, what):
        if (self.inflight_reads[lo:hi] != 0).any():
            self.hazards.append(("WAR: %s into bytes a wgmma reads (not waited + barrier'd)" % what, lo))
        if (self.gen_read[lo:hi] != 0).any():
            self.hazards.append(("WAR: %s into bytes other threads read, no barrier since" % what, lo))

    def cp_async(self, dst, data16):
        self._war(int(dst), int(dst) + 16, "cp.async 16")
        super().cp_async(dst, data16)

    def cp_async4(self, dst, data4):
        dst = int(dst)
        assert dst % 4 == 0
        self._war(dst, dst + 4, "cp.async 4")
        self.mem[dst:dst + 4] = data4
        self.state[dst:dst + 4] = 1

    def generic_write16(self, dst, data16):
        dst = int(dst)
        assert dst % 16 == 0, "stmatrix row address must be 16-byte aligned"
        self._war(dst, dst + 16, "st.shared/stmatrix")
        if (self.state[dst:dst + 16] == 1).any():
            self.hazards.append(("WAW: generic store over a pending cp.async", dst))
        self.mem[dst:dst + 16] = data16
        self.state[dst:dst + 16] = 2   # written, no fence, no barrier

    def generic_read_f32(self, addrs):
        addrs = np.asarray(addrs, dtype=np.int64)
        assert (addrs % 4 == 0).all()
        b = (addrs[..., None] + np.arange(4)).ravel()
        st = self.state[b]
        if np.isin(st, (1, 2, 4)).any():
            self.hazards.append(("RAW: ld.shared of bytes in state %s (cp.async not waited or no barrier)"
                                 % sorted(set(st[np.isin(st, (1, 2, 4))].tolist())), int(addrs.ravel()[0])))
        self.gen_read[b] = 1
        raw = self.mem[b].reshape(addrs.shape + (4,)).copy()
        return raw.view("<f4")[..., 0]

    def syncthreads(self):
        super().syncthreads()
        self.gen_read[:] = 0


# stmatrix.sync.aligned.m8n8.x4.trans.shared.b16, from CUTLASS cute/atom/copy_traits_sm90.hpp:
#   Copy_Traits<SM90_U16x8_STSM_T>::SrcLayout = Copy_Traits<SM75_U16x8_LDSM_T>::DstLayout
#       = ((4,8),(16,2,4)) : ((256,16),(1,128,1024))          (thread, register bit) -> bit
#   DstLayout = Copy_Traits<SM75_U16x8_LDSM_T>::SrcLayout = (32,128) : (128,1)   (address lane, bit of its 16-B row) -> bit
# i.e. lane l, register j, half h goes to the 16-byte row addressed by lane 8j + 2(l%4) + h, element l/4:
# PTX ISA "stmatrix": fragment (row l/4, col 2(l%4)+h) of matrix j, stored transposed.
def _stsm_t_map():
    m = np.zeros((32, 4, 2, 2), dtype=np.int64)   # -> (address lane, element within the row)
    for l in range(32):
        for j in range(4):
            for h in range(2):
                x = cute_eval((4, 8), (256, 16), l) + cute_eval((16, 2, 4), (1, 128, 1024), 16 * h + 32 * j)
                assert x % 16 == 0
                m[l, j, h] = (x // 128, (x % 128) // 16)
    flat = m.reshape(-1, 2)
    assert len(set(map(tuple, flat))) == 256   # bijection onto 32 rows x 8 elements
    return m


STSM_T = _stsm_t_map()


def stmatrix_x4_trans(smem, regs, addrs, ov_map=None):
    """One warp: regs (32, 4) uint32, addrs (32,) shared byte addresses (lane i = row i)."""
    mp = STSM_T if ov_map is None else ov_map
    rows = np.zeros((32, 8), dtype=np.uint16)
    for l in range(32):
        for j in range(4):
            for h in range(2):
                r, e = mp[l, j, h]
                rows[r, e] = (int(regs[l, j]) >> (16 * h)) & 0xFFFF
    for r in range(32):
        smem.generic_write16(addrs[r], rows[r].astype("<u2").view(np.uint8))


# ============================================================ transcribed from the kernel and its helpers
def swizzled_chunk_offset(r, chunk, rows):                      # wgmma.cuh:20-22
    return (chunk // 8) * rows * 128 + r * 128 + (((chunk % 8) ^ (r % 8)) << 4)


def smem_descriptor(addr, leading, stride):                     # wgmma.cuh:26-30
    return (((addr & 0x3FFFF) >> 4) | (((leading & 0x3FFFF) >> 4) << 16)
            | (((stride & 0x3FFFF) >> 4) << 32) | (1 << 62))


def k_major_descriptor(tile, rows, kk):                         # wgmma.cuh:35-38
    return smem_descriptor(tile + (kk % 4) * 32 + (kk // 4) * rows * 128, 16, 1024)


def mn_major_descriptor(tile, k_rows, kk):                      # wgmma.cuh:43-45
    return smem_descriptor(tile + kk * 2048, k_rows * 128, 1024)


def pack2(lo, hi, fmt):                                         # device_math.cuh:83-96
    return fmt.enc(lo).astype(np.uint32) | (fmt.enc(hi).astype(np.uint32) << 16)


def probabilities_as_a(p, kk, fmt):                             # online_softmax.cuh:53-60
    a = np.zeros((128, 4), dtype=np.uint32)
    a[:, 0] = pack2(p[:, 2 * kk, 0], p[:, 2 * kk, 1], fmt)
    a[:, 1] = pack2(p[:, 2 * kk, 2], p[:, 2 * kk, 3], fmt)
    a[:, 2] = pack2(p[:, 2 * kk + 1, 0], p[:, 2 * kk + 1, 1], fmt)
    a[:, 3] = pack2(p[:, 2 * kk + 1, 2], p[:, 2 * kk + 1, 3], fmt)
    return a


class Overrides:
    """Knobs for negative controls; every default is the kernel's code."""
    def __init__(self, **kw):
        self.top_fence = kw.get("top_fence", True)            # backward_kernel.cuh:117
        self.load_before_barrier = kw.get("load_before_barrier", False)   # :119 moved above :118
        self.top_barrier = kw.get("top_barrier", True)        # :118
        self.ds_fence = kw.get("ds_fence", True)              # :183
        self.ds_barrier = kw.get("ds_barrier", True)          # :207
        self.dq_trans_b = kw.get("dq_trans_b", 1)             # :220 TransB
        self.dq_slab = kw.get("dq_slab", 64 * 128)            # :221 half * 64 * 128
        self.stsm_chunk_swap = kw.get("stsm_chunk_swap", False)  # :180 i/2 <-> i%2
        self.stsm_map = kw.get("stsm_map", None)              # hardware: non-transposing stmatrix
        self.mask_query = kw.get("mask_query", True)          # :157 query >= seqlen_q
        self.lse_inf = kw.get("lse_inf", True)                # :161
        self.dv_trans_b = kw.get("dv_trans_b", 1)             # wgmma_rs imm-trans-b
        self.single_buffer = kw.get("single_buffer", False)


class KeyBlockWalk:                                             # backward_passes.cuh:82-110
    def __init__(self, bx, G, BlockN=64, BlockM=64):
        nq, nk = G["nq"], G["nk"]
        n_blocks = (nk + BlockN - 1) // BlockN
        n_block = bx % n_blocks
        head_split = bx // n_blocks % G["head_splits"]
        bh = bx // n_blocks // G["head_splits"]
        self.batch = bh // G["hkv"]
        self.head_kv = bh % G["hkv"]
        group = G["hq"] // G["hkv"]
        split_heads = group // G["head_splits"]
        self.first_head = self.head_kv * group + head_split * split_heads
        self.key0 = n_block * BlockN
        self.keys = min(BlockN, nk - self.key0)
        first_query = max(0, self.key0 - (nk - nq)) if G["causal"] else 0
        self.m_begin = first_query // BlockM * BlockM
        self.steps_per_head = (nq - self.m_begin + BlockM - 1) // BlockM if first_query < nq else 0
        self.steps = self.steps_per_head * split_heads
        self.BlockM = BlockM

    def head(self, s):
        return self.first_head + s // self.steps_per_head

    def m0(self, s):
        return self.m_begin + (s % self.steps_per_head) * self.BlockM


def run_block(bx, G, fmt, dyn_base=0, ov=None, checks=None, wlog=None):
    """One CTA of sm90_backward_kernel<HeadDim, T, IsCausal> (backward_kernel.cuh:49-242)."""
    ov = ov or Overrides()
    D = G["d"]
    kThreads, kBlockM, kBlockN = 128, 64, 64
    kMTiles, kDTiles = kBlockM // 8, D // 8
    kTileBytes = 64 * D * 2
    kDsBytes = kBlockM * kBlockN * 2
    kFloatsOffset = 6 * kTileBytes + kDsBytes
    kSmemBytes = kFloatsOffset + 4 * kBlockM * 4 + 1024
    smem = BwSmem()
    wg = Wgmma(smem, fmt, log=wlog)

    tid = np.arange(128)
    warp, lane = tid // 32, tid % 32
    g, t = lane // 4, lane % 4

    smem_base = ((WINDOW + dyn_base + 1023) & ~1023) - WINDOW      # :59
    sK = smem_base
    sV = sK + kTileBytes
    sQ = sV + kTileBytes
    sdO = sQ + 2 * kTileBytes
    sdS = sdO + 2 * kTileBytes
    sLse = smem_base + kFloatsOffset                                # :65 (bytes)
    sDelta = sLse + 2 * kBlockM * 4
    assert sDelta + 2 * kBlockM * 4 <= dyn_base + kSmemBytes, "overruns kSmemBytes"
    assert sdS + kDsBytes <= sLse

    walk = KeyBlockWalk(bx, G)                                      # :72
    nq, nk = G["nq"], G["nk"]
    causal_offset = nk - nq                                         # :73

    def load_swizzled_async(tile, gbuf, head_off, row_stride, row0, valid_rows):   # swizzled_loads.cuh:13-21
        kc = D // 8
        for th in range(kThreads):
            for i in range(th, 64 * kc, kThreads):
                r, chunk = i // kc, i % kc
                valid = r < valid_rows
                dst = tile + swizzled_chunk_offset(r, chunk, 64)
                if valid:
                    src = head_off + (row0 + r) * row_stride + chunk * 8
                    data = gbuf[src:src + 8].astype("<u2").view(np.uint8)
                else:
                    data = np.zeros(16, dtype=np.uint8)                 # src-size 0: zero fill
                smem.cp_async(dst, data)

    qs, ks, vs, dos = G["q_strides"], G["k_strides"], G["v_strides"], G["do_strides"]
    load_swizzled_async(sK, G["k"], walk.batch * ks[0] + walk.head_kv * ks[1], ks[2], walk.key0, walk.keys)  # :77
    load_swizzled_async(sV, G["v"], walk.batch * vs[0] + walk.head_kv * vs[1], vs[2], walk.key0, walk.keys)  # :78

    def load_step(s, buf):                                          # :81-101
        head, m0 = walk.head(s), walk.m0(s)
        rows = nq - m0
        load_swizzled_async(sQ + buf * kTileBytes, G["q"], walk.batch * qs[0] + head * qs[1], qs[2], m0, rows)
        load_swizzled_async(sdO + buf * kTileBytes, G["do"], walk.batch * dos[0] + head * dos[1], dos[2], m0, rows)
        row_base = (walk.batch * G["hq"] + head) * nq + m0
        for th in range(kThreads):
            for r in range(th, 2 * kBlockM, kThreads):
                row = r % kBlockM
                valid = row < rows
                if r < kBlockM:
                    val = G["lse"][row_base + row] if valid else np.float32(0)
                    smem.cp_async4(sLse + (buf * kBlockM + row) * 4, np.array([val], "<f4").view(np.uint8))
                else:
                    val = G["delta"][row_base + row] if valid else np.float32(0)
                    smem.cp_async4(sDelta + (buf * kBlockM + row) * 4, np.array([val], "<f4").view(np.uint8))

    if walk.steps > 0:                                              # :102
        load_step(0, 0)

    dk = np.zeros((128, kDTiles * 4), dtype=np.float32)             # :105
    dv = np.zeros((128, kDTiles * 4), dtype=np.float32)
    scale_log2 = np.float32(G["scale"]) * KLOG2E                    # :108
    warp_row = warp * 16                                            # :109

    for s in range(walk.steps):                                     # :111
        buf = s % 2 if not ov.single_buffer else 0
        smem.cp_async_wait_all()                                    # :113
        if ov.load_before_barrier and s + 1 < walk.steps:
            load_step(s + 1, 1 - buf if not ov.single_buffer else 0)
        if ov.top_fence:
            smem.fence_proxy_async()                                # :117
        if ov.top_barrier:
            smem.syncthreads()                                      # :118
        if not ov.load_before_barrier and s + 1 < walk.steps:
            load_step(s + 1, 1 - buf if not ov.single_buffer else 0)   # :119

        head, m0 = walk.head(s), walk.m0(s)                         # :122
        q_tile = sQ + buf * kTileBytes
        do_tile = sdO + buf * kTileBytes
        lse_addr = sLse + buf * kBlockM * 4
        delta_addr = sDelta + buf * kBlockM * 4

        # :129-144 S^T = K Q^T, dP^T = V dO^T (registers uninitialised: NaN)
        st = np.full((128, kMTiles * 4), np.nan, dtype=np.float32)
        dpt = np.full((128, kMTiles * 4), np.nan, dtype=np.float32)
        for kk in range(D // 16):
            st = wg.ss(st, k_major_descriptor(sK, 64, kk), k_major_descriptor(q_tile, 64, kk), N=64,
                       scale_d=kk > 0, scale_a=1, scale_b=1, trans_a=0, trans_b=0)
        for kk in range(D // 16):
            dpt = wg.ss(dpt, k_major_descriptor(sV, 64, kk), k_major_descriptor(do_tile, 64, kk), N=64,
                        scale_d=kk > 0, scale_a=1, scale_b=1, trans_a=0, trans_b=0)
        smem.wgmma_wait_all()                                       # :142
        st = st.reshape(128, kMTiles, 4).copy()
        dpt = dpt.reshape(128, kMTiles, 4).copy()

        # ground truth for this step, for the per-register checks (independent of the kernel)
        if checks is not None:
            Kt = np.zeros((64, D)); Vt = np.zeros((64, D)); Qt = np.zeros((64, D)); dOt = np.zeros((64, D))
            kr, qr = walk.keys, min(64, nq - m0)
            Kt[:kr] = G["K"][walk.batch, walk.head_kv, walk.key0:walk.key0 + kr]
            Vt[:kr] = G["V"][walk.batch, walk.head_kv, walk.key0:walk.key0 + kr]
            Qt[:qr] = G["Q"][walk.batch, head, m0:m0 + qr]
            dOt[:qr] = G["dO"][walk.batch, head, m0:m0 + qr]
            ee = np.arange(4)[None, None, :]
            nt_ = np.arange(kMTiles)[None, :, None]
            RR = warp_row[:, None, None] + g[:, None, None] + 8 * (ee >> 1) + 0 * nt_
            CC = nt_ * 8 + 2 * t[:, None, None] + (ee & 1) + 0 * RR
            St_true, dPt_true = Kt @ Qt.T, Vt @ dOt.T
            checks.append(("S^T regs", np.abs(st - St_true[RR, CC]).max(), 1e-5 * max(1, np.abs(St_true).max())))
            checks.append(("dP^T regs", np.abs(dpt - dPt_true[RR, CC]).max(), 1e-5 * max(1, np.abs(dPt_true).max())))

        # :147-166 P^T and dS^T
        needs_masking = (walk.key0 + kBlockN > nk or m0 + kBlockM > nq
                         or (G["causal"] and walk.key0 + kBlockN - 1 > m0 + causal_offset))
        for nt in range(kMTiles):
            for e in range(4):
                r = warp_row + g + (e >> 1) * 8
                c = nt * 8 + 2 * t + (e & 1)
                x = st[:, nt, e] * scale_log2
                if needs_masking:
                    key, query = walk.key0 + r, m0 + c
                    kill = key >= nk
                    if ov.mask_query:
                        kill = kill | (query >= nq)
                    if G["causal"]:
                        kill = kill | (key > query + causal_offset)
                    x = np.where(kill, np.float32(-np.inf), x).astype(np.float32)
                lse_c = smem.generic_read_f32(lse_addr + c * 4)
                if ov.lse_inf:
                    lse_log2 = np.where(lse_c == -np.inf, np.float32(np.inf), lse_c * KLOG2E).astype(np.float32)
                else:
                    lse_log2 = (lse_c * KLOG2E).astype(np.float32)
                with np.errstate(invalid="ignore"):
                    prob = np.exp2(x - lse_log2).astype(np.float32)
                st[:, nt, e] = prob
                delta_c = smem.generic_read_f32(delta_addr + c * 4)
                with np.errstate(invalid="ignore"):
                    dpt[:, nt, e] = prob * (dpt[:, nt, e] - delta_c)

        p_a = [probabilities_as_a(st, kq, fmt) for kq in range(kBlockM // 16)]   # :167-172
        ds_a = [probabilities_as_a(dpt, kq, fmt) for kq in range(kBlockM // 16)]

        # :179-182 stmatrix .trans of dS^T's A fragments -> dS [query][key], swizzled
        for kq in range(kBlockM // 16):
            i = lane // 8
            if ov.stsm_chunk_swap:
                query, key_chunk = (2 * kq + i % 2) * 8 + lane % 8, 2 * warp + i // 2
            else:
                query, key_chunk = (2 * kq + i // 2) * 8 + lane % 8, 2 * warp + i % 2
            addr = sdS + swizzled_chunk_offset(query, key_chunk, 64)
            for w in range(4):
                sl = slice(32 * w, 32 * w + 32)
                stmatrix_x4_trans(smem, ds_a[kq][sl], addr[sl], ov.stsm_map)
        if ov.ds_fence:
            smem.fence_proxy_async()                                # :183

        # :188-206 dV += P^T dO, dK += dS^T Q
        dv_before, dk_before = dv.copy(), dk.copy()
        for kq in range(kBlockM // 16):
            dv, _, _ = wg.rs(dv, p_a[kq], mn_major_descriptor(do_tile, 64, kq), N=D, scale_d=True,
                             scale_a=1, scale_b=1, trans_b=ov.dv_trans_b)
        for kq in range(kBlockM // 16):
            dk, _, _ = wg.rs(dk, ds_a[kq], mn_major_descriptor(q_tile, 64, kq), N=D, scale_d=True,
                             scale_a=1, scale_b=1, trans_b=ov.dv_trans_b)
        smem.wgmma_wait_all()                                       # :204
        if ov.ds_barrier:
            smem.syncthreads()                                      # :207

        # the kernel's own P^T, dS^T (rounded to T as its registers hold them)
        if checks is not None:
            Pt = np.zeros((64, 64)); dSt = np.zeros((64, 64))
            Pt[RR, CC] = fmt.round(st); dSt[RR, CC] = fmt.round(dpt)
            ee2 = np.arange(4)[None, None, :]
            dt_ = np.arange(kDTiles)[None, :, None]
            R2 = warp_row[:, None, None] + g[:, None, None] + 8 * (ee2 >> 1) + 0 * dt_
            C2 = dt_ * 8 + 2 * t[:, None, None] + (ee2 & 1) + 0 * R2
            dv_true, dk_true = Pt @ dOt, dSt @ Qt
            checks.append(("dV+=P^T dO regs", np.abs((dv - dv_before).reshape(128, kDTiles, 4) - dv_true[R2, C2]).max(),
                           1e-4 * max(1, np.abs(dv_true).max())))
            checks.append(("dK+=dS^T Q regs", np.abs((dk - dk_before).reshape(128, kDTiles, 4) - dk_true[R2, C2]).max(),
                           1e-4 * max(1, np.abs(dk_true).max())))

        # :211-233 dQ = dS K, 64 columns at a time, red.add into the float32 accumulator
        accum_base = ((walk.batch * G["hq"] + head) * nq + m0) * D
        for half in range(D // 64):
            dq = np.full((128, 32), np.nan, dtype=np.float32)
            for kk in range(kBlockN // 16):
                dq = wg.ss(dq, k_major_descriptor(sdS, 64, kk), mn_major_descriptor(sK + half * ov.dq_slab, 64, kk),
                           N=64, scale_d=kk > 0, scale_a=1, scale_b=1, trans_a=0, trans_b=ov.dq_trans_b)
            smem.wgmma_wait_all()                                   # :223
            if checks is not None:
                dS = dSt.T                                          # [query][key]
                dq_true = dS @ Kt[:, half * 64:half * 64 + 64]
                d8 = np.arange(8)[None, :, None]
                R3 = warp_row[:, None, None] + g[:, None, None] + 8 * (ee2 >> 1) + 0 * d8
                C3 = d8 * 8 + 2 * t[:, None, None] + (ee2 & 1) + 0 * R3
                checks.append(("dQ=dS K regs", np.abs(dq.reshape(128, 8, 4) - dq_true[R3, C3]).max(),
                               1e-4 * max(1, np.abs(dq_true).max())))
            for h in range(2):
                r = warp_row + g + 8 * h
                ok = m0 + r < nq
                for dt in range(8):
                    idx = accum_base + r * D + half * 64 + dt * 8 + 2 * t
                    assert (idx % 2 == 0).all(), "red.global.add.v2.f32 needs 8-byte alignment"
                    ii = idx[ok]
                    np.add.at(G["grad_q_accum"], ii, dq[ok, dt * 4 + 2 * h])      # red.add.v2: (x, y)
                    np.add.at(G["grad_q_accum"], ii + 1, dq[ok, dt * 4 + 2 * h + 1])
    smem.cp_async_wait_all()                                        # :235
    store_key_gradients(G, fmt, walk, walk.key0 + warp_row, dk.reshape(128, kDTiles, 4),
                        dv.reshape(128, kDTiles, 4), g, t)          # :238
    if (smem.state == 1).any():
        smem.hazards.append(("cp.async still pending at exit", 0))
    return smem


def store_key_gradients(G, fmt, walk, first_key, dk, dv, g, t):   # backward_passes.cuh:116-148
    D, nk = G["d"], G["nk"]
    kv_row = (walk.batch * G["hkv"] + walk.head_kv) * nk
    kv_size = G["B"] * G["hkv"] * nk * D
    scale = np.float32(G["scale"])
    gks, gvs = G["gk_strides"], G["gv_strides"]
    for h in range(2):
        key = first_key + g + 8 * h
        ok = key < nk
        for dt in range(D // 8):
            col = dt * 8 + 2 * t
            if G["head_splits"] > 1:
                acc = G["grad_kv_accum"]
                ii = ((kv_row + key) * D + col)[ok]
                np.add.at(acc, ii, (dk[ok, dt, 2 * h] * scale).astype(np.float32))
                np.add.at(acc, ii + 1, (dk[ok, dt, 2 * h + 1] * scale).astype(np.float32))
                np.add.at(acc, ii + kv_size, dv[ok, dt, 2 * h])
                np.add.at(acc, ii + kv_size + 1, dv[ok, dt, 2 * h + 1])
            else:
                ik = (walk.batch * gks[0] + walk.head_kv * gks[1] + key * gks[2] + col)[ok]
                iv = (walk.batch * gvs[0] + walk.head_kv * gvs[1] + key * gvs[2] + col)[ok]
                G["grad_k"][ik] = fmt.enc(dk[ok, dt, 2 * h] * scale)
                G["grad_k"][ik + 1] = fmt.enc(dk[ok, dt, 2 * h + 1] * scale)
                G["grad_v"][iv] = fmt.enc(dv[ok, dt, 2 * h])
                G["grad_v"][iv + 1] = fmt.enc(dv[ok, dt, 2 * h + 1])


# ============================================================ the passes around it (backward_passes.cuh:150-181)
def bshd_strides(H, N, d):
    """[B, N, H, d] storage (PyTorch's usual layout seen as [B, H, N, d]): (batch, head, row) strides."""
    return (N * H * d, d, H * d)


def to_flat(x, strides):
    B, H, N, d = x.shape
    out = np.zeros(B * strides[0], dtype=x.dtype)
    for b in range(B):
        for h in range(H):
            for n in range(N):
                o = b * strides[0] + h * strides[1] + n * strides[2]
                out[o:o + d] = x[b, h, n]
    return out


def from_flat(buf, shape, strides):
    B, H, N, d = shape
    x = np.zeros(shape, dtype=buf.dtype)
    for b in range(B):
        for h in range(H):
            for n in range(N):
                o = b * strides[0] + h * strides[1] + n * strides[2]
                x[b, h, n] = buf[o:o + d]
    return x


def forward_reference(Q, K, V, scale, causal):
    """float64 O, lse of softmax(Q K^T scale) V (GQA: K, V repeated)."""
    g = Q.shape[1] // K.shape[1]
    K, V = np.repeat(K, g, axis=1), np.repeat(V, g, axis=1)
    s = np.einsum("bhqd,bhkd->bhqk", Q, K) * scale
    nq, nk = Q.shape[2], K.shape[2]
    vis = np.ones((nq, nk), bool)
    if causal:
        vis = np.arange(nk)[None, :] <= np.arange(nq)[:, None] + (nk - nq)
    s = np.where(vis, s, -np.inf)
    mx = s.max(-1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0)
    p = np.exp(s - mx)
    l = p.sum(-1, keepdims=True)
    P = np.where(l > 0, p / np.where(l > 0, l, 1), 0)
    O = np.einsum("bhqk,bhkd->bhqd", P, V)
    lse = np.where(l[..., 0] > 0, np.log(np.where(l[..., 0] > 0, l[..., 0], 1)) + mx[..., 0], -np.inf)
    return O, lse, P, vis


def backward_reference(Q, K, V, dO, scale, causal, hkv, round_fn=None, O_used=None, lse_used=None):
    """float64 dQ, dK, dV. With round_fn: the same with P and dS rounded as the kernel rounds them, P from the
    float32 lse the kernel reads, delta from the O the kernel reads (a tight reference for the emulation)."""
    O, lse, P, vis = forward_reference(Q, K, V, scale, causal)
    g = Q.shape[1] // hkv
    Kr, Vr = np.repeat(K, g, axis=1), np.repeat(V, g, axis=1)
    if round_fn is not None:
        s = np.einsum("bhqd,bhkd->bhqk", Q, Kr) * scale
        L = lse_used.astype(np.float64)[..., None]
        P = np.where(vis & np.isfinite(L), np.exp(s - np.where(np.isfinite(L), L, 0)), 0)
        O = O_used
    delta = (dO * O).sum(-1, keepdims=True)
    dP = np.einsum("bhqd,bhkd->bhqk", dO, Vr)
    dS = P * (dP - delta)
    Pm, dSm = (round_fn(P), round_fn(dS)) if round_fn is not None else (P, dS)
    dV = np.einsum("bhqk,bhqd->bhkd", Pm, dO)
    dK = np.einsum("bhqk,bhqd->bhkd", dSm, Q) * scale
    dQ = np.einsum("bhqk,bhkd->bhqd", dSm, Kr) * scale
    B, _, nk, d = K.shape
    dK = dK.reshape(B, hkv, g, nk, d).sum(2)
    dV = dV.reshape(B, hkv, g, nk, d).sum(2)
    return dQ, dK, dV


def make_problem(rng, B, hq, hkv, nq, nk, d, causal, fmt, head_splits=1):
    Qb = fmt.enc(rng.standard_normal((B, hq, nq, d)).astype(np.float32))
    Kb = fmt.enc(rng.standard_normal((B, hkv, nk, d)).astype(np.float32))
    Vb = fmt.enc(rng.standard_normal((B, hkv, nk, d)).astype(np.float32))
    dOb = fmt.enc(rng.standard_normal((B, hq, nq, d)).astype(np.float32))
    Q, K, V, dO = (fmt.dec(x).astype(np.float64) for x in (Qb, Kb, Vb, dOb))
    scale = 1.0 / np.sqrt(d)
    O, lse, _, _ = forward_reference(Q, K, V, scale, causal)
    Ob = fmt.enc(O.astype(np.float32))                      # what the forward wrote
    qs, ks = bshd_strides(hq, nq, d), bshd_strides(hkv, nk, d)
    G = dict(B=B, hq=hq, hkv=hkv, nq=nq, nk=nk, d=d, causal=causal, scale=scale, head_splits=head_splits,
             Q=Q, K=K, V=V, dO=dO, O_used=fmt.dec(Ob).astype(np.float64),
             q=to_flat(Qb, qs), k=to_flat(Kb, ks), v=to_flat(Vb, ks), do=to_flat(dOb, qs), o=to_flat(Ob, qs),
             q_strides=qs, k_strides=ks, v_strides=ks, do_strides=qs, o_strides=qs,
             gq_strides=qs, gk_strides=ks, gv_strides=ks,
             lse=lse.astype(np.float32).ravel(),
             grad_q=np.zeros(B * qs[0], np.uint16), grad_k=np.zeros(B * ks[0], np.uint16),
             grad_v=np.zeros(B * ks[0], np.uint16))
    return G


def preprocess(G, fmt):                                         # backward_passes.cuh:19-39
    B, hq, nq, d = G["B"], G["hq"], G["nq"], G["d"]
    delta = np.zeros(B * hq * nq, np.float32)
    for row in range(B * hq * nq):
        b, h, q = row // (hq * nq), row // nq % hq, row % nq
        oo = b * G["o_strides"][0] + h * G["o_strides"][1] + q * G["o_strides"][2]
        do = b * G["do_strides"][0] + h * G["do_strides"][1] + q * G["do_strides"][2]
        prod = fmt.dec(G["o"][oo:oo + d]) * fmt.dec(G["do"][do:do + d])
        lanes = np.zeros(32, np.float32)
        for c in range(d):
            lanes[c % 32] += prod[c]
        for off in (16, 8, 4, 2, 1):
            lanes = lanes + lanes[np.arange(32) ^ off]
        delta[row] = lanes[0]
    G["delta"] = delta
    G["grad_q_accum"] = np.zeros(B * hq * nq * d, np.float32)


def run_backward(G, fmt, dyn_base=0, ov=None, checks=None, block_order=None):
    """run_backward_passes + launch_sm90_backward_kernel; returns hazards."""
    preprocess(G, fmt)
    kv_size = G["B"] * G["hkv"] * G["nk"] * G["d"]
    if G["head_splits"] > 1:
        G["grad_kv_accum"] = np.zeros(2 * kv_size, np.float32)
    blocks = (G["nk"] + 63) // 64 * G["head_splits"] * G["hkv"] * G["B"]
    hazards = []
    order = range(blocks) if block_order is None else block_order(blocks)
    for bx in order:
        sm = run_block(bx, G, fmt, dyn_base, ov, checks)
        hazards += sm.hazards
    d = G["d"]
    if G["head_splits"] > 1:                                    # backward_convert_dkv_kernel
        for pair in range(kv_size // 2):
            row, col = pair * 2 // d, pair * 2 % d
            b, h, key = row // (G["hkv"] * G["nk"]), row // G["nk"] % G["hkv"], row % G["nk"]
            ik = b * G["gk_strides"][0] + h * G["gk_strides"][1] + key * G["gk_strides"][2] + col
            iv = b * G["gv_strides"][0] + h * G["gv_strides"][1] + key * G["gv_strides"][2] + col
            G["grad_k"][ik:ik + 2] = fmt.enc(G["grad_kv_accum"][pair * 2:pair * 2 + 2])
            G["grad_v"][iv:iv + 2] = fmt.enc(G["grad_kv_accum"][kv_size + pair * 2:kv_size + pair * 2 + 2])
    rows = G["B"] * G["hq"] * G["nq"]                           # backward_convert_dq_kernel
    acc = G["grad_q_accum"].reshape(rows, d) * np.float32(G["scale"])
    for row in range(rows):
        b, h, q = row // (G["hq"] * G["nq"]), row // G["nq"] % G["hq"], row % G["nq"]
        o = b * G["gq_strides"][0] + h * G["gq_strides"][1] + q * G["gq_strides"][2]
        G["grad_q"][o:o + d] = fmt.enc(acc[row])
    return hazards


def results(G, fmt):
    qshape = (G["B"], G["hq"], G["nq"], G["d"])
    kshape = (G["B"], G["hkv"], G["nk"], G["d"])
    dq = fmt.dec(from_flat(G["grad_q"], qshape, G["gq_strides"])).astype(np.float64)
    dk = fmt.dec(from_flat(G["grad_k"], kshape, G["gk_strides"])).astype(np.float64)
    dv = fmt.dec(from_flat(G["grad_v"], kshape, G["gv_strides"])).astype(np.float64)
    return dq, dk, dv
