"""Drives forward_ws_emu.py (the warp-specialised sm90 forward: TMA producer, 3 consumer warpgroups at d=64, 2 at
d=128, round-robin turn-taking on named barriers):
(0) static plan; (1) byte tags of every wgmma operand; (2) end to end vs float64 (out, lse; every element written
once); (3) the per-row "visible" mask vs the per-element test, in context (needs_masking, key_end, n_tiles);
(4) protocol under randomized interleavings: named-barrier balance and round-robin order for n_tiles 0..12 with 2
and 3 consumers, mbarrier ring (no early overwrite, no deadlock); (5) negative controls.
Usage: python3 run_forward_ws_tests.py [--quick]"""
import sys
import time

import numpy as np

import forward_ws_emu as fe
from ptx_model import Fmt

failures = []
QUICK = "--quick" in sys.argv
T0 = time.time()


def expect(cond, msg):
    print(("  ok   " if cond else "  FAIL ") + msg, flush=True)
    if not cond:
        failures.append(msg)


# ----------------------------------------------------------------- 0. static plan
print("== 0. shared-memory plan, TMA boxes, registers")
for D in (64, 128):
    Tr = fe.Traits(D)
    offs = [0, Tr.kQBytes, Tr.kQBytes + Tr.kTileBytes, Tr.kQBytes + 2 * Tr.kTileBytes, Tr.kQBytes + 3 * Tr.kTileBytes]
    slab_offs = [s * Tr.kBlockM * 128 for s in range(Tr.kSlabs)] + [c * 64 * 128 for c in range(Tr.kConsumers)]
    expect(all(o % 1024 == 0 for o in offs + slab_offs) and Tr.kSmemBytes <= 227 * 1024 and Tr.kBlockM <= 256,
           "d=%d: %d consumers, kBlockM %d (TMA box rows <= 256), Q/K/V slabs and consumer Q slabs 1024-aligned, "
           "%d bytes <= 227 KiB" % (D, Tr.kConsumers, Tr.kBlockM, Tr.kSmemBytes))
    pool = 128 * Tr.kProducerRegisters + 128 * Tr.kConsumers * Tr.kConsumerRegisters
    entry = 65536 // Tr.kThreads // 8 * 8
    expect(pool <= 65536 and Tr.kConsumerRegisters % 8 == 0 and entry >= Tr.kProducerRegisters,
           "d=%d: setmaxnreg 128x%d + %dx%d = %d <= 65536 (entry %d per thread x %d)"
           % (D, Tr.kProducerRegisters, 128 * Tr.kConsumers, Tr.kConsumerRegisters, pool, entry, Tr.kThreads))

# ----------------------------------------------------------------- 1. byte tags
print("\n== 1. operand identity of every wgmma (scheme A: tensor<<14 | row%128<<7 | col; B: row%512<<7 | col)")


def tagged(G, scheme):
    def mk(tid, H, N):
        x = np.zeros((G["B"], H, N, G["d"]), np.uint16)
        rr = np.arange(N)[:, None]
        if scheme == "A":
            x[...] = (tid << 14) | ((rr % 128) << 7) | np.arange(G["d"])[None, :]
        else:
            x[...] = ((rr % 512) << 7) | np.arange(G["d"])[None, :]
        return x
    import backward_emu as be
    G["q"] = be.to_flat(mk(1, G["hq"], G["nq"]), G["q_strides"])
    G["k"] = be.to_flat(mk(2, G["hkv"], G["nk"]), G["k_strides"])
    G["v"] = be.to_flat(mk(3, G["hkv"], G["nk"]), G["v_strides"])


def tile_tags(scheme, tid, row0, nrows, valid, d):
    r = row0 + np.arange(nrows)
    if scheme == "A":
        x = (tid << 14) | ((r % 128)[:, None] << 7) | np.arange(d)[None, :]
    else:
        x = ((r % 512)[:, None] << 7) | np.arange(d)[None, :]
    x[r >= valid] = 0
    return x.astype(np.int64)


def tag_case(B, hq, hkv, nq, nk, d, causal, scheme, seed, kn=None, dyn_base=0):
    fmt = Fmt("f16")
    G = fe.make_problem(np.random.default_rng(1), B, hq, hkv, nq, nk, d, causal, fmt)
    tagged(G, scheme)
    log = []
    kn = kn or fe.Knobs(tags=True)
    kn.tags = True
    hz = fe.run_forward(G, fmt, seed=seed, kn=kn, tag_log=log, dyn_base=dyn_base)
    Tr = fe.Traits(d, kn.consumers)
    kC, kBlockM = Tr.kConsumers, Tr.kBlockM
    good = {"S A=Q": True, "S B=K": True, "PV A=own P": True, "PV B=V": True, "counts": True}
    by = {}
    for (prod, bx, c, j, kk, A, Bm) in log:
        by.setdefault((bx, c), []).append((prod, j, kk, A, Bm))
    m_blocks = (nq + kBlockM - 1) // kBlockM
    for bx in range(m_blocks * B * hq):
        bh, m_index = bx // m_blocks, bx % m_blocks
        batch, head = bh // hq, bh % hq
        row0 = ((m_blocks - 1 - m_index) if causal else m_index) * kBlockM
        rows = min(kBlockM, nq - row0)
        key_end = max(0, min(nk, row0 + rows + nk - nq)) if causal else nk
        n_tiles = (key_end + 127) // 128
        for c in range(kC):
            calls = by.get((bx, c), [])
            good["counts"] &= (sum(1 for x in calls if x[0] == "S") == n_tiles * d // 16
                               and sum(1 for x in calls if x[0] == "PV") == n_tiles * 8)
            Qt = tile_tags(scheme, 1, row0 + 64 * c, 64, nq, d)
            for prod, j, kk, A, Bm in calls:
                if prod == "S":
                    Kt = tile_tags(scheme, 2, 128 * j, 128, nk, d)
                    good["S A=Q"] &= bool((A == Qt[:, 16 * kk:16 * kk + 16]).all())
                    good["S B=K"] &= bool((Bm == Kt[:, 16 * kk:16 * kk + 16].T).all())
                else:
                    Vt = tile_tags(scheme, 3, 128 * j + 16 * kk, 16, nk, d)
                    good["PV B=V"] &= bool((Bm == Vt).all())
                    lane = np.arange(128) % 32
                    w = np.arange(128) // 32
                    want = (0x8000 | (c << 13) | (w[:, None] << 11) | (kk << 7) | (lane[:, None] << 2)
                            | np.arange(4)[None, :])
                    good["PV A=own P"] &= bool((A == (want | (want << 16))).all())
    return good, len(log), hz


tag_cases = [(1, 1, 1, 97, 113, 64, False), (1, 1, 1, 300, 260, 64, True), (1, 2, 1, 193, 300, 64, False),
             (1, 1, 1, 200, 330, 128, True), (2, 2, 1, 129, 257, 128, False), (1, 1, 1, 7, 300, 64, True)]
for i, (B, hq, hkv, nq, nk, d, causal) in enumerate(tag_cases if not QUICK else tag_cases[:3]):
    for scheme in ("A", "B"):
        good, n, hz = tag_case(B, hq, hkv, nq, nk, d, causal, scheme, seed=20 + i, dyn_base=(0, 528)[i % 2])
        expect(all(good.values()) and not hz,
               "scheme %s d=%d B=%d hq=%d hkv=%d nq=%d nk=%d causal=%d: %d wgmmas, hazards %d: %s"
               % (scheme, d, B, hq, hkv, nq, nk, causal, n, len(hz),
                  ", ".join(k + ("" if v else " WRONG") for k, v in good.items())))

# ----------------------------------------------------------------- 2. end to end
print("\n== 2. end to end vs float64 softmax(QK^T scale)V and LSE (one random skewed interleaving per case)")
TOL = {"f16": 4e-3, "bf16": 3e-2}
shapes = [  # B, hq, hkv, nq, nk
    (1, 1, 1, 1, 1), (1, 1, 1, 7, 300), (1, 1, 1, 300, 7), (1, 1, 1, 97, 113), (1, 1, 1, 193, 64),
    (1, 1, 1, 129, 1025), (1, 1, 1, 400, 390), (2, 4, 2, 150, 200), (1, 6, 2, 385, 129), (1, 1, 1, 64, 0)]
if QUICK:
    shapes = shapes[:5]
worst = {}


def run_case(G, fmt, seed, kn=None, dyn_base=0, protos=None):
    orc = []
    try:
        hz = fe.run_forward(G, fmt, seed=seed, kn=kn, oracle=orc, dyn_base=dyn_base, protos=protos)
        dead = None
    except fe.Deadlock as e:
        hz, dead = [], str(e)
    except fe.Hazard as e:
        hz, dead = [str(e)], None
    return hz, orc, dead


def check_outputs(G, fmt):
    out, lse, w, lw = fe.results(G, fmt)
    O, L = fe.reference(G)
    err = np.abs(out - O).max() if O.size else 0.0
    dead_rows = np.isinf(L)
    lse_ok = bool((lse[dead_rows] == -np.inf).all()) and (np.abs(lse[~dead_rows] - L[~dead_rows]).max()
                                                          if (~dead_rows).any() else 0) < 1e-3
    zero_ok = bool((out[dead_rows] == 0).all())
    return err, lse_ok, zero_ok, bool((w == 1).all() and (lw == 1).all()), int(dead_rows.sum())


ci = 0
for dtype in ("f16", "bf16"):
    fmt = Fmt(dtype)
    for D in (64, 128):
        for causal in (False, True):
            for (B, hq, hkv, nq, nk) in shapes:
                ci += 1
                G = fe.make_problem(np.random.default_rng(100 + ci), B, hq, hkv, nq, nk, D, causal, fmt)
                hz, orc, dead = run_case(G, fmt, seed=1000 + ci, dyn_base=(0, 528)[ci % 2])
                if dead:
                    expect(False, "%s d=%d nq=%d nk=%d causal=%d: DEADLOCK %s" % (dtype, D, nq, nk, causal, dead[:200]))
                    continue
                err, lse_ok, zero_ok, once, n_dead = check_outputs(G, fmt)
                worst[dtype] = max(worst.get(dtype, 0), err)
                expect(not hz and not orc and err < TOL[dtype] and lse_ok and zero_ok and once,
                       "%s d=%d B=%d hq=%d hkv=%d nq=%d nk=%d causal=%d: max|out-ref| %.1e, lse %s, fully masked "
                       "rows %d (out 0, lse -inf: %s), each out/lse element written once %s, hazards %d, oracle %d"
                       % (dtype, D, B, hq, hkv, nq, nk, causal, err, "ok" if lse_ok else "WRONG", n_dead,
                          zero_ok, once, len(hz), len(orc)))
                if hz or orc:
                    print("       ", (hz + orc)[:3])
print("  worst max abs error:", {k: "%.1e" % v for k, v in worst.items()}, "(%.0fs)" % (time.time() - T0))

# ----------------------------------------------------------------- 3. masking in context
print("\n== 3. per-row 'visible' bound vs per-element truth, in the kernel's context (exhaustive integer check)")


def mask_check(nq, nk, D, causal, visible_plus=1):
    """For every block, consumer, warp, lane, tile j < n_tiles, element: the kernel's hide decision
    (needs_masking and visible) vs truth (key >= nk, or causal key > query + nk - nq) for rows < nq; and every
    key of a valid row that truth shows lies in a tile < n_tiles. Returns (#mismatches, #cases)."""
    Tr = fe.Traits(D)
    kBlockM = Tr.kBlockM
    m_blocks = (nq + kBlockM - 1) // kBlockM
    co = nk - nq
    bad = 0
    n = 0
    lane = np.arange(32)
    g, t = lane // 4, lane % 4
    nt = np.arange(16)
    e = np.arange(4)
    for m_index in range(m_blocks):
        row0 = ((m_blocks - 1 - m_index) if causal else m_index) * kBlockM
        rows = min(kBlockM, nq - row0)
        key_end = max(0, min(nk, row0 + rows + co)) if causal else nk
        n_tiles = (key_end + 127) // 128
        # coverage: a valid row's last visible key must lie below n_tiles * 128
        for q in range(row0, row0 + rows):
            last = min(nk, q + co + 1) if causal else nk
            if last > n_tiles * 128:
                bad += 1
        for c in range(Tr.kConsumers):
            wg_row0 = row0 + 64 * c
            for w in range(4):
                for j in range(n_tiles):
                    col0 = 128 * j
                    needs = col0 + 128 > key_end or (causal and col0 + 127 > wg_row0 + co)
                    r = wg_row0 + 16 * w + g[:, None, None] + 8 * (e[None, None, :] >> 1)     # (32, 1, 4)
                    key = col0 + nt[None, :, None] * 8 + 2 * t[:, None, None] + (e[None, None, :] & 1)
                    truth = key >= nk
                    if causal:
                        truth = truth | (key > r + co)
                    if needs:
                        vis = np.stack([np.minimum(key_end - col0, (wg_row0 + 16 * w + g + 8 * h + co - col0 + visible_plus)
                                                   if causal else key_end - col0) - 2 * t for h in range(2)], 1)
                        hide = (nt[None, :, None] * 8 + (e[None, None, :] & 1)) >= vis[:, None, (e >> 1)][:, :, :]
                    else:
                        hide = np.zeros(truth.shape, bool)
                    valid = np.broadcast_to(r < nq, truth.shape)
                    bad += int(((hide != truth) & valid).sum())
                    n += int(valid.sum())
    return bad, n


rng = np.random.default_rng(9)
pairs = [(1, 1), (7, 300), (300, 7), (97, 113), (193, 64), (129, 1025), (192, 192), (191, 193), (384, 128),
         (1, 129), (129, 1), (600, 1)] + [(int(a), int(b)) for a, b in rng.integers(1, 700, (40 if QUICK else 150, 2))]
for D in (64, 128):
    for causal in (False, True):
        tot_bad = tot = 0
        for nq, nk in pairs:
            b_, n_ = mask_check(nq, nk, D, causal)
            tot_bad += b_
            tot += n_
        expect(tot_bad == 0, "d=%d causal=%d, %d shapes: %d mismatches in %d (element, tile) decisions"
               % (D, causal, len(pairs), tot_bad, tot))
b_, n_ = mask_check(300, 260, 64, True, visible_plus=0)
expect(b_ > 0, "control: visible without the +1 disagrees with truth (%d mismatches)" % b_)

# ----------------------------------------------------------------- 4. protocol
print("\n== 4. protocol under randomized skewed interleavings: named barriers (balance, round robin), mbarrier ring")
fmt = Fmt("f16")


def proto_case(D, n_tiles_want, seed, consumers=None, causal=False, nq=None):
    nk = max(0, 128 * n_tiles_want - (seed % 3) * 37)
    nk = nk if nk > 128 * (n_tiles_want - 1) else 128 * n_tiles_want
    G = fe.make_problem(np.random.default_rng(seed), 1, 1, 1, nq or 50, nk, D, causal, fmt)
    protos = []
    kn = fe.Knobs(stats=stats, consumers=consumers)
    hz, orc, dead = run_case(G, fmt, seed, kn=kn, protos=protos)
    problems = []
    kC = fe.Traits(D, consumers).kConsumers
    for p in protos:
        n = p["n_tiles"]
        if n == 0:
            if p.get("nb_log"):
                problems.append("n_tiles 0 touched a named barrier")
            continue
        # each barrier 1+c: n+1 generations, each = 4 syncs by c + 4 arrivals by c-1 (mod kC)
        for c in range(kC):
            bid = 1 + c
            if p["nb_gen"].get(bid, 0) != n + 1:
                problems.append("barrier %d: %d generations, want %d" % (bid, p["nb_gen"].get(bid, 0), n + 1))
            for gg in range(n + 1):
                ent = sorted((who, kind) for (b, g_, who, kind) in p["nb_log"] if b == bid and g_ == gg)
                want = sorted([((c, w), "sync") for w in range(4)] + [(((c - 1) % kC, w), "arrive") for w in range(4)])
                if ent != want:
                    problems.append("barrier %d generation %d: %s" % (bid, gg, ent[:3]))
        if len(p.get("finished", ())) != 4 * kC:
            problems.append("not every consumer warp finished")
    err, lse_ok, zero_ok, once, _ = check_outputs(G, fmt)
    if err > TOL["f16"] or not (lse_ok and zero_ok and once):
        problems.append("numbers")
    return hz, orc, dead, problems


stats = {}
t1 = time.time()
bad = []
runs = 0
seeds = 3 if QUICK else 10
for D, consumers in ((64, None), (128, None), (64, 2), (128, 3)):
    for n_tiles_want in (list(range(0, 7)) + [9, 12]):
        for s in range(seeds if n_tiles_want <= 4 else max(1, seeds // 3)):
            seed = 7000 + 97 * n_tiles_want + s + 13 * D + (consumers or 0)
            hz, orc, dead, problems = proto_case(D, n_tiles_want, seed, consumers)
            runs += 1
            if hz or orc or dead or problems:
                bad.append((D, consumers, n_tiles_want, seed, hz[:2], orc[:2], dead, problems[:3]))
# causal blocks with n_tiles = 0 (rows that see no key) next to blocks with tiles
for s in range(seeds):
    hz, orc, dead, problems = proto_case(64, 1, 9000 + s, causal=True, nq=700)
    runs += 1
    if hz or orc or dead or problems:
        bad.append(("causal 700x128", s, hz[:2], orc[:2], dead, problems[:3]))
expect(not bad, "%d runs (d=64 x3 / d=128 x2 consumers, plus 2<->3 swapped; n_tiles 0..6, 9, 12): no deadlock, no race, "
       "no early overwrite, each barrier n_tiles+1 generations of (4 syncs of c, 4 arrivals of c-1), none left at "
       "exit%s (%.0fs)" % (runs, "" if not bad else ": " + str(bad[:2]), time.time() - t1))
expect(len(stats) == 2 and all(v > 0 for v in stats.values()),
       "the interleavings reach the overlaps the rings must order: %s" % stats)

# ----------------------------------------------------------------- 5. negative controls
print("\n== 5. negative controls: deliberately broken variants must be caught")


def neg(name, kn, D=64, nq=300, nk=650, causal=True, hq=1, hkv=1, seeds=(7, 8, 9), tags=False):
    why = set()
    for seed in seeds:
        if tags:
            good, n, hz = tag_case(1, hq, hkv, nq, nk, D, causal, "B", seed, kn=kn)
            if not all(good.values()):
                why.add("tags (%s)" % ", ".join(k for k, v in good.items() if not v))
            for h in hz:
                why.add(h[:60])
            continue
        G = fe.make_problem(np.random.default_rng(7), 1, hq, hkv, nq, nk, D, causal, fmt)
        hz, orc, dead = run_case(G, fmt, seed=seed, kn=kn)
        if dead:
            why.add("deadlock")
            continue
        err, lse_ok, zero_ok, once, _ = check_outputs(G, fmt)
        if not np.isfinite(err) or err > TOL["f16"] or not lse_ok or not zero_ok:
            why.add("numbers (max err %.0e, lse %s)" % (err, lse_ok))
        if not once:
            why.add("out/lse writes")
        for h in hz:
            why.add(h.split(" over")[0].split(" reads")[0].split(" overwrites")[0][:60])
        if orc:
            why.add("oracle: " + orc[0][:50])
    expect(bool(why), "caught: %-58s by %s" % (name, "; ".join(sorted(why))[:220]))


neg("initial arrival from consumer 0 (not the last)", fe.Knobs(initial_by=0))
neg("initial arrival from consumer 0, d=128", fe.Knobs(initial_by=0), D=128)
neg("initial arrival from consumer 1 (3 consumers)", fe.Knobs(initial_by=1))
neg("no final skip (last consumer arrives at the end)", fe.Knobs(final_skip=False))
neg("no final skip, d=128", fe.Knobs(final_skip=False), D=128)
neg("old 2-consumer next turn (2 - consumer) with 3 consumers", fe.Knobs(next_turn=lambda c, k: 2 - c if c < 2 else 1))
neg("Q slab of consumer 2 at +128*128 mod 16384 (rows 0-63)", fe.Knobs(q_slab=lambda c: (c * 64 * 128) % 16384), tags=True)
neg("Q slab of consumer 2 at +128*128 mod 16384, numbers", fe.Knobs(q_slab=lambda c: (c * 64 * 128) % 16384))
neg("Q slab per consumer 64*64 (not 64*128)", fe.Knobs(q_slab=lambda c: c * 64 * 64))
neg("Q box of 128 rows (2-consumer height) at d=64", fe.Knobs(q_box_rows=128))
neg("visible without +1", fe.Knobs(visible_plus=0))
neg("visible +2", fe.Knobs(visible_plus=2))
neg("needs_masking judged by the warpgroup's last row (+63)", fe.Knobs(
    needs_masking=lambda col0, key_end, wg_row0, co: col0 + 128 > key_end or col0 + 127 > wg_row0 + 63 + co))
neg("producer empty-wait parity without ^1", fe.Knobs(empty_xor=0))
neg("empty barriers count 8 arrivals (2 consumers) at d=64", fe.Knobs(empty_count=8))
neg("K released before wgmma wait<1>", fe.Knobs(release_k_early=True))
neg("wait<2> instead of wait<1> (S_j not waited)", fe.Knobs(wait1=2))

print("\nFAILURES: %d   (%.0fs)" % (len(failures), time.time() - T0))
for f in failures:
    print("  ", f)
sys.exit(1 if failures else 0)
