"""Lane-level emulation of cpp/cuda/sm80/backward_kernel.cuh (index mappings,
ldmatrix/mma fragment layouts per PTX, masking, step enumeration, GQA,
strides, the preprocess and convert kernels), in float64, against a dense
float64 reference of the FlashAttention-2 gradients. It mirrors the kernel's
address expressions by hand: change it with the kernel. It checked the
key-block kernel (all head splits) and the atomic dQ path before they first
ran on a GPU; it does not model races, 16-bit rounding or speed.

    python3 dev/cuda/backward_emulator.py        # the fixed cases, every head split

Shared memory is a flat float64 array initialised to NaN: any read of a slot
that was never written (padding columns, rows of another buffer) poisons the
result.  Also asserts every ldmatrix row address is 16-byte aligned and every
read lies inside the intended region.
"""
import itertools
import math
import sys

import numpy as np

L = np.arange(32)
G, TT = L // 4, L % 4
LOG2E = 1.4426950408889634


def ldmatrix_x4(smem, addrs, trans, region=None):
    addrs = np.asarray(addrs)
    assert addrs.shape == (32,)
    assert np.all((addrs * 2) % 16 == 0), "ldmatrix row address not 16-byte aligned"
    if region is not None:
        lo, hi = region
        assert np.all(addrs >= lo) and np.all(addrs + 8 <= hi), "ldmatrix outside its region"
    r = np.empty((4, 32, 2))
    for i in range(4):
        if not trans:
            base = addrs[8 * i + L // 4]
            r[i, :, 0] = smem[base + 2 * (L % 4)]
            r[i, :, 1] = smem[base + 2 * (L % 4) + 1]
        else:
            r[i, :, 0] = smem[addrs[8 * i + 2 * (L % 4)] + L // 4]
            r[i, :, 1] = smem[addrs[8 * i + 2 * (L % 4) + 1] + L // 4]
    return r


def mma(d, a, b0, b1):
    """d: [32,4] accumulators; a: [4,32,2]; b0, b1: [32,2]. PTX m16n8k16 row.col."""
    A = np.zeros((16, 16))
    A[G, 2 * TT], A[G, 2 * TT + 1] = a[0, :, 0], a[0, :, 1]
    A[G + 8, 2 * TT], A[G + 8, 2 * TT + 1] = a[1, :, 0], a[1, :, 1]
    A[G, 2 * TT + 8], A[G, 2 * TT + 9] = a[2, :, 0], a[2, :, 1]
    A[G + 8, 2 * TT + 8], A[G + 8, 2 * TT + 9] = a[3, :, 0], a[3, :, 1]
    B = np.zeros((16, 8))
    B[2 * TT, G], B[2 * TT + 1, G] = b0[:, 0], b0[:, 1]
    B[2 * TT + 8, G], B[2 * TT + 9, G] = b1[:, 0], b1[:, 1]
    C = np.zeros((16, 8))
    C[G, 2 * TT], C[G, 2 * TT + 1], C[G + 8, 2 * TT], C[G + 8, 2 * TT + 1] = d[:, 0], d[:, 1], d[:, 2], d[:, 3]
    D = A @ B + C
    d[:, 0], d[:, 1], d[:, 2], d[:, 3] = D[G, 2 * TT], D[G, 2 * TT + 1], D[G + 8, 2 * TT], D[G + 8, 2 * TT + 1]


def probabilities_as_a(p, kk):
    a = np.empty((4, 32, 2))
    a[0] = p[2 * kk][:, 0:2]
    a[1] = p[2 * kk][:, 2:4]
    a[2] = p[2 * kk + 1][:, 0:2]
    a[3] = p[2 * kk + 1][:, 2:4]
    return a


class Traits:
    def __init__(self, d):
        self.kWarps = 4
        self.kThreads = 128
        self.kBlockN = 64
        self.kBlockM = 64 if d <= 64 else 32
        self.kStride = d + 8
        self.kChunksPerRow = d // 8
        self.kDsStride = self.kBlockM + 8
        self.kDqWarpsM = min(self.kBlockM // 16, self.kWarps)
        self.kDqWarpsD = self.kWarps // self.kDqWarpsM
        self.kDqTiles = d // 8 // self.kDqWarpsD


def load_rows_async(smem, off, Rows, Tr, gmem, head_off, row_stride, row0, valid_rows):
    kRowStep = Tr.kThreads // Tr.kChunksPerRow
    assert Tr.kThreads % Tr.kChunksPerRow == 0 and Rows % kRowStep == 0
    for tid in range(Tr.kThreads):
        r0, col = tid // Tr.kChunksPerRow, tid % Tr.kChunksPerRow * 8
        for i in range(Rows // kRowStep):
            r = r0 + i * kRowStep
            dst = off + r * Tr.kStride + col
            assert (dst * 2) % 16 == 0
            if r < valid_rows:
                src = head_off + (row0 + r) * row_stride + col
                assert (src * 2) % 16 == 0
                smem[dst:dst + 8] = gmem[src:src + 8]
            else:
                smem[dst:dst + 8] = 0.0


class Tensor4:
    """[B, H, N, d] in a flat buffer with arbitrary strides (last dim contiguous)."""

    def __init__(self, arr, order, pad, rng):
        B, H, N, d = arr.shape
        # physical layout: dims permuted by `order`, each padded
        phys = [arr.shape[i] + (pad if i != 3 else 0) for i in order]
        assert order[-1] == 3
        strides_phys = [0] * 4
        s = 1
        for j in reversed(range(4)):
            strides_phys[j] = s
            s *= phys[j]
        self.strides = [0] * 4
        for j, i in enumerate(order):
            self.strides[i] = strides_phys[j]
        # align strides to 8 elements (16 bytes), as as_kernel_operand requires
        for i in range(3):
            assert self.strides[i] % 8 == 0 or arr.shape[i] == 1, self.strides
        self.buf = rng.standard_normal(s + 64) * 1e3  # garbage outside the tensor
        self.buf[:] = np.nan
        for b, h, n in itertools.product(range(B), range(H), range(N)):
            o = b * self.strides[0] + h * self.strides[1] + n * self.strides[2]
            self.buf[o:o + d] = arr[b, h, n]


def reference(q, k, v, do, allowed, add, scale):
    """Dense float64 FA2 math. allowed: bool [B,Hq,Nq,Nk]; add: additive [B,Hq,Nq,Nk]."""
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    grp = Hq // Hkv
    ke = np.repeat(k, grp, axis=1)
    ve = np.repeat(v, grp, axis=1)
    s = scale * q @ ke.transpose(0, 1, 3, 2) + add
    s = np.where(allowed, s, -np.inf)
    vis = allowed.any(-1, keepdims=True) if Nk else np.zeros(s.shape[:-1] + (1,), bool)
    s0 = np.where(vis, s, 0.0)
    m = s0.max(-1, keepdims=True) if Nk else np.zeros(s.shape[:-1] + (1,))
    p = np.exp(s0 - m)
    l = p.sum(-1, keepdims=True)
    p = np.where(vis & allowed, p / np.where(l > 0, l, 1), 0.0)
    lse = np.where(vis, m + np.log(np.where(l > 0, l, 1)), -np.inf)[..., 0]
    out = p @ ve
    dv = (p.transpose(0, 1, 3, 2) @ do).reshape(B, Hkv, grp, Nk, d).sum(2)
    dp = do @ ve.transpose(0, 1, 3, 2)
    delta = (do * out).sum(-1, keepdims=True)
    ds = p * (dp - delta)
    dq = scale * ds @ ke
    dk = (scale * ds.transpose(0, 1, 3, 2) @ q).reshape(B, Hkv, grp, Nk, d).sum(2)
    return out, lse, dq, dk, dv


def emulate(q, k, v, out, lse, do, mask_kind, mask, causal, scale, layouts, rng, check_pads=True, head_splits=1):
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    Tr = Traits(d)
    kBlockM, kBlockN, kStride = Tr.kBlockM, Tr.kBlockN, Tr.kStride
    kMTiles, kDTiles = kBlockM // 8, d // 8
    Q = Tensor4(q, layouts[0], 3, rng)
    K = Tensor4(k, layouts[1], 1, rng)
    V = Tensor4(v, layouts[2], 2, rng)
    O = Tensor4(out, layouts[3], 0, rng)
    DO = Tensor4(do, (0, 1, 2, 3), 0, rng)  # grad_out.contiguous()
    lse_flat = lse.reshape(-1).copy()
    # mask as MaskParams: broadcast strides
    if mask_kind != "none":
        # the kernel sees the un-broadcast storage with stride 0 on broadcast dims
        base_arr = np.ascontiguousarray(mask.base_arr)
        mflat = base_arr.reshape(-1)
        cs = [int(np.prod(base_arr.shape[i + 1:])) for i in range(4)]
        mstr = [0 if base_arr.shape[i] == 1 else cs[i] for i in range(4)]

    def mask_log2(base, row, col):
        i = base + row * mstr[2] + col * mstr[3]
        if mask_kind == "bool":
            return 0.0 if mflat[i] else -np.inf
        return mflat[i] * LOG2E

    # ---- preprocess
    rows_total = B * Hq * Nq
    delta = np.full(rows_total, np.nan)
    accum = np.full(rows_total * d, np.nan)
    for row in range(rows_total):
        batch, head, query = row // (Hq * Nq), row // Nq % Hq, row % Nq
        oo = batch * O.strides[0] + head * O.strides[1] + query * O.strides[2]
        od = batch * DO.strides[0] + head * DO.strides[1] + query * DO.strides[2]
        delta[row] = np.sum(O.buf[oo:oo + d] * DO.buf[od:od + d])
        accum[row * d:(row + 1) * d] = 0.0

    grad_k = np.full(k.size, np.nan)
    grad_v = np.full(v.size, np.nan)
    gk_str = [Hkv * Nk * d, Nk * d, d]

    # ---- main kernel
    n_elems = 2 * kBlockN * kStride + 4 * kBlockM * kStride + kBlockN * Tr.kDsStride
    n_blocks = (Nk + kBlockN - 1) // kBlockN
    group = Hq // Hkv
    offset = Nk - Nq
    kv_size = B * Hkv * Nk * d
    kv_accum = np.zeros(2 * kv_size)
    if B * Hkv * Nk > 0:
        for bid in range(n_blocks * head_splits * Hkv * B):
            smem = np.full(n_elems, np.nan)
            sK, sV = 0, kBlockN * kStride
            sQ = sV + kBlockN * kStride
            sdO = sQ + 2 * kBlockM * kStride
            sdS = sdO + 2 * kBlockM * kStride
            sLse = np.full(2 * kBlockM, np.nan)
            sDelta = np.full(2 * kBlockM, np.nan)
            n_block = bid % n_blocks
            head_split = bid // n_blocks % head_splits
            bh = bid // n_blocks // head_splits
            batch, head_kv = bh // Hkv, bh % Hkv
            split_heads = group // head_splits
            first_head = head_kv * group + head_split * split_heads
            key0 = n_block * kBlockN
            keys = min(kBlockN, Nk - key0)
            load_rows_async(smem, sK, kBlockN, Tr, K.buf, batch * K.strides[0] + head_kv * K.strides[1],
                            K.strides[2], key0, keys)
            load_rows_async(smem, sV, kBlockN, Tr, V.buf, batch * V.strides[0] + head_kv * V.strides[1],
                            V.strides[2], key0, keys)
            first_query = max(0, key0 - offset) if causal else 0
            m_begin = first_query // kBlockM * kBlockM
            steps_per_head = (Nq - m_begin + kBlockM - 1) // kBlockM if first_query < Nq else 0
            steps = steps_per_head * split_heads

            def load_step(s, buf):
                head = first_head + s // steps_per_head
                m0 = m_begin + s % steps_per_head * kBlockM
                rows = Nq - m0
                load_rows_async(smem, sQ + buf * kBlockM * kStride, kBlockM, Tr, Q.buf,
                                batch * Q.strides[0] + head * Q.strides[1], Q.strides[2], m0, rows)
                load_rows_async(smem, sdO + buf * kBlockM * kStride, kBlockM, Tr, DO.buf,
                                batch * DO.strides[0] + head * DO.strides[1], DO.strides[2], m0, rows)
                row_base = (batch * Hq + head) * Nq + m0
                for r in range(kBlockM):
                    l_ = lse_flat[row_base + r] if r < rows else -np.inf
                    sLse[buf * kBlockM + r] = np.inf if l_ == -np.inf else l_ * LOG2E
                    sDelta[buf * kBlockM + r] = delta[row_base + r] if r < rows else 0.0

            if steps > 0:
                load_step(0, 0)
            dk = [np.zeros((kDTiles, 32, 4)) for _ in range(4)]
            dv = [np.zeros((kDTiles, 32, 4)) for _ in range(4)]
            scale_log2 = scale * LOG2E
            has_mask = mask_kind != "none"
            for s in range(steps):
                buf = s % 2
                # the emulation runs step s+1's loads after step s (sequential), which
                # is equivalent given the barrier analysis; poison buffer 1-buf first
                head = first_head + s // steps_per_head
                m0 = m_begin + s % steps_per_head * kBlockM
                q_tile = sQ + buf * kBlockM * kStride
                do_tile = sdO + buf * kBlockM * kStride
                lse_s = sLse[buf * kBlockM:(buf + 1) * kBlockM]
                delta_s = sDelta[buf * kBlockM:(buf + 1) * kBlockM]
                qreg = (q_tile, q_tile + kBlockM * kStride)
                kreg = (sK, sK + kBlockN * kStride)
                vreg = (sV, sV + kBlockN * kStride)
                doreg = (do_tile, do_tile + kBlockM * kStride)
                dsreg = (sdS, sdS + kBlockN * Tr.kDsStride)
                for warp in range(4):
                    key_row = warp * 16
                    st = np.zeros((kMTiles, 32, 4))
                    for kk in range(d // 16):
                        a = ldmatrix_x4(smem, sK + (key_row + L % 16) * kStride + kk * 16 + L // 16 * 8, False, kreg)
                        for np_ in range(kMTiles // 2):
                            b = ldmatrix_x4(smem, q_tile + (np_ * 16 + (L & 7) + (L >> 4 << 3)) * kStride + kk * 16
                                            + ((L >> 3) & 1) * 8, False, qreg)
                            mma(st[2 * np_], a, b[0], b[1])
                            mma(st[2 * np_ + 1], a, b[2], b[3])
                    needs_masking = has_mask or key0 + kBlockN > Nk or (causal and key0 + kBlockN - 1 > m0 + offset)
                    mask_base = 0
                    if has_mask:
                        mask_base = batch * mstr[0] + head * mstr[1]
                    for nt in range(kMTiles):
                        for e in range(4):
                            r = key_row + G + (e >> 1) * 8
                            c = nt * 8 + 2 * TT + (e & 1)
                            with np.errstate(invalid="ignore"):
                                x = st[nt][:, e] * scale_log2 - lse_s[c]
                            if needs_masking:
                                for ln in range(32):
                                    key, query = key0 + r[ln], m0 + c[ln]
                                    if key >= Nk or (causal and key > query + offset):
                                        x[ln] = -np.inf
                                    elif has_mask and query < Nq:
                                        x[ln] += mask_log2(mask_base, query, key)
                            st[nt][:, e] = np.exp2(x)
                    for kq in range(kBlockM // 16):
                        a = probabilities_as_a(st, kq)
                        for dp in range(d // 16):
                            b = ldmatrix_x4(smem, do_tile + (kq * 16 + (L & 7) + (((L >> 3) & 1) << 3)) * kStride
                                            + dp * 16 + (L >> 4 << 3), True, doreg)
                            mma(dv[warp][2 * dp], a, b[0], b[1])
                            mma(dv[warp][2 * dp + 1], a, b[2], b[3])
                    dpt = np.zeros((kMTiles, 32, 4))
                    for kk in range(d // 16):
                        a = ldmatrix_x4(smem, sV + (key_row + L % 16) * kStride + kk * 16 + L // 16 * 8, False, vreg)
                        for np_ in range(kMTiles // 2):
                            b = ldmatrix_x4(smem, do_tile + (np_ * 16 + (L & 7) + (L >> 4 << 3)) * kStride + kk * 16
                                            + ((L >> 3) & 1) * 8, False, doreg)
                            mma(dpt[2 * np_], a, b[0], b[1])
                            mma(dpt[2 * np_ + 1], a, b[2], b[3])
                    for nt in range(kMTiles):
                        for e in range(4):
                            st[nt][:, e] *= dpt[nt][:, e] - delta_s[nt * 8 + 2 * TT + (e & 1)]
                    for kq in range(kBlockM // 16):
                        a = probabilities_as_a(st, kq)
                        for dp in range(d // 16):
                            b = ldmatrix_x4(smem, q_tile + (kq * 16 + (L & 7) + (((L >> 3) & 1) << 3)) * kStride
                                            + dp * 16 + (L >> 4 << 3), True, qreg)
                            mma(dk[warp][2 * dp], a, b[0], b[1])
                            mma(dk[warp][2 * dp + 1], a, b[2], b[3])
                    for nt in range(kMTiles):
                        for h in range(2):
                            o = sdS + (key_row + G + 8 * h) * Tr.kDsStride + nt * 8 + 2 * TT
                            smem[o] = st[nt][:, 2 * h]
                            smem[o + 1] = st[nt][:, 2 * h + 1]
                # __syncthreads: dQ
                for warp in range(4):
                    mt, d0 = warp % Tr.kDqWarpsM, warp // Tr.kDqWarpsM * Tr.kDqTiles * 8
                    dq = np.zeros((Tr.kDqTiles, 32, 4))
                    for kk in range(kBlockN // 16):
                        i = L // 8
                        a = ldmatrix_x4(smem, sdS + (kk * 16 + (i >> 1) * 8 + L % 8) * Tr.kDsStride + mt * 16
                                        + (i & 1) * 8, True, dsreg)
                        for dp in range(Tr.kDqTiles // 2):
                            b = ldmatrix_x4(smem, sK + (kk * 16 + (L & 7) + (((L >> 3) & 1) << 3)) * kStride + d0
                                            + dp * 16 + (L >> 4 << 3), True, kreg)
                            mma(dq[2 * dp], a, b[0], b[1])
                            mma(dq[2 * dp + 1], a, b[2], b[3])
                    base = ((batch * Hq + head) * Nq + m0) * d + d0
                    for h in range(2):
                        r = mt * 16 + G + 8 * h
                        for ln in range(32):
                            if m0 + r[ln] >= Nq:
                                continue
                            for dt in range(Tr.kDqTiles):
                                accum[base + r[ln] * d + dt * 8 + 2 * TT[ln]] += dq[dt][ln, 2 * h]
                                accum[base + r[ln] * d + dt * 8 + 2 * TT[ln] + 1] += dq[dt][ln, 2 * h + 1]
                # step s+1's loads (after all reads of step s in this sequential run;
                # in the kernel they go to the other buffer, checked separately)
                if s + 1 < steps:
                    nb = 1 - buf
                    # poison the other buffer so stale data would show
                    smem[sQ + nb * kBlockM * kStride: sQ + (nb + 1) * kBlockM * kStride] = np.nan
                    smem[sdO + nb * kBlockM * kStride: sdO + (nb + 1) * kBlockM * kStride] = np.nan
                    load_step(s + 1, nb)
            for warp in range(4):
                key_row = warp * 16
                for h in range(2):
                    for ln in range(32):
                        key = key0 + key_row + G[ln] + 8 * h
                        if key >= Nk:
                            continue
                        for dt in range(kDTiles):
                            for e in range(2):
                                col = dt * 8 + 2 * TT[ln] + e
                                gi = batch * gk_str[0] + head_kv * gk_str[1] + key * gk_str[2] + col
                                if head_splits > 1:
                                    kv_row = (batch * Hkv + head_kv) * Nk
                                    ai = (kv_row + key) * d + col
                                    kv_accum[ai] += dk[warp][dt][ln, 2 * h + e] * scale
                                    kv_accum[kv_size + ai] += dv[warp][dt][ln, 2 * h + e]
                                else:
                                    grad_k[gi] = dk[warp][dt][ln, 2 * h + e] * scale
                                    grad_v[gi] = dv[warp][dt][ln, 2 * h + e]
    if head_splits > 1:  # convert_dkv
        for pair in range(kv_size // 2):
            row, col = pair * 2 // d, pair * 2 % d
            batch, head, key = row // (Hkv * Nk), row // Nk % Hkv, row % Nk
            gi = batch * gk_str[0] + head * gk_str[1] + key * gk_str[2] + col
            grad_k[gi], grad_k[gi + 1] = kv_accum[pair * 2], kv_accum[pair * 2 + 1]
            grad_v[gi], grad_v[gi + 1] = kv_accum[kv_size + pair * 2], kv_accum[kv_size + pair * 2 + 1]
    # ---- convert
    grad_q = np.full(q.size, np.nan)
    for pair in range(rows_total * d // 2):
        row, col = pair * 2 // d, pair * 2 % d
        batch, head, query = row // (Hq * Nq), row // Nq % Hq, row % Nq
        gi = ((batch * Hq + head) * Nq + query) * d + col
        grad_q[gi] = accum[row * d + col] * scale
        grad_q[gi + 1] = accum[row * d + col + 1] * scale
    return grad_q.reshape(q.shape), grad_k.reshape(k.shape), grad_v.reshape(v.shape)


class MaskView:
    def __init__(self, full, base_arr):
        self.full, self.base_arr = full, base_arr


def run_case(B, Hq, Hkv, Nq, Nk, d, causal, mask_kind, seed, scale=None, layouts=None, head_splits=1):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Hq, Nq, d))
    k = rng.standard_normal((B, Hkv, Nk, d))
    v = rng.standard_normal((B, Hkv, Nk, d))
    do = rng.standard_normal((B, Hq, Nq, d))
    scale = 1 / math.sqrt(d) if scale is None else scale
    allowed = np.ones((B, Hq, Nq, Nk), bool)
    add = np.zeros((B, Hq, Nq, Nk))
    mask = None
    if mask_kind == "bool":
        mask = rng.random((B, 1, Nq, Nk)) > 0.3
        mask[:, :, ::5, :] = False  # fully masked rows
        base_arr = mask
        mask = MaskView(np.broadcast_to(mask, (B, Hq, Nq, Nk)), base_arr)
        allowed &= mask.full
    elif mask_kind == "additive":
        mask = rng.standard_normal((1, Hq, Nq, Nk))
        mask[rng.random(mask.shape) < 0.2] = -np.inf
        base_arr = mask
        full = np.broadcast_to(mask, (B, Hq, Nq, Nk))
        mask = MaskView(full, base_arr)
        allowed &= full != -np.inf
        add = np.where(np.isinf(full), 0.0, full)
    if causal:
        i = np.arange(Nq)[:, None]
        j = np.arange(Nk)[None, :]
        allowed &= j <= i + (Nk - Nq)
    out, lse, dq, dk, dv = reference(q, k, v, do, allowed, add, scale)
    layouts = layouts or [(0, 1, 2, 3)] * 4
    gq, gk, gv = emulate(q, k, v, out, lse, do, mask_kind, mask, causal, scale, layouts, rng, head_splits=head_splits)
    res = {}
    for name, a, o in (("dq", gq, dq), ("dk", gk, dk), ("dv", gv, dv)):
        assert not np.isnan(a).any(), f"{name}: NaN (unwritten element or poisoned smem read)"
        err = np.abs(a - o).max() if a.size else 0.0
        res[name] = err
        assert err < 1e-9 * max(1, np.abs(o).max() if o.size else 1), (name, err)
    return res


if __name__ == "__main__":
    cases = [
        # B Hq Hkv Nq Nk d causal mask
        (2, 6, 2, 50, 90, 32, True, "bool"),
        (1, 4, 1, 70, 131, 64, False, "additive"),
        (1, 2, 1, 70, 131, 32, False, "none"),
        (1, 2, 1, 70, 131, 32, True, "none"),
        (1, 2, 2, 130, 70, 64, True, "none"),
        (2, 4, 2, 97, 113, 128, True, "bool"),
        (1, 3, 1, 40, 200, 128, True, "additive"),
        (1, 2, 1, 200, 40, 64, True, "bool"),
        (1, 1, 1, 1, 1, 32, True, "none"),
        (1, 2, 1, 33, 0, 64, False, "none"),
        (1, 2, 1, 0, 33, 64, True, "none"),
        (1, 2, 1, 129, 64, 128, True, "additive"),
        (1, 2, 2, 65, 65, 32, False, "additive"),
    ]
    if len(sys.argv) > 1:
        cases = cases[int(sys.argv[1]):int(sys.argv[1]) + 1]
    for c in cases:
        lay = [(0, 2, 1, 3), (1, 0, 2, 3), (0, 1, 2, 3), (2, 0, 1, 3)]
        group = c[1] // c[2]
        for hs in [s for s in range(1, group + 1) if group % s == 0]:
            print(c, "head_splits", hs, run_case(*c, seed=hash(c) % 1000, layouts=lay, head_splits=hs), flush=True)
    print("all ok")
