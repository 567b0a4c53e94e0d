"""Per-thread emulation of cpp/cuda/sm90/forward_kernel.cuh (branch wip/sm90-forward @ 4623e52), with
the hardware (cp.async, wgmma, descriptors, fragments) supplied by ptx_model.py.

Everything in the "transcribed from the kernel" section is a line-by-line transcription of the code under
test (file:line given); everything the hardware does comes from ptx_model.py, which was written from the
PTX ISA text and does not look at the kernel's helper functions.
"""
import numpy as np

from ptx_model import Fmt, Smem, Wgmma, decode_descriptor

WINDOW = 1 << 40  # generic address of shared offset 0 (assumed at least 1024-aligned)


# ============================================================ transcribed from the kernel
def swizzled_chunk_offset(r, chunk, rows):                      # wgmma.cuh:20-22
    return (chunk // 8) * rows * 128 + r * 128 + (((chunk % 8) ^ (r % 8)) << 4)


def smem_descriptor(addr, leading, stride):                     # wgmma.cuh:26-30
    return (((addr & 0x3FFFF) >> 4) | (((leading & 0x3FFFF) >> 4) << 16)
            | (((stride & 0x3FFFF) >> 4) << 32) | (1 << 62))


def k_major_descriptor(tile, rows, kk):                         # wgmma.cuh:35-38
    return smem_descriptor(tile + (kk % 4) * 32 + (kk // 4) * rows * 128, 16, 1024)


def mn_major_descriptor(tile, k_rows, kk):                      # wgmma.cuh:43-45
    return smem_descriptor(tile + kk * 2048, k_rows * 128, 1024)


KLOG2E = np.float32(1.4426950408889634)
KLN2 = np.float32(0.6931471805599453)


class Overrides:
    """Knobs for negative tests (deliberately broken variants), all default to the kernel's code."""
    def __init__(self, **kw):
        self.align = kw.get("align", 1024)
        self.k_desc = kw.get("k_desc", k_major_descriptor)
        self.mn_desc = kw.get("mn_desc", mn_major_descriptor)
        self.trans_b_pv = kw.get("trans_b_pv", 1)
        self.proxy_fence = kw.get("proxy_fence", True)
        self.swap_pack = kw.get("swap_pack", False)


def run_block(block_x, P, fmt, dyn_base, checks, ov=None):
    """One CTA of sm90_forward_kernel<HeadDim, T, IsCausal>. P: dict of problem arrays/shape."""
    ov = ov or Overrides()
    D = P["d"]
    kThreads, kBlockM, kBlockN = 128, 64, 64
    kChunksPerRow = D // 8
    kTileBytes = 64 * D * 2
    kNTiles, kDTiles = kBlockN // 8, D // 8
    smem = P["smem_factory"]()
    wg = Wgmma(smem, fmt)

    tid = np.arange(128)
    warp, lane = tid // 32, tid % 32
    g, t = lane // 4, lane % 4

    # forward_kernel.cuh:59-63: align the dynamic smem base (generic pointer) up to 1024
    raw_generic = WINDOW + dyn_base
    al = ov.align
    aligned_generic = (raw_generic + al - 1) & ~(al - 1)
    sQ = aligned_generic - WINDOW
    sK = sQ + kTileBytes
    sV = sK + kTileBytes
    assert sV + kTileBytes <= dyn_base + 3 * kTileBytes + 1024, "overruns kSmemBytes"

    seqlen_q, seqlen_k = P["nq"], P["nk"]
    causal = P["causal"]
    m_blocks = (seqlen_q + kBlockM - 1) // kBlockM                      # :68
    bh = block_x // m_blocks
    batch, head = bh // P["hq"], bh % P["hq"]
    head_kv = head // (P["hq"] // P["hkv"])
    m_index = block_x % m_blocks
    row0 = (m_blocks - 1 - m_index if causal else m_index) * kBlockM    # :73
    rows = min(kBlockM, seqlen_q - row0)
    causal_offset = seqlen_k - seqlen_q

    q = P["q"][batch, head]      # [Nq, d] uint16 bit patterns
    k = P["k"][batch, head_kv]
    v = P["v"][batch, head_kv]

    key_end = seqlen_k
    if causal:
        key_end = max(0, min(seqlen_k, row0 + rows + causal_offset))   # :82
    n_tiles = (key_end + kBlockN - 1) // kBlockN

    def load_swizzled_async(tile, head_rows, r0, valid_rows):          # :39-49
        for th in range(kThreads):
            for i in range(th, 64 * kChunksPerRow, kThreads):
                r, chunk = i // kChunksPerRow, i % kChunksPerRow
                valid = r < valid_rows
                dst = tile + swizzled_chunk_offset(r, chunk, 64)
                if valid:
                    data = head_rows[r0 + r, chunk * 8:chunk * 8 + 8].astype("<u2").view(np.uint8)
                else:
                    data = np.zeros(16, dtype=np.uint8)   # src-size 0: zero fill
                smem.cp_async(dst, data)

    load_swizzled_async(sQ, q, row0, rows)                              # :85
    if n_tiles > 0:
        load_swizzled_async(sK, k, 0, key_end)                          # :86

    acc = np.zeros((128, kDTiles, 4), dtype=np.float32)                 # :89
    m_i = np.full((128, 2), -np.inf, dtype=np.float32)
    l_i = np.zeros((128, 2), dtype=np.float32)
    scale_log2 = np.float32(P["scale"]) * KLOG2E
    warp_row = warp * 16
    s = np.full((128, kNTiles, 4), np.nan, dtype=np.float32)  # uninitialised on entry

    for j in range(n_tiles):
        col0 = j * kBlockN
        smem.cp_async_wait_all()                                        # K_j landed
        if ov.proxy_fence:
            smem.fence_proxy_async()                                    # writer-side fence
        smem.syncthreads()
        load_swizzled_async(sV, v, col0, key_end - col0)                # :101

        # S = Q K^T                                                      :105-113
        s_flat = s.reshape(128, kNTiles * 4)
        for kk in range(D // 16):
            s_flat = wg.ss(s_flat, ov.k_desc(sQ, 64, kk), ov.k_desc(sK, 64, kk), N=64,
                           scale_d=(kk > 0), scale_a=1, scale_b=1, trans_a=0, trans_b=0)
        smem.wgmma_wait_all()
        s = s_flat.reshape(128, kNTiles, 4).copy()

        # ---- check 3a: emulated S registers vs the true Q K^T, read with the kernel's interpretation
        if checks is not None:
            Qt = fmt.dec(q[row0:row0 + rows]).astype(np.float64)
            Kt = fmt.dec(k[col0:min(col0 + 64, key_end)]).astype(np.float64)
            S_true = np.zeros((64, 64))
            S_true[:rows, :Kt.shape[0]] = Qt @ Kt.T
            nt = np.arange(kNTiles)[None, :, None]
            e = np.arange(4)[None, None, :]
            rr = (warp_row[:, None, None] + g[:, None, None] + 8 * (e >> 1))
            cc = (nt * 8 + 2 * t[:, None, None] + (e & 1))
            err = np.abs(s - S_true[rr, cc]).max()
            tol = 1e-5 * max(1.0, np.abs(S_true).max())
            checks.append(("S=QK^T regs (block %d, tile %d)" % (block_x, j), err, tol))

        needs_masking = (col0 + kBlockN > key_end) or (causal and col0 + kBlockN - 1 > row0 + causal_offset)
        cols = min(kBlockN, key_end - col0)
        diagonal = max(-kBlockM - kBlockN, min(kBlockM + kBlockN, row0 + causal_offset - col0))
        for nt in range(kNTiles):                                      # :120-130
            for e in range(4):
                x = s[:, nt, e] * scale_log2
                if needs_masking:
                    r = warp_row + g + (e >> 1) * 8
                    c = nt * 8 + 2 * t + (e & 1)
                    kill = (c >= cols) | ((c - r > diagonal) if causal else False)
                    x = np.where(kill, np.float32(-np.inf), x)
                s[:, nt, e] = x

        online_softmax_step(s, m_i, l_i, acc)                           # :131

        smem.cp_async_wait_all()                                        # V_j landed
        if ov.proxy_fence:
            smem.fence_proxy_async()                                    # writer-side fence
        smem.syncthreads()
        if j + 1 < n_tiles:
            load_swizzled_async(sK, k, col0 + kBlockN, key_end - col0 - kBlockN)   # :136

        # O += P V                                                       :140-150
        acc_flat = acc.reshape(128, kDTiles * 4)
        a = np.zeros((kBlockN // 16, 128, 4), dtype=np.uint32)
        for kk in range(kBlockN // 16):
            a[kk] = probabilities_as_a(s, kk, fmt, ov.swap_pack)
        acc_before = acc_flat.copy()
        for kk in range(kBlockN // 16):
            acc_flat, A_used, B_used = wg.rs(acc_flat, a[kk], ov.mn_desc(sV, 64, kk), N=D, scale_d=True,
                                             scale_a=1, scale_b=1, trans_b=ov.trans_b_pv)
        smem.wgmma_wait_all()
        # ---- check 3b: emulated (O_after - O_before) vs true P V, with the kernel's interpretation
        if checks is not None:
            Pm = np.zeros((64, 64))
            nt = np.arange(kNTiles)[None, :, None]
            e = np.arange(4)[None, None, :]
            rr = (warp_row[:, None, None] + g[:, None, None] + 8 * (e >> 1)) + 0 * nt
            cc = (nt * 8 + 2 * t[:, None, None] + (e & 1)) + 0 * rr
            Pm[rr, cc] = fmt.round(s)            # the kernel's P, as its registers hold it, rounded to T
            Vt = np.zeros((64, D))
            nv = min(64, key_end - col0)
            Vt[:nv] = fmt.dec(v[col0:col0 + nv])
            PV_true = Pm @ Vt
            dt = np.arange(kDTiles)[None, :, None]
            rr2 = (warp_row[:, None, None] + g[:, None, None] + 8 * (e >> 1)) + 0 * dt
            cc2 = (dt * 8 + 2 * t[:, None, None] + (e & 1)) + 0 * rr2
            delta = (acc_flat - acc_before).reshape(128, kDTiles, 4)
            err = np.abs(delta - PV_true[rr2, cc2]).max()
            tol = 1e-4 * max(1.0, np.abs(PV_true).max())
            checks.append(("O+=PV regs (block %d, tile %d)" % (block_x, j), err, tol))
        acc = acc_flat.reshape(128, kDTiles, 4).copy()
    smem.cp_async_wait_all()                                            # :152

    # Epilogue                                                           :155-168
    out = P["out"][batch, head]
    lse = P["lse"][batch, head]
    for h in range(2):
        l = quad_sum(l_i[:, h])
        inv = np.where(l > 0, np.float32(1.0) / np.where(l > 0, l, 1), np.float32(0))
        r = warp_row + g + h * 8
        ok = r < rows
        for th in np.nonzero(ok)[0]:
            if t[th] == 0:
                lse[row0 + r[th]] = lse_from_log2(m_i[th, h], l[th])
            for dt in range(kDTiles):
                col = dt * 8 + 2 * t[th]
                out[row0 + r[th], col] = fmt.enc(acc[th, dt, 2 * h] * inv[th])
                out[row0 + r[th], col + 1] = fmt.enc(acc[th, dt, 2 * h + 1] * inv[th])
    return smem, wg


def quad_max(x):                                                        # device_math.cuh:179-182
    tid = np.arange(128)
    x = np.maximum(x, x[tid ^ 1])
    return np.maximum(x, x[tid ^ 2])


def quad_sum(x):                                                        # device_math.cuh:183-186
    tid = np.arange(128)
    x = x + x[tid ^ 1]
    return x + x[tid ^ 2]


def online_softmax_step(s, m_i, l_i, acc):                              # online_softmax.cuh:21-48
    NT = s.shape[1]
    for h in range(2):
        row_max = np.full(128, -np.inf, dtype=np.float32)
        for nt in range(NT):
            row_max = np.maximum(row_max, np.maximum(s[:, nt, 2 * h], s[:, nt, 2 * h + 1]))
        m_new = np.maximum(m_i[:, h], quad_max(row_max))
        shift = np.where(m_new == -np.inf, np.float32(0), m_new)
        rescale = np.exp2(m_i[:, h] - shift).astype(np.float32)
        row_sum = np.zeros(128, dtype=np.float32)
        for nt in range(NT):
            s[:, nt, 2 * h] = np.exp2(s[:, nt, 2 * h] - shift)
            s[:, nt, 2 * h + 1] = np.exp2(s[:, nt, 2 * h + 1] - shift)
            row_sum += s[:, nt, 2 * h] + s[:, nt, 2 * h + 1]
        l_i[:, h] = l_i[:, h] * rescale + row_sum
        m_i[:, h] = m_new
        acc[:, :, 2 * h] *= rescale[:, None]
        acc[:, :, 2 * h + 1] *= rescale[:, None]


def pack2(lo, hi, fmt):                                                 # device_math.cuh:83-96
    return fmt.enc(lo).astype(np.uint32) | (fmt.enc(hi).astype(np.uint32) << 16)


def probabilities_as_a(p, kk, fmt, swap=False):                         # online_softmax.cuh:53-59
    a = np.zeros((128, 4), dtype=np.uint32)
    pk = (lambda lo, hi: pack2(hi, lo, fmt)) if swap else (lambda lo, hi: pack2(lo, hi, fmt))
    a[:, 0] = pk(p[:, 2 * kk, 0], p[:, 2 * kk, 1])
    a[:, 1] = pk(p[:, 2 * kk, 2], p[:, 2 * kk, 3])
    a[:, 2] = pk(p[:, 2 * kk + 1, 0], p[:, 2 * kk + 1, 1])
    a[:, 3] = pk(p[:, 2 * kk + 1, 2], p[:, 2 * kk + 1, 3])
    return a


def lse_from_log2(m, l):                                                # online_softmax.cuh:63-65
    return (m + np.log2(l)) * KLN2 if l > 0 else -np.inf


# ============================================================ driver
def make_problem(rng, B, hq, hkv, nq, nk, d, causal, fmt):
    qf = rng.standard_normal((B, hq, nq, d)).astype(np.float32)
    kf = rng.standard_normal((B, hkv, nk, d)).astype(np.float32)
    vf = rng.standard_normal((B, hkv, nk, d)).astype(np.float32)
    P = dict(B=B, hq=hq, hkv=hkv, nq=nq, nk=nk, d=d, causal=causal, scale=1.0 / np.sqrt(d),
             q=fmt.enc(qf), k=fmt.enc(kf), v=fmt.enc(vf),
             out=np.zeros((B, hq, nq, d), dtype=np.uint16), lse=np.full((B, hq, nq), np.nan, dtype=np.float32),
             smem_factory=lambda: Smem(232448))
    return P


def reference(P, fmt):
    q = fmt.dec(P["q"]).astype(np.float64)
    k = fmt.dec(P["k"]).astype(np.float64)
    v = fmt.dec(P["v"]).astype(np.float64)
    g = P["hq"] // P["hkv"]
    k = np.repeat(k, g, axis=1)
    v = np.repeat(v, g, axis=1)
    s = np.einsum("bhqd,bhkd->bhqk", q, k) * P["scale"]
    if P["causal"]:
        off = P["nk"] - P["nq"]
        i = np.arange(P["nq"])[:, None]
        jj = np.arange(P["nk"])[None, :]
        s = np.where(jj <= i + off, s, -np.inf)
    mx = s.max(-1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0)
    p = np.exp(s - mx)
    l = p.sum(-1, keepdims=True)
    o = np.where(l > 0, np.einsum("bhqk,bhkd->bhqd", p, v) / np.where(l > 0, l, 1), 0)
    lse = np.where(l[..., 0] > 0, np.log(np.where(l[..., 0] > 0, l[..., 0], 1)) + mx[..., 0], -np.inf)
    return o, lse


def run_kernel(P, fmt, dyn_base=0, checks=None, ov=None):
    m_blocks = (P["nq"] + 63) // 64
    hazards = []
    for bx in range(m_blocks * P["B"] * P["hq"]):
        smem, wg = run_block(bx, P, fmt, dyn_base, checks, ov)
        hazards += smem.hazards
    return hazards
