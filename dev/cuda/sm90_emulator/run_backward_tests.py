"""Drives backward_emu.py: (0) the stmatrix .trans model vs the PTX ISA text, (1) byte-tag identity of every operand
element of every wgmma the backward kernel issues (dS included: tags go through the kernel's stmatrix), (2) full
emulation with per-register checks, hazards, and end-to-end dQ/dK/dV vs float64, (3) negative controls."""
import sys

import numpy as np

import backward_emu as be
import ptx_model as pm
from ptx_model import Fmt, kmajor_addresses, mnmajor_addresses, alayout_64x16

np.set_printoptions(linewidth=160)
failures = []
QUICK = "--quick" in sys.argv


def expect(cond, msg):
    print(("  ok   " if cond else "  FAIL ") + msg)
    if not cond:
        failures.append(msg)


# ----------------------------------------------------------------- 0. stmatrix model
print("== 0. stmatrix.m8n8.x4.trans (CUTLASS SM90_U16x8_STSM_T layouts) vs the PTX ISA wording")
ok = True
for l in range(32):
    for j in range(4):
        for h in range(2):
            # PTX: thread l holds element (row l/4, col 2(l%4)+h) of matrix j (ldmatrix/mma fragment);
            # .trans stores element (r, c) at row c (the address of lane 8j + c), position r.
            ok &= tuple(be.STSM_T[l, j, h]) == (8 * j + 2 * (l % 4) + h, l // 4)
expect(ok, "lane l, reg j, half h -> 16-B row of address lane 8j + 2(l%4) + h, element l/4")

# ----------------------------------------------------------------- 1. byte tags
print("\n== 1. operand identity of every wgmma (tags: tensor<<14 | row<<7 | col; dS: 0xF000 | key<<6 | query)")


class TagWgmma(pm.Wgmma):
    calls = []

    def _bits(self, addrs):
        a = np.asarray(addrs)
        return self.smem.mem[a].astype(np.int64) | (self.smem.mem[a + 1].astype(np.int64) << 8)

    def ss(self, d, da, db, N, scale_d, scale_a, scale_b, trans_a, trans_b):
        A = self._bits(kmajor_addresses(da, 64)[0]) if trans_a == 0 else self._bits(mnmajor_addresses(da, 64)[0]).T
        B = self._bits(kmajor_addresses(db, N)[0]).T if trans_b == 0 else self._bits(mnmajor_addresses(db, N)[0])
        TagWgmma.calls.append(("ss", A, B))
        with np.errstate(all="ignore"):
            return super().ss(d, da, db, N, scale_d, scale_a, scale_b, trans_a, trans_b)

    def rs(self, d, a, db, N, scale_d, scale_a, scale_b, trans_b):
        B = self._bits(kmajor_addresses(db, N)[0]).T if trans_b == 0 else self._bits(mnmajor_addresses(db, N)[0])
        TagWgmma.calls.append(("rs", a.copy(), B))
        with np.errstate(all="ignore"):
            return super().rs(d, a, db, N, scale_d, scale_a, scale_b, trans_b)


ma, ka = alayout_64x16()     # hardware A fragment: (thread, element) -> (m, k)


def ds_tag_regs(kq):
    """A registers whose element (m = key, k) the hardware reads as dS^T[key][16 kq + k] carry tag(key, query)."""
    tags = 0xF000 | (ma << 6) | (16 * kq + ka)
    a = np.zeros((128, 4), np.uint32)
    for j in range(4):
        a[:, j] = tags[:, 2 * j].astype(np.uint32) | (tags[:, 2 * j + 1].astype(np.uint32) << 16)
    return a


def tag_problem(B, hq, hkv, nq, nk, d, causal, head_splits=1):
    fmt = Fmt("f16")
    G = be.make_problem(np.random.default_rng(5), B, hq, hkv, nq, nk, d, causal, fmt, head_splits)
    def tagged(tid, Bn, H, N):
        x = np.zeros((Bn, H, N, d), np.uint16)
        x[...] = (tid << 14) | ((np.arange(N) % 128)[:, None] << 7) | np.arange(d)[None, :]
        return x
    G["q"] = be.to_flat(tagged(0, B, hq, nq), G["q_strides"])
    G["k"] = be.to_flat(tagged(1, B, hkv, nk), G["k_strides"])
    G["v"] = be.to_flat(tagged(2, B, hkv, nk), G["v_strides"])
    G["do"] = be.to_flat(tagged(3, B, hq, nq), G["do_strides"])
    return G, fmt


def expected_tile(tid, row0, nrows_valid, d):
    """[64][d] tags of rows row0.. (0 past the valid rows: zero fill)."""
    x = np.zeros((64, d), np.int64)
    r = np.arange(64)
    x[:] = (tid << 14) | (((row0 + r) % 128)[:, None] << 7) | np.arange(d)[None, :]
    x[nrows_valid:] = 0
    return x


def run_tag_case(B, hq, hkv, nq, nk, d, causal, head_splits, dyn_base):
    G, fmt = tag_problem(B, hq, hkv, nq, nk, d, causal, head_splits)
    be.preprocess(G, fmt)
    if head_splits > 1:
        G["grad_kv_accum"] = np.zeros(2 * B * hkv * nk * d, np.float32)
    orig_w, orig_pa = be.Wgmma, be.probabilities_as_a
    be.Wgmma = TagWgmma
    n_blocks = (nk + 63) // 64
    good = {"S^T A=K": True, "S^T B=Q": True, "dP^T A=V": True, "dP^T B=dO": True, "dV B=dO (MN)": True,
            "dK B=Q (MN)": True, "dQ A=dS (stmatrix'd)": True, "dQ B=K (MN)": True, "dK A regs = dS tags": True}
    ncalls = 0
    try:
        for bx in range(n_blocks * head_splits * hkv * B):
            walk = be.KeyBlockWalk(bx, G)
            TagWgmma.calls = []
            # dS^T registers replaced by tags (the dK product reads them as dS^T; the kernel stores the same registers)
            cnt = {"n": 0}
            def pa(p, kk, fmt_, _c=cnt):
                _c["n"] += 1
                return ds_tag_regs(kk) if (_c["n"] - 1) % 8 >= 4 else orig_pa(p, kk, fmt_)
            be.probabilities_as_a = pa
            with np.errstate(all="ignore"):
                sm = be.run_block(bx, G, fmt, dyn_base)
            calls = TagWgmma.calls
            per_step = 2 * (d // 16) + 8 + 4 * (d // 64)
            assert len(calls) == per_step * walk.steps, (len(calls), walk.steps)
            ncalls += len(calls)
            for s in range(walk.steps):
                head, m0 = walk.head(s), walk.m0(s)
                c = calls[s * per_step:(s + 1) * per_step]
                Kt = expected_tile(1, walk.key0, walk.keys, d)
                Vt = expected_tile(2, walk.key0, walk.keys, d)
                Qt = expected_tile(0, m0, nq - m0, d)
                dOt = expected_tile(3, m0, nq - m0, d)
                i = 0
                for kk in range(d // 16):
                    _, A, Bm = c[i]; i += 1
                    good["S^T A=K"] &= (A == Kt[:, 16 * kk:16 * kk + 16]).all()
                    good["S^T B=Q"] &= (Bm == Qt[:, 16 * kk:16 * kk + 16].T).all()
                for kk in range(d // 16):
                    _, A, Bm = c[i]; i += 1
                    good["dP^T A=V"] &= (A == Vt[:, 16 * kk:16 * kk + 16]).all()
                    good["dP^T B=dO"] &= (Bm == dOt[:, 16 * kk:16 * kk + 16].T).all()
                for kq in range(4):
                    _, a, Bm = c[i]; i += 1
                    good["dV B=dO (MN)"] &= (Bm == dOt[16 * kq:16 * kq + 16, :]).all()
                for kq in range(4):
                    _, a, Bm = c[i]; i += 1
                    good["dK B=Q (MN)"] &= (Bm == Qt[16 * kq:16 * kq + 16, :]).all()
                    good["dK A regs = dS tags"] &= (a == ds_tag_regs(kq)).all()
                for half in range(d // 64):
                    for kk in range(4):
                        _, A, Bm = c[i]; i += 1
                        q_ = np.arange(64)[:, None]; k_ = (16 * kk + np.arange(16))[None, :]
                        good["dQ A=dS (stmatrix'd)"] &= (A == (0xF000 | (k_ << 6) | q_)).all()
                        good["dQ B=K (MN)"] &= (Bm == Kt[16 * kk:16 * kk + 16, 64 * half:64 * half + 64]).all()
    finally:
        be.Wgmma, be.probabilities_as_a = orig_w, orig_pa
    return good, ncalls


tag_cases = [(1, 1, 1, 90, 120, 64, False, 1), (1, 1, 1, 90, 120, 128, True, 1), (1, 2, 1, 70, 64, 128, False, 2),
             (1, 1, 1, 7, 100, 64, True, 1)]
for (B, hq, hkv, nq, nk, d, causal, hs) in tag_cases:
    for dyn_base in ((0, 528) if not QUICK else (0,)):
        good, n = run_tag_case(B, hq, hkv, nq, nk, d, causal, hs, dyn_base)
        expect(all(good.values()), "d=%d nq=%d nk=%d causal=%d hs=%d base=%d: %d wgmmas, every operand element: %s"
               % (d, nq, nk, causal, hs, dyn_base, n, ", ".join(k + (" ok" if v else " WRONG") for k, v in good.items())))

# ----------------------------------------------------------------- 2. full emulation
print("\n== 2. full kernel emulation: per-register checks, hazards, end-to-end vs float64")
# rel err = max|x - ref| / max|ref|. "mimic": the same math in float64 with P and dS rounded to T as the kernel
# rounds them (and its lse/O inputs); "exact": the true float64 gradient of softmax(Q K^T scale) V.
TOL = {"f16": (3e-3, 1e-2), "bf16": (2e-2, 6e-2)}
cases = [
    # B, hq, hkv, nq, nk, causal, head_splits
    (1, 1, 1, 64, 64, False, 1),
    (1, 1, 1, 97, 113, False, 1),
    (1, 1, 1, 97, 113, True, 1),
    (1, 1, 1, 7, 300, False, 1),
    (1, 1, 1, 7, 300, True, 1),
    (1, 1, 1, 300, 7, False, 1),
    (1, 1, 1, 300, 7, True, 1),     # Nq > Nk causal: rows that see no key (lse = -inf)
    (2, 4, 2, 70, 130, True, 2),    # GQA, head splits
    (1, 4, 1, 65, 64, False, 4),
    (1, 4, 1, 130, 65, True, 1),    # GQA, one block walks 4 heads x 3 steps
]
if QUICK:
    cases = cases[:3]
worst = {}
for dtype in ("f16", "bf16"):
    fmt = Fmt(dtype)
    for D in (64, 128):
        for ci, (B, hq, hkv, nq, nk, causal, hs) in enumerate(cases):
            dyn_base = (0, 528)[ci % 2]
            G = be.make_problem(np.random.default_rng(100 + ci), B, hq, hkv, nq, nk, D, causal, fmt, hs)
            checks = []
            hazards = be.run_backward(G, fmt, dyn_base=dyn_base, checks=checks)
            dq, dk, dv = be.results(G, fmt)
            ex = be.backward_reference(G["Q"], G["K"], G["V"], G["dO"], G["scale"], causal, hkv)
            mi = be.backward_reference(G["Q"], G["K"], G["V"], G["dO"], G["scale"], causal, hkv, round_fn=fmt.round,
                                       O_used=G["O_used"], lse_used=G["lse"].reshape(B, hq, nq))
            rel = lambda a, r: np.abs(a - r).max() / max(np.abs(r).max(), 1e-30)
            e_mi = [rel(x, r) for x, r in zip((dq, dk, dv), mi)]
            e_ex = [rel(x, r) for x, r in zip((dq, dk, dv), ex)]
            fin = all(np.isfinite(x).all() for x in (dq, dk, dv))
            badc = [c for c in checks if not c[1] <= c[2]]
            tm, te = TOL[dtype]
            for k_, v_ in zip(("mimic", "exact"), (max(e_mi), max(e_ex))):
                worst[(dtype, k_)] = max(worst.get((dtype, k_), 0), v_)
            expect(fin and not badc and not hazards and max(e_mi) < tm and max(e_ex) < te,
                   "%s d=%d B=%d hq=%d hkv=%d hs=%d nq=%d nk=%d causal=%d base=%d: %d reg checks%s, hazards %d, "
                   "rel err dQ/dK/dV vs mimic %.1e/%.1e/%.1e, vs exact %.1e/%.1e/%.1e"
                   % (dtype, D, B, hq, hkv, hs, nq, nk, causal, dyn_base, len(checks),
                      (" (%d BAD: %s)" % (len(badc), badc[0])) if badc else "", len(hazards), *e_mi, *e_ex))
            if hazards:
                print("       ", hazards[:3])
print("  worst rel errors:", {k: "%.1e" % v for k, v in worst.items()})

# ----------------------------------------------------------------- 3. negative controls
print("\n== 3. negative controls: deliberately broken variants must be caught")
fmt = Fmt("f16")


def neg(name, ov, D=64, nq=97, nk=113, causal=True, hq=1, hkv=1, hs=1):
    G = be.make_problem(np.random.default_rng(7), 1, hq, hkv, nq, nk, D, causal, fmt, hs)
    checks = []
    with np.errstate(all="ignore"):
        hazards = be.run_backward(G, fmt, ov=ov, checks=checks)
    dq, dk, dv = be.results(G, fmt)
    ex = be.backward_reference(G["Q"], G["K"], G["V"], G["dO"], G["scale"], causal, hkv)
    errs = [np.abs(x - r).max() / np.abs(r).max() for x, r in zip((dq, dk, dv), ex)]
    errs = [e if np.isfinite(e) else np.inf for e in errs]
    badc = [c for c in checks if not c[1] <= c[2]]
    caught = bool(badc) or max(errs) > TOL["f16"][1] or bool(hazards)
    kinds = sorted(set(h[0].split(":")[0] + ":" + h[0].split(":")[1][:40] for h in hazards))
    expect(caught, "caught: %-58s (bad reg checks %d/%d, rel err dQ/dK/dV %.1e/%.1e/%.1e, hazards %d%s)"
           % (name, len(badc), len(checks), *errs, len(hazards), (" " + str(kinds)) if hazards else ""))


# a non-transposing stmatrix (CUTLASS SM90_U32x4_STSM_N: lane l reg j -> row 8j + l/4, element 2(l%4)+h)
stsm_n = np.zeros_like(be.STSM_T)
for l in range(32):
    for j in range(4):
        for h in range(2):
            stsm_n[l, j, h] = (8 * j + l // 4, 2 * (l % 4) + h)
neg("stmatrix without .trans", be.Overrides(stsm_map=stsm_n))
neg("stmatrix row address: query/key chunk roles of i swapped", be.Overrides(stsm_chunk_swap=True))
neg("dQ: B (K) read K-major (TransB = 0)", be.Overrides(dq_trans_b=0))
neg("dQ d=128: second 64 columns of K at +64*64 B", be.Overrides(dq_slab=64 * 64), D=128)
neg("dV/dK: B read K-major (trans-b 0)", be.Overrides(dv_trans_b=0))
neg("no fence.proxy.async after stmatrix of dS", be.Overrides(ds_fence=False))
neg("no __syncthreads between dS stores and dQ's wgmma", be.Overrides(ds_barrier=False))
neg("no fence.proxy.async after the cp.async wait", be.Overrides(top_fence=False))
neg("no __syncthreads at the top of the step (dS WAR, Q/dO RAW)", be.Overrides(top_barrier=False))
neg("next loads before the top barrier AND no barrier before dQ", be.Overrides(load_before_barrier=True, ds_barrier=False), nq=200)
neg("lse = -inf rows not mapped to +inf (Nq > Nk causal)", be.Overrides(lse_inf=False), nq=300, nk=7)
neg("Q/dO/lse/delta single-buffered (buf = 0 every step)", be.Overrides(single_buffer=True))

print("\nFAILURES: %d" % len(failures))
for f in failures:
    print("  ", f)
sys.exit(1 if failures else 0)
