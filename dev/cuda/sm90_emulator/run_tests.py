"""Drives the emulator: (1) byte-level operand identity of every wgmma the kernel issues, (2) per-register
S and PV checks inside the full kernel loop, (3) end-to-end attention vs a float64 reference,
(4) negative controls proving the emulator notices wrong descriptors / alignment / trans-b / fences."""
import sys
import numpy as np

import kernel_emu as ke
from ptx_model import (Fmt, Smem, Wgmma, decode_descriptor, kmajor_addresses, mnmajor_addresses,
                       clayout_64xN, alayout_64x16)

np.set_printoptions(linewidth=160)
failures = []


def expect(cond, msg):
    print(("  ok   " if cond else "  FAIL ") + msg)
    if not cond:
        failures.append(msg)


# ----------------------------------------------------------------- 0. fragment maps
print("== 0. fragment maps (CUTLASS CLayout/ALayout evaluated as CuTe layouts) vs the kernel's reading")
for N in (64, 128):
    m, n = clayout_64xN(N)
    tid = np.arange(128)[:, None]
    i = np.arange(N // 2)[None, :]
    km = 16 * (tid // 32) + (tid % 32) // 4 + 8 * ((i >> 1) & 1)
    kn = 8 * (i >> 2) + 2 * (tid % 4) + (i & 1)
    expect((m == km).all() and (n == kn).all(),
           "D m64n%dk16 f32: reg i of thread tid = (16*warp + g + 8*((i>>1)&1), 8*(i>>2) + 2t + (i&1))" % N)
ma, ka = alayout_64x16()
tid = np.arange(128)[:, None]
v = np.arange(8)[None, :]
expect((ma == 16 * (tid // 32) + (tid % 32) // 4 + 8 * ((v >> 1) & 1)).all()
       and (ka == 2 * (tid % 4) + (v & 1) + 8 * (v >> 2)).all(),
       "A m64nNk16 f16 regs: element v (a0..a7) = (16*warp + g + 8*((v>>1)&1), 2t + (v&1) + 8*(v>>2)) "
       "== mma.m16n8k16 A fragment per warp")

# ----------------------------------------------------------------- 1. byte-level operand identity
print("\n== 1. which shared-memory bytes each wgmma reads (tagged tiles; element (r,c) holds tag r*256+c)")


def load_tagged(smem, tile, D):
    """load_swizzled_async transcription with tags instead of data (forward_kernel.cuh:39-49)."""
    kc = D // 8
    for th in range(128):
        for i in range(th, 64 * kc, 128):
            r, chunk = i // kc, i % kc
            tags = (r * 256 + chunk * 8 + np.arange(8)).astype("<u2")
            smem.cp_async(tile + ke.swizzled_chunk_offset(r, chunk, 64), tags.view(np.uint8))
    smem.cp_async_wait_all(); smem.syncthreads(); smem.fence_proxy_async()


def read_tags(smem, addrs):
    return smem.mem[addrs].astype(np.int64) | (smem.mem[addrs + 1].astype(np.int64) << 8)


for D in (64, 128):
    for dyn_base in (0, 16, 1024 + 48, 4096 - 16):
        smem = Smem()
        raw = ke.WINDOW + dyn_base
        sQ = ((raw + 1023) & ~1023) - ke.WINDOW
        tb = 64 * D * 2
        sK, sV = sQ + tb, sQ + 2 * tb
        # the writes themselves: every tile byte written exactly once, nothing outside
        cover = np.zeros(smem.mem.size, dtype=np.int64)
        for tile in (sQ, sK, sV):
            for r in range(64):
                for c in range(D // 8):
                    o = tile + ke.swizzled_chunk_offset(r, c, 64)
                    cover[o:o + 16] += 1
        expect(cover[sQ:sQ + 3 * tb].min() == 1 and cover.sum() == 3 * tb and sQ + 3 * tb <= dyn_base + 3 * tb + 1024,
               "d=%d base=%d: Q/K/V tiles at %d/%d/%d (1024-aligned: %s), each byte written once, inside kSmemBytes"
               % (D, dyn_base, sQ, sK, sV, sQ % 1024 == 0 and sK % 1024 == 0 and sV % 1024 == 0))
        for tile in (sQ, sK, sV):
            load_tagged(smem, tile, D)
        okA = okB = okV = True
        for kk in range(D // 16):
            da, db = ke.k_major_descriptor(sQ, 64, kk), ke.k_major_descriptor(sK, 64, kk)
            aaddr, A = kmajor_addresses(da, 64)
            baddr, B = kmajor_addresses(db, 64)
            want = np.arange(64)[:, None] * 256 + 16 * kk + np.arange(16)[None, :]
            okA &= (read_tags(smem, aaddr) == want).all()
            okB &= (read_tags(smem, baddr) == want).all()
            if dyn_base == 0:
                print("    QK^T kk=%d  A desc=0x%016x start=sQ+%d LBO=%d SBO=%d layout=%d base_off=%d | "
                      "B desc=0x%016x start=sK+%d" % (kk, da, A["start"] - sQ, A["lbo"], A["sbo"], A["layout"],
                                                     A["base_offset"], db, B["start"] - sK))
        for kk in range(4):
            dv = ke.mn_major_descriptor(sV, 64, kk)
            vaddr, Vd = mnmajor_addresses(dv, D)
            want = (16 * kk + np.arange(16))[:, None] * 256 + np.arange(D)[None, :]
            okV &= (read_tags(smem, vaddr) == want).all()
            if dyn_base == 0:
                print("    PV   kk=%d  B desc=0x%016x start=sV+%d LBO=%d SBO=%d layout=%d base_off=%d"
                      % (kk, dv, Vd["start"] - sV, Vd["lbo"], Vd["sbo"], Vd["layout"], Vd["base_offset"]))
        expect(okA, "d=%d base=%d: QK^T A (Q): every (m,k) of every kk reads Q[m][16kk+k]" % (D, dyn_base))
        expect(okB, "d=%d base=%d: QK^T B (K, K-major, trans-b 0): every (k,n) reads K[n][16kk+k]" % (D, dyn_base))
        expect(okV, "d=%d base=%d: PV B (V, N-major, trans-b 1): every (k,n) of every kk reads V[16kk+k][n]" % (D, dyn_base))

# ----------------------------------------------------------------- 2+3. full kernel emulation
print("\n== 2/3. full kernel emulation: per-register S and PV checks inside the loop, then end-to-end")
rng = np.random.default_rng(0)
cases = [
    # B, hq, hkv, nq, nk, causal
    (1, 1, 1, 64, 64, False),
    (1, 2, 1, 100, 150, False),
    (1, 1, 1, 130, 70, True),
    (1, 1, 1, 70, 200, True),
    (1, 1, 1, 96, 33, True),     # seqlen_k < seqlen_q: fully masked rows
    (2, 2, 2, 65, 129, False),
]
for dtype in ("f16", "bf16"):
    fmt = Fmt(dtype)
    for D in (64, 128):
        for (B, hq, hkv, nq, nk, causal) in cases:
            for dyn_base in (0, 528):
                P = ke.make_problem(rng, B, hq, hkv, nq, nk, D, causal, fmt)
                checks = []
                hazards = ke.run_kernel(P, fmt, dyn_base=dyn_base, checks=checks)
                o_ref, lse_ref = ke.reference(P, fmt)
                o = fmt.dec(P["out"]).astype(np.float64)
                err = np.abs(o - o_ref).max()
                fin = np.isfinite(lse_ref)
                lse_err = np.abs(P["lse"][fin] - lse_ref[fin]).max() if fin.any() else 0.0
                lse_inf_ok = (P["lse"][~fin] == -np.inf).all()
                worst = max(checks, key=lambda c: c[1] / c[2]) if checks else ("-", 0, 1)
                reg_ok = all(c[1] <= c[2] for c in checks)
                tol = 4e-3 if dtype == "f16" else 3e-2
                expect(reg_ok and err < tol and lse_err < 1e-3 and lse_inf_ok and not hazards,
                       "%s d=%d B=%d hq=%d hkv=%d nq=%d nk=%d causal=%d base=%d: %d reg checks (worst %s err %.2e "
                       "tol %.1e), max|O-O_ref|=%.2e, max|lse err|=%.1e, hazards=%d"
                       % (dtype, D, B, hq, hkv, nq, nk, causal, dyn_base, len(checks), worst[0], worst[1],
                          worst[2], err, lse_err, len(hazards)))
                if hazards:
                    print("       ", hazards[:3])

# ----------------------------------------------------------------- 4. negative controls
print("\n== 4. negative controls: broken variants must be caught by the emulator")
fmt = Fmt("f16")


def neg(name, D, ov, causal=False, dyn_base=0):
    P = ke.make_problem(np.random.default_rng(1), 1, 1, 1, 64, 128, D, causal, fmt)
    checks = []
    hazards = ke.run_kernel(P, fmt, dyn_base=dyn_base, checks=checks, ov=ov)
    o_ref, _ = ke.reference(P, fmt)
    err = np.abs(fmt.dec(P["out"]).astype(np.float64) - o_ref).max()
    bad = [c for c in checks if not c[1] <= c[2]]
    caught = bool(bad) or err > 4e-3 or bool(hazards)
    expect(caught, "caught: %-55s (failed reg checks %d/%d, max|O err| %.2e, hazards %d%s)"
           % (name, len(bad), len(checks), err, len(hazards), (": " + hazards[0][0]) if hazards else ""))


neg("d=128 no 1024 alignment (align 16, base 16)", 128, ke.Overrides(align=16), dyn_base=16)
neg("d=128 V LBO = 16 (unused-style) instead of 64*128", 128,
    ke.Overrides(mn_desc=lambda tile, kr, kk: ke.smem_descriptor(tile + kk * 2048, 16, 1024)))
neg("d=64 V trans-b = 0", 64, ke.Overrides(trans_b_pv=0))
neg("d=64 V k-step 1024 B instead of 2048", 64,
    ke.Overrides(mn_desc=lambda tile, kr, kk: ke.smem_descriptor(tile + kk * 1024, kr * 128, 1024)))
neg("d=128 Q/K slab jump missing (kk/4 term dropped)", 128,
    ke.Overrides(k_desc=lambda tile, rows, kk: ke.smem_descriptor(tile + (kk % 4) * 32, 16, 1024)))
neg("d=64 K-major SBO 512", 64,
    ke.Overrides(k_desc=lambda tile, rows, kk: ke.smem_descriptor(tile + (kk % 4) * 32, 16, 512)))
neg("d=64 P packed hi/lo swapped", 64, ke.Overrides(swap_pack=True))
neg("d=64 no fence.proxy.async", 64, ke.Overrides(proxy_fence=False))

print("\nFAILURES: %d" % len(failures))
for f in failures:
    print("  ", f)
sys.exit(1 if failures else 0)
