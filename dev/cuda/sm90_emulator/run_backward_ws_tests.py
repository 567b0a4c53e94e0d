"""Drives backward_ws_emu.py (rung 2 of the sm90 backward: TMA producer, two consumer warpgroups):
(0) static plan checks, (1) byte-tag identity of every operand element of every wgmma, (2) end-to-end vs float64
with hazards/oracles/deadlock checked under a random interleaving per case, (3) the lse/delta rows past a head's
Nq (next head's values) are harmless only thanks to the query mask, (4) randomized-interleaving protocol stress,
(5) negative controls. Usage: python3 run_backward_ws_tests.py [--quick]"""
import sys
import time

import numpy as np

import backward_emu as be
import backward_ws_emu as ws
import ptx_model
from ptx_model import Fmt

failures = []
QUICK = "--quick" in sys.argv
T0 = time.time()


def expect(cond, msg):
    print(("  ok   " if cond else "  FAIL ") + msg, flush=True)
    if not cond:
        failures.append(msg)


# ----------------------------------------------------------------- 0. static plan
print("== 0. shared-memory plan, TMA alignment, registers, dQ quarters")
for D in (64, 128):
    Tr = ws.Traits(D)
    M = 128 if D == 64 else 64                          # queries per step: 128 at d=64, 64 at d=128
    kKV, kQ, kDs = 128 * D * 2, M * D * 2, M * 128 * 2
    expect((Tr.kBlockM, Tr.kKVTileBytes, Tr.kQTileBytes, Tr.kDsBytes, Tr.kRowsBox, Tr.kRowsSlot)
           == (M, kKV, kQ, kDs, M + 4, 2 * M), "d=%d: kBlockM %d, tiles %d/%d/%d bytes, lse box %d in slot %d floats"
           % (D, M, kKV, kQ, kDs, M + 4, 2 * M))
    fo = 2 * kKV + 4 * kQ + 2 * kDs
    smem = fo + 2 * 2 * Tr.kRowsSlot * 4 + 5 * 8 + 1024
    slabs = [0, 2 * kKV + 4 * kQ, 2 * kKV + 4 * kQ + kDs]                  # K, the dS buffers
    slabs += [s_ * 128 * 128 for s_ in range(D // 64)] + [kKV + s_ * 128 * 128 for s_ in range(D // 64)]
    slabs += [2 * kKV + st_ * kQ + s_ * M * 128 for st_ in range(4) for s_ in range(D // 64)]   # Q, dO stages
    slabs += [2 * kKV + 4 * kQ + b_ * kDs + k_ * M * 128 + c_ * Tr.kDqQueryOffset * 128
              for b_ in range(2) for k_ in range(2) for c_ in range(2)]    # dQ's A operands (query0 rows in)
    rows_at = [fo + i * Tr.kRowsSlot * 4 for i in range(4)]
    expect(all(o % 1024 == 0 for o in slabs) and all(o % 128 == 0 for o in rows_at) and smem == Tr.kSmemBytes
           and smem <= 227 * 1024,
           "d=%d: every swizzled slab and dQ A start 1024-aligned, lse/delta stages 128-aligned, %d bytes <= 227 KiB"
           % (D, smem))
    expect(Tr.kRowsBox * 4 % 16 == 0 and Tr.kRowsBox <= 256 and M <= 256 and 3 + M <= Tr.kRowsBox <= Tr.kRowsSlot,
           "d=%d: 1-D box %d floats (16-byte multiple, <= 256), holds a step's rows from any skew 0..3, fits its slot"
           % (D, Tr.kRowsBox))
    exp = 2 * Tr.kQTileBytes + 2 * Tr.kRowsBox * 4
    expect(exp == sum([M * 128] * (2 * D // 64) + [4 * (M + 4)] * 2),
           "d=%d: expect_tx %d = the step's boxes (Q, dO: %d x %dx64x2; lse, delta: %d x 4)" % (D, exp, D // 64, M, M + 4))
    cover = np.zeros((M, D), int)
    for c_ in range(2):
        q0, c0 = Tr.kDqQueryOffset * c_, Tr.kDqColumnOffset * c_
        cover[q0:q0 + 64, c0:c0 + 64] += 1
    expect((cover == 1).all(), "d=%d: the two consumers' 64 x 64 dQ quarters (query %d c, column %d c) tile [%d x %d] once"
           % (D, Tr.kDqQueryOffset, Tr.kDqColumnOffset, M, D))
expect(128 * 24 + 256 * 240 <= 65536 and 384 * 168 <= 65536,
       "setmaxnreg 128x24 + 256x240 = %d <= 65536 (entry 168 x 384 = %d, ptxas reports 168)" % (128 * 24 + 256 * 240, 384 * 168))

# ----------------------------------------------------------------- 1. byte tags
print("\n== 1. operand identity of every wgmma (tags: tensor<<14 | row%128<<7 | col; dS: ws.ds_tag(key, query))")


def tag_problem(B, hq, hkv, nq, nk, d, causal, hs):
    fmt = Fmt("f16")
    G = be.make_problem(np.random.default_rng(5), B, hq, hkv, nq, nk, d, causal, fmt, hs)

    def tagged(tid, H, N):
        x = np.zeros((B, H, N, d), np.uint16)
        x[...] = (tid << 14) | ((np.arange(N) % 128)[:, None] << 7) | np.arange(d)[None, :]
        return x
    G["q"] = be.to_flat(tagged(0, hq, nq), G["q_strides"])
    G["k"] = be.to_flat(tagged(1, hkv, nk), G["k_strides"])
    G["v"] = be.to_flat(tagged(2, hkv, nk), G["v_strides"])
    G["do"] = be.to_flat(tagged(3, hq, nq), G["do_strides"])
    return G, fmt


def tile(tid, row0, nrows, valid, d):
    r = np.arange(nrows)
    x = (tid << 14) | (((row0 + r) % 128)[:, None] << 7) | np.arange(d)[None, :]
    x[row0 + r >= valid] = 0
    return x.astype(np.int64)


def tag_case(B, hq, hkv, nq, nk, d, causal, hs, dyn_base, seed):
    G, fmt = tag_problem(B, hq, hkv, nq, nk, d, causal, hs)
    log = []
    hz = ws.run_backward(G, fmt, seed=seed, dyn_base=dyn_base, kn=ws.Knobs(tags=True), tag_log=log)
    good = {k: True for k in ("S A=K", "S B=Q", "dP A=V", "dP B=dO", "dV B=dO", "dK B=Q", "dK A=dS regs",
                              "dQ A=dS tile", "dQ B=K")}
    by = {}
    for (bx, c, s, prod, idx, kind, A, Bm) in log:
        by.setdefault((bx, c, s), []).append((prod, idx, A, Bm))
    Tr = ws.Traits(d)
    M = Tr.kBlockM
    order = ws.make_key_block_order(G, 128)
    nblocks = (nk + 127) // 128 * hs * hkv * B
    count_ok = order[0] * order[1] == nblocks
    for bx in range(nblocks):
        walk = ws.block_walk(bx, G, Tr, order)
        for c in range(2):
            for s in range(walk.steps):
                calls = by.get((bx, c, s), [])
                want = {"S": d // 16, "dP": d // 16, "dV": M // 16, "dK": M // 16, "dQ": 8}
                got = {}
                for prod, idx, A, Bm in calls:
                    got[prod] = got.get(prod, 0) + 1
                count_ok &= got == want
                m0 = walk.m0(s)
                k0 = walk.key0 + 64 * c
                Kt, Vt = tile(1, k0, 64, nk, d), tile(2, k0, 64, nk, d)
                Qt, dOt = tile(0, m0, M, nq, d), tile(3, m0, M, nq, d)
                Kall = tile(1, walk.key0, 128, nk, d)
                q0 = 64 * c if d == 64 else 0          # this consumer's dQ quarter: queries at d=64,
                col0 = 64 * c if d == 128 else 0       # columns of d at d=128
                for prod, idx, A, Bm in calls:
                    sl = slice(16 * idx, 16 * idx + 16)
                    if prod == "S":
                        good["S A=K"] &= (A == Kt[:, sl]).all(); good["S B=Q"] &= (Bm == Qt[:, sl].T).all()
                    elif prod == "dP":
                        good["dP A=V"] &= (A == Vt[:, sl]).all(); good["dP B=dO"] &= (Bm == dOt[:, sl].T).all()
                    elif prod == "dV":
                        good["dV B=dO"] &= (Bm == dOt[sl, :]).all()
                    elif prod == "dK":
                        good["dK B=Q"] &= (Bm == Qt[sl, :]).all()
                        good["dK A=dS regs"] &= (A == ws.ds_tag_regs(idx, 64 * c)).all()
                    else:
                        keys = 16 * idx + np.arange(16)
                        queries = q0 + np.arange(64)
                        good["dQ A=dS tile"] &= (A == ws.ds_tag(keys[None, :], queries[:, None])).all()
                        good["dQ B=K"] &= (Bm == Kall[keys][:, col0:col0 + 64]).all()
    return good, len(log), count_ok, hz


tag_cases = [(1, 1, 1, 90, 120, 64, False, 1), (1, 1, 1, 90, 250, 128, True, 1), (1, 2, 1, 70, 64, 128, False, 2),
             (1, 1, 1, 7, 300, 64, True, 1), (1, 2, 2, 130, 200, 128, False, 1), (1, 4, 1, 100, 130, 64, True, 2),
             (1, 2, 1, 40, 130, 64, False, 1), (1, 1, 1, 257, 200, 64, True, 1), (2, 4, 2, 129, 140, 64, False, 2)]
for i, (B, hq, hkv, nq, nk, d, causal, hs) in enumerate(tag_cases if not QUICK else tag_cases[:2]):
    for dyn_base in ((0, 528) if not QUICK else (0,)):
        good, n, cnt, hz = tag_case(B, hq, hkv, nq, nk, d, causal, hs, dyn_base, seed=11 + i)
        expect(all(good.values()) and cnt and not hz,
               "d=%d B=%d hq=%d hkv=%d nq=%d nk=%d causal=%d hs=%d base=%d: %d wgmmas (count per step %s), hazards %d: %s"
               % (d, B, hq, hkv, nq, nk, causal, hs, dyn_base, n, "ok" if cnt else "WRONG", len(hz),
                  ", ".join(k + ("" if v else " WRONG") for k, v in good.items())))

# ----------------------------------------------------------------- 2. end to end
print("\n== 2. end to end vs float64 (one random skewed interleaving per case; hazards, oracles, deadlock)")
TOL = {"f16": (3e-3, 1e-2), "bf16": (2e-2, 6e-2)}
cases = [
    # B, hq, hkv, nq, nk, causal, head_splits[, pairs per L2 group of the causal grid order]
    (1, 1, 1, 64, 64, False, 1),
    (1, 1, 1, 97, 113, False, 1),    # 64 < Nq < 128: one step at d=64 whose second quarter is part-empty
    (1, 1, 1, 97, 113, True, 1),
    (1, 1, 1, 7, 300, False, 1),     # Nq < 64: consumer 1's dQ quarter at d=64 is all past Nq
    (1, 1, 1, 7, 300, True, 1),
    (1, 1, 1, 300, 7, False, 1),
    (1, 1, 1, 300, 7, True, 1),      # rows that see no key (lse = -inf)
    (1, 1, 1, 130, 65, False, 1),
    (1, 1, 1, 130, 65, True, 1),
    (1, 1, 1, 1, 1, False, 1),
    (1, 1, 1, 1, 1, True, 1),
    (1, 2, 1, 256, 256, True, 1),    # causal: consumer 1 of each block sees no key in the block's first step
    (2, 4, 2, 70, 130, True, 2, 3),  # GQA, head splits 2, B = 2; 8 pairs in groups of 3 (the last of 2)
    (1, 4, 1, 65, 64, False, 4),     # head splits 4
    (1, 4, 1, 130, 65, True, 1),     # one block walks 4 heads x 3 (d=64: 2) steps
    (1, 4, 2, 100, 200, False, 1),
    (1, 1, 1, 50, 200, True, 1),     # Nq < 64, causal with Nk > Nq
    (1, 1, 1, 129, 129, False, 1),   # Nq one past a multiple of 128: a 1-query step at d=64
    (1, 1, 1, 257, 300, True, 1),
    (1, 2, 1, 385, 190, True, 1),    # 3 x 128 + 1, causal, GQA
    (2, 4, 2, 129, 250, False, 2),   # GQA, head splits, B = 2, 129 queries
    (1, 6, 2, 131, 140, True, 1, 2),  # GQA 3, rows of a head start off 16 bytes (131 h), grouped causal order
]
if QUICK:
    cases = cases[:3]
worst = {}


def run_case(G, fmt, seed, dyn_base=0, kn=None):
    orc = []
    try:
        hz = ws.run_backward(G, fmt, seed=seed, dyn_base=dyn_base, kn=kn, oracle=orc)
        dead = None
    except ws.Deadlock as e:
        hz, dead = [], str(e)
    return hz, orc, dead


for dtype in ("f16", "bf16"):
    fmt = Fmt(dtype)
    for D in (64, 128):
        for ci, case in enumerate(cases):
            B, hq, hkv, nq, nk, causal, hs = case[:7]
            dyn_base = (0, 528)[ci % 2]
            G = be.make_problem(np.random.default_rng(100 + ci), B, hq, hkv, nq, nk, D, causal, fmt, hs)
            if len(case) > 7:                    # the L2 that groups case[7] pairs in the causal grid order
                G["l2_bytes"] = 2 * case[7] * (hq // hkv // hs) * nq * (2 * D * 2 + 8)
                assert ws.make_key_block_order(G, 128)[2] == case[7]
            hz, orc, dead = run_case(G, fmt, seed=1000 + ci + 17 * D, dyn_base=dyn_base)
            if dead:
                expect(False, "%s d=%d case %d: DEADLOCK %s" % (dtype, D, ci, dead[:200]))
                continue
            dq, dk, dv = be.results(G, fmt)
            ex = be.backward_reference(G["Q"], G["K"], G["V"], G["dO"], G["scale"], causal, hkv)
            mi = be.backward_reference(G["Q"], G["K"], G["V"], G["dO"], G["scale"], causal, hkv, round_fn=fmt.round,
                                       O_used=G["O_used"], lse_used=G["lse"].reshape(B, hq, nq))
            rel = lambda a, r: np.abs(a - r).max() / max(np.abs(r).max(), 1e-30) if np.abs(r).max() > 0 else np.abs(a).max()
            e_mi = [rel(x, r) for x, r in zip((dq, dk, dv), mi)]
            e_ex = [rel(x, r) for x, r in zip((dq, dk, dv), ex)]
            fin = all(np.isfinite(x).all() for x in (dq, dk, dv))
            tm, te = TOL[dtype]
            for k_, v_ in zip(("mimic", "exact"), (max(e_mi), max(e_ex))):
                worst[(dtype, k_)] = max(worst.get((dtype, k_), 0), v_)
            expect(fin and not hz and not orc and max(e_mi) < tm and max(e_ex) < te,
                   "%s d=%d B=%d hq=%d hkv=%d hs=%d nq=%d nk=%d causal=%d base=%d: hazards %d, oracle %d, rel err "
                   "dQ/dK/dV vs mimic %.1e/%.1e/%.1e, vs exact %.1e/%.1e/%.1e"
                   % (dtype, D, B, hq, hkv, hs, nq, nk, causal, dyn_base, len(hz), len(orc), *e_mi, *e_ex))
            if hz or orc:
                print("       ", (hz + orc)[:3])
print("  worst rel errors:", {k: "%.1e" % v for k, v in worst.items()}, "(%.0fs)" % (time.time() - T0))

# ----------------------------------------------------------------- 3. lse/delta rows past Nq
print("\n== 3. 1-D lse/delta boxes past a head's Nq read the next head's rows (or zeros past the array)")
fmt = Fmt("f16")


def poisoned(mask_query, D=64):
    """hq = hkv = 2, Nq = 70: head 0's last step (d=64: its only one, queries 0..127; d=128: queries 64..127) reads
    head 1's lse rows 0..61 (flat rows 70..131). Head 1's lse set to -300 (2^(0 + 300 log2 e) = inf in float32):
    head 0's gradients must stay exact."""
    G = be.make_problem(np.random.default_rng(3), 1, 2, 2, 70, 100, D, False, fmt, 1)
    ex = be.backward_reference(G["Q"], G["K"], G["V"], G["dO"], G["scale"], False, 2)
    G["lse"] = G["lse"].copy()
    G["lse"][70:] = -300.0
    hz, orc, dead = run_case(G, fmt, seed=5, kn=ws.Knobs(mask_query=mask_query))
    dq, dk, dv = be.results(G, fmt)
    e = [np.abs(x[:, 0] - r[:, 0]).max() / np.abs(r[:, 0]).max() for x, r in zip((dq, dk, dv), ex)]
    return [x if np.isfinite(x) else np.inf for x in e], hz, dead


for D in (64, 128):
    e, hz, dead = poisoned(True, D)
    expect(max(e) < 1e-2 and not hz and not dead,
           "d=%d kernel (query mask): head 0 exact though its box's rows past 70 hold head 1's lse = -300: %s"
           % (D, ["%.1e" % x for x in e]))
    e, hz, dead = poisoned(False, D)
    expect(max(e) > 1e-2, "d=%d control, query mask removed: head 0's gradients break (%s): the mask is load-bearing"
           % (D, ["%.1e" % x for x in e]))

# A NaN (or inf) in the next head's delta (its grad_out or out) still reaches this head's dS: P = 0 there, but
# 0 * (dP - NaN) = NaN, and dK += dS^T Q carries it (0 * NaN) into dK of a different kv head. Reported, not failed.
orig_pre = be.preprocess


def nan_next_head(G, fmt_):
    orig_pre(G, fmt_)
    G["delta"][70 + 5] = np.nan


be.preprocess = nan_next_head
try:
    G = be.make_problem(np.random.default_rng(3), 1, 2, 2, 70, 100, 64, False, fmt, 1)
    run_case(G, fmt, seed=1)
finally:
    be.preprocess = orig_pre
dq, dk, dv = be.results(G, fmt)
print("  INFO head 1 delta[5] = NaN (hq = hkv = 2, Nq = 70): head 0's dK finite %s, dV finite %s, dQ finite %s"
      % (np.isfinite(dk[:, 0]).all(), np.isfinite(dv[:, 0]).all(), np.isfinite(dq[:, 0]).all()))

# ----------------------------------------------------------------- 4. protocol stress
print("\n== 4. randomized interleavings (skewed speeds per warp and TMA copy): deadlock, races, stage/dS oracles")
n_seeds = 12 if QUICK else 60
bad = []
stats = {}
t1 = time.time()
stress = [(1, 4, 1, 300, 130, False, 1, 64), (1, 2, 1, 256, 256, True, 1, 128), (1, 2, 1, 97, 200, True, 2, 128),
          (1, 3, 1, 385, 260, True, 1, 64)]
max_steps = 0
for i in range(n_seeds):
    B, hq, hkv, nq, nk, causal, hs, D = stress[i % len(stress)]
    G = be.make_problem(np.random.default_rng(i), B, hq, hkv, nq, nk, D, causal, fmt, hs)
    Tr = ws.Traits(D)
    order = ws.make_key_block_order(G, Tr.kBlockN)
    max_steps = max([max_steps] + [ws.block_walk(bx, G, Tr, order).steps for bx in range(order[0] * order[1])])
    hz, orc, dead = run_case(G, fmt, seed=50000 + i, kn=ws.Knobs(stats=stats))
    if hz or orc or dead:
        bad.append((i, hz[:2], orc[:2], dead))
expect(not bad, "%d interleavings (%d shapes, up to %d steps per block): no deadlock, no race, no early overwrite%s (%.0fs)"
       % (n_seeds, len(stress), max_steps, "" if not bad else ": " + str(bad[:2]), time.time() - t1))
expect(all(v > 0 for v in stats.values()) and len(stats) == 2,
       "the interleavings reach the overlaps the protocol must order: %s" % stats)

# ----------------------------------------------------------------- 5. negative controls
print("\n== 5. negative controls: deliberately broken variants must be caught")


def neg(name, kn, D=128, nq=200, nk=250, causal=True, hq=1, hkv=1, hs=1, seeds=(7, 8, 9)):
    why = set()
    for seed in seeds:
        G = be.make_problem(np.random.default_rng(7), 1, hq, hkv, nq, nk, D, causal, fmt, hs)
        hz, orc, dead = run_case(G, fmt, seed=seed, kn=kn)
        if dead:
            why.add("deadlock")
            continue
        dq, dk, dv = be.results(G, fmt)
        ex = be.backward_reference(G["Q"], G["K"], G["V"], G["dO"], G["scale"], causal, hkv)
        errs = [np.abs(x - r).max() / np.abs(r).max() for x, r in zip((dq, dk, dv), ex)]
        if not all(np.isfinite(errs)) or max(errs) > TOL["f16"][1]:
            why.add("numbers (rel err %s)" % "/".join("%.0e" % x for x in errs))
        for h in hz:
            why.add(h.split(" over")[0].split(" reads")[0].split(" overwrites")[0][:60])
        if orc:
            why.add("oracle: " + orc[0][:50])
    expect(bool(why), "caught: %-52s by %s" % (name, "; ".join(sorted(why))[:200]))


neg("dS slab of consumer 1 at +64*64 B (not +kBlockM*128)", ws.Knobs(ds_slab=lambda c: c * 64 * 64))
neg("dS slab of consumer 1 at +64*64 B, d=64", ws.Knobs(ds_slab=lambda c: c * 64 * 64), D=64)
neg("dS slab of consumer 1 at +64*128 B (d=128's), d=64", ws.Knobs(ds_slab=lambda c: c * 64 * 128), D=64)
neg("dQ column offset 0 for both consumers (d=128)", ws.Knobs(dq_column_offset=0))
neg("dQ B = K rows 64c (the old d=64 offset) at d=128", ws.Knobs(kb_slab=lambda c: c * 64 * 128))
neg("dQ query offset 0 for both consumers, d=64", ws.Knobs(dq_query_offset=0), D=64)
neg("dQ query offset 64 at d=128 (kBlockM == 64 there)", ws.Knobs(dq_query_offset=64))
neg("dQ A from query 0 (query0 left out of :233), d=64", ws.Knobs(dq_a_offset=lambda q0: 0), D=64)
neg("dQ A query0 * 64 bytes in, d=64", ws.Knobs(dq_a_offset=lambda q0: q0 * 64), D=64)
neg("dQ reduction rows without query0 (:249), d=64", ws.Knobs(dq_row_query0=False), D=64)
neg("dQ B = K rows 64c at d=64", ws.Knobs(kb_slab=lambda c: c * 64 * 128), D=64)
neg("lse/delta ring slot 128 floats at d=64 (the old kRowsSlot)", ws.Knobs(rows_slot=128), D=64)
neg("lse/delta box at the step's row, not on 16 bytes, d=64", ws.Knobs(rows_align=False), D=64, nq=201, hq=2)
neg("lse/delta box at the step's row, not on 16 bytes", ws.Knobs(rows_align=False), nq=201, hq=2)
neg("host Q/dO maps with 64-row boxes at d=64 (Traits<128>'s)", ws.Knobs(host_box_m=64), D=64)
neg("no named barrier before dQ", ws.Knobs(named_barrier=False))
neg("no named barrier before dQ, d=64", ws.Knobs(named_barrier=False), D=64)
neg("producer empty-wait parity without ^1", ws.Knobs(empty_xor=0))
neg("producer empty-wait parity without ^1, d=64", ws.Knobs(empty_xor=0), D=64)
neg("dS single-buffered", ws.Knobs(ds_double=False))
neg("dS single-buffered, d=64", ws.Knobs(ds_double=False), D=64)
neg("expect_tx 256 bytes short (delta's box forgotten)", ws.Knobs(expect_delta=-256))
neg("expect_tx 16 bytes short (a box of kBlockM floats), d=64", ws.Knobs(expect_delta=-16), D=64)
neg("expect_tx 16 bytes over", ws.Knobs(expect_delta=16))
neg("empty barrier counts 4 arrivals (one warpgroup)", ws.Knobs(empty_count=4))
neg("empty barrier counts 4 arrivals, d=64", ws.Knobs(empty_count=4), D=64, nq=300, hq=2)
neg("empty arrive before the dV/dK wgmma wait", ws.Knobs(release_before_wait=True))
neg("empty arrive before the dV/dK wgmma wait, d=64", ws.Knobs(release_before_wait=True), D=64, nq=300, hq=2)
neg("no fence.proxy.async after stmatrix", ws.Knobs(ds_fence=False))
neg("no fence.proxy.async after stmatrix, d=64", ws.Knobs(ds_fence=False), D=64)
neg("producer threads return before setmaxnreg", ws.Knobs(setmaxnreg_before_return=False))

print("\nFAILURES: %d   (%.0fs)" % (len(failures), time.time() - T0))
for f in failures:
    print("  ", f)
sys.exit(1 if failures else 0)
