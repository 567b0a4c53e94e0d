"""attn_mask on the warp-specialised sm90 forward (commit 2f5de7d: HasMask, add_mask, d=128 only; since c1dfc5c
the masked instantiations keep 128-key tiles while unmasked non-causal d=128 takes 176), through
forward_ws_emu.py (same producer / consumer coroutines, race detector, TMA model as run_forward_ws_tests.py):
(0) dispatch: use_sm90_forward / launch_forward_sm90 (masked d=64 refused, masked d=128 -> HasMask);
(1) every mask kind of tests/attention_cases.py MASK_KINDS except "none" (plus float32-additive variants, rows whose
    first tiles are fully masked, +inf/NaN under hidden entries) at the test-suite's B2 H4/2 113x800 d=128, f16/bf16,
    causal and not, mask storage contiguous / padded / column stride 2 / transposed (poison in every gap);
(2) awkward Nq/Nk and GQA; (2b) persistent blocks (kSm90Persistent: d=128 blocks, causal or not, take several
    work items, so each reads the mask of several (batch, head) pairs) on 2-3 emulated SMs; (3) negative controls.
Checked per run: out and lse vs float64 softmax(Q K^T scale + mask) V (hidden entries -inf whatever the mask holds),
fully masked rows out 0 / lse -inf, every out/lse element written once, no race / early overwrite / deadlock, and
every mask read: inside the buffer, at an index some in-range position maps to, of a logical (row, col) inside
[0, Nq) x [0, Nk) and visible (causal), each visible (b, h, row, col) read exactly once.
Usage: python3 run_forward_ws_mask_tests.py [--quick]"""
import sys
import time

import numpy as np

import forward_ws_emu as fe
from ptx_model import Fmt

failures = []
QUICK = "--quick" in sys.argv
T0 = time.time()
TOL = {"f16": 4e-3, "bf16": 3e-2}


def expect(cond, msg):
    print(("  ok   " if cond else "  FAIL ") + msg, flush=True)
    if not cond:
        failures.append(msg)


# ----------------------------------------------------------------- masks
def own_mask(kind, B, H, nq, nk, rng, causal):
    """(values of the mask's own shape, storage kind): values float64 (additive) or bool. Mirrors make_mask."""
    r = lambda *sh: rng.random(sh)
    if kind == "bool":
        return r(B, H, nq, nk) > 0.25, "bool"
    if kind in ("additive", "additive_f32"):
        m = rng.standard_normal((B, H, nq, nk))
        m[r(B, H, nq, nk) < 0.2] = -np.inf
        return m, ("input" if kind == "additive" else "f32")
    if kind == "key_padding":
        keep = r(B, 1, 1, nk) > 0.3
        keep[..., 0] = True
        return keep, "bool"
    if kind in ("key_padding_additive", "key_padding_additive_f32"):
        pad = r(B, 1, 1, nk) < 0.3
        pad[..., 0] = False
        return np.where(pad, -np.inf, 0.0), ("input" if kind == "key_padding_additive" else "f32")
    if kind == "per_head":
        return r(1, H, nq, nk) > 0.5, "bool"
    if kind == "rows_2d":
        return (r(nq, nk) > 0.4)[None, None], "bool"        # [Nq, Nk]: expand gives batch/head stride 0
    if kind == "fully_masked_rows":
        m = r(B, H, nq, nk) > 0.25
        m[:, :, ::3, :] = False
        return m, "bool"
    if kind == "key_block_holes":
        keep = np.ones((B, 1, 1, nk), bool)
        keep[..., 64:192] = False
        keep[..., 256:768] = False
        return keep, "bool"
    if kind == "late_start":        # rows whose first tiles (keys < 300) are all -inf; every 5th row all -inf
        m = rng.standard_normal((B, H, nq, nk)) * 2
        m[:, :, ::2, :300] = -np.inf
        m[:, :, ::5, :] = -np.inf
        return m, "f32"
    if kind == "poison_hidden":     # +inf / NaN wherever causal hides the entry (must never be read)
        m = rng.standard_normal((B, H, nq, nk))
        hid = np.arange(nk)[None, :] > np.arange(nq)[:, None] + (nk - nq)
        if causal:
            pois = np.where((np.arange(nq)[:, None] + np.arange(nk)[None, :]) % 2 == 0, np.inf, np.nan)
            m[:, :, hid] = np.broadcast_to(pois, (nq, nk))[hid]
        return m, "f32"
    raise ValueError(kind)


def poison(kind, fmt, n, rng):
    if kind == "bool":
        return (rng.random(n) < 0.5).astype(np.uint8)
    vals = np.where(rng.random(n) < 0.5, np.float32(np.inf), np.float32(np.nan)).astype(np.float32)
    return vals if kind == "f32" else fmt.enc(vals)


def encode(kind, fmt, v):
    if kind == "bool":
        return v.astype(np.uint8)
    if kind == "f32":
        return v.astype(np.float32)
    return fmt.enc(v.astype(np.float32))


def build_mask(kind_name, B, H, nq, nk, fmt, layout, rng, causal):
    vals, kind = own_mask(kind_name, B, H, nq, nk, rng, causal)
    Bm, Hm, Nqm, Nkm = vals.shape
    # physical storage (element strides), gaps poisoned
    if layout == "contig":
        phys, st = (Bm, Hm, Nqm, Nkm), None
    elif layout == "padded":
        phys = (Bm, Hm, Nqm + 3, Nkm + 5)
    elif layout == "colstride":
        phys = (Bm, Hm, Nqm, 2 * Nkm + 1)
    elif layout == "transposed":
        phys = (Bm, Hm, Nkm + 2, Nqm + 1)
    n = int(np.prod(phys)) + 64                                  # 64 poisoned elements past the end
    buf = poison(kind, fmt, n, rng)
    if layout == "transposed":
        st = [Hm * phys[2] * phys[3], phys[2] * phys[3], 1, phys[3]]
    else:
        st = [Hm * phys[2] * phys[3], phys[2] * phys[3], phys[3], 2 if layout == "colstride" else 1]
    enc = encode(kind, fmt, vals)
    b_, h_, r_, c_ = np.meshgrid(np.arange(Bm), np.arange(Hm), np.arange(Nqm), np.arange(Nkm), indexing="ij")
    own_idx = b_ * st[0] + h_ * st[1] + r_ * st[2] + c_ * st[3]
    buf[own_idx] = enc
    allowed = np.zeros(n, bool)
    allowed[own_idx] = True
    # checks.cpp prepare_mask: m.expand([B, Hq, Nq, Nk]) -> broadcast dims stride 0
    target = (B, H, nq, nk)
    strides = [0 if (vals.shape[i] == 1 and target[i] != 1) else st[i] for i in range(4)]
    if kind == "bool":
        logical = np.where(vals, 0.0, -np.inf)
    elif kind == "f32":
        logical = vals.astype(np.float32).astype(np.float64)
    else:
        logical = fmt.dec(enc).astype(np.float64)
    logical = np.broadcast_to(logical, target)
    return dict(kind=kind, buf=buf, strides=strides, allowed=allowed, logical=logical,
                counts=np.zeros(target, np.int64), oob=0, outside=0, hidden_reads=0)


def visible(nq, nk, causal):
    if not causal:
        return np.ones((nq, nk), bool)
    return np.arange(nk)[None, :] <= np.arange(nq)[:, None] + (nk - nq)


def run_case(B, hq, hkv, nq, nk, dtype, causal, kind, layout, seed, kn=None, sms=None):
    fmt = Fmt(dtype)
    rng = np.random.default_rng(seed)
    G = fe.make_problem(rng, B, hq, hkv, nq, nk, 128, causal, fmt)
    if sms is not None:
        G["sms"] = sms          # persistent blocks (d=128): fewer blocks than items, items from the work counter
    G["mask"] = build_mask(kind, B, hq, nq, nk, fmt, layout, rng, causal)
    orc = []
    try:
        hz = fe.run_forward(G, fmt, seed=seed, kn=kn, oracle=orc, dyn_base=(0, 528)[seed % 2])
        dead = None
    except fe.Deadlock as e:
        hz, dead = [], str(e)[:100]
    M = G["mask"]
    out, lse, w, lw = fe.results(G, fmt)
    O, L = fe.reference(G)
    with np.errstate(invalid="ignore"):
        err = float(np.nanmax(np.abs(out - O))) if O.size else 0.0
    if np.isnan(out).any():
        err = np.inf
    dead_rows = np.isinf(L)
    lse_ok = bool((lse[dead_rows] == -np.inf).all()) and (
        (np.abs(lse[~dead_rows] - L[~dead_rows]).max() if (~dead_rows).any() else 0) < 1e-3)
    zero_ok = bool((out[dead_rows] == 0).all())
    once = bool((w == 1).all() and (lw == 1).all())
    cover = bool((M["counts"] == visible(nq, nk, causal)[None, None]).all())
    reads_ok = M["oob"] == 0 and M["outside"] == 0 and M["hidden_reads"] == 0
    ok = (not dead and not hz and not orc and err < TOL[dtype] and lse_ok and zero_ok and once and cover
          and reads_ok)
    info = ("max|out-ref| %.1e lse %s, dead rows %d (out 0: %s), written once %s, mask reads: oob %d, unmapped %d, "
            "hidden/out-of-range %d, each visible once %s; hazards %d oracle %d%s"
            % (err, "ok" if lse_ok else "WRONG", int(dead_rows.sum()), zero_ok, once, M["oob"], M["outside"],
               M["hidden_reads"], cover, len(hz), len(orc), (" DEADLOCK " + dead) if dead else ""))
    return ok, info, dict(err=err, lse_ok=lse_ok, zero_ok=zero_ok, cover=cover, reads_ok=reads_ok,
                          hz=hz, orc=orc, dead=dead, M=M, n_dead=int(dead_rows.sum()))


# ----------------------------------------------------------------- 0. dispatch
print("== 0. dispatch (attention_cuda_ops.cpp use_sm90_forward, forward_kernel.cuh launch_forward_sm90)")
expect([fe.use_sm90_forward(d, m) for d in (32, 64, 128) for m in ("none", "bool")]
       == [False, False, True, False, True, True],
       "use_sm90_forward: d=32 never, d=64 unmasked only, d=128 masked and not")
expect(fe.launch_instantiation(128, "bool", True) == (True, True)
       and fe.launch_instantiation(128, "bool", False) == (False, True)
       and fe.launch_instantiation(128, "none", True) == (True, False)
       and fe.launch_instantiation(64, "none", False) == (False, False)
       and fe.launch_instantiation(64, "bool", False) == "invalid_argument",
       "launch_forward_sm90: masked d=128 -> <IsCausal, HasMask=true>; unmasked -> HasMask=false; masked d=64 throws")
# c1dfc5c: masked calls keep 128-key tiles (176 would spill), kernel and host alike
tiles = []
for causal in (False, True):
    G = fe.make_problem(np.random.default_rng(0), 1, 1, 1, 8, 8, 128, causal, Fmt("f16"))
    G["mask"] = build_mask("bool", 1, 1, 8, 8, Fmt("f16"), "contig", np.random.default_rng(0), causal)
    L = fe.host_launch(G)
    tiles.append((L["inst"], L["traits"].kBlockN, L["kv_box"]))
expect(tiles == [((False, True), 128, 128), ((True, True), 128, 128)],
       "masked d=128 (causal and not): <IsCausal, HasMask=true>, kernel kBlockN 128 = host K/V box height: %s" % tiles)
try:
    G = fe.make_problem(np.random.default_rng(0), 1, 1, 1, 8, 8, 64, False, Fmt("f16"))
    G["mask"] = build_mask("bool", 1, 1, 8, 8, Fmt("f16"), "contig", np.random.default_rng(0), False)
    fe.run_forward(G, Fmt("f16"))
    expect(False, "emulated launch of a masked d=64 call throws")
except ValueError:
    expect(True, "emulated launch of a masked d=64 call throws")

# ----------------------------------------------------------------- 1. every kind at the test-suite shape
print("\n== 1. every mask kind, B=2 Hq=4 Hkv=2 Nq=113 Nk=800 d=128 (test_sm90_every_mask_kind)")
KINDS = ["bool", "additive", "additive_f32", "key_padding", "key_padding_additive", "key_padding_additive_f32",
         "per_head", "rows_2d", "fully_masked_rows", "key_block_holes", "late_start", "poison_hidden"]
LAYOUTS = ["contig", "padded", "colstride", "transposed"]
worst = {}
ci = 0
for dtype in ("f16", "bf16"):
    for causal in (False, True):
        for kind in (KINDS if not QUICK else KINDS[::3]):
            ci += 1
            layout = LAYOUTS[ci % 4]
            ok, info, d = run_case(2, 4, 2, 113, 800, dtype, causal, kind, layout, seed=300 + ci)
            worst[dtype] = max(worst.get(dtype, 0), d["err"])
            expect(ok, "%s causal=%d %-24s %-10s %s" % (dtype, causal, kind, layout, info))
print("  worst max abs error:", {k: "%.1e" % v for k, v in worst.items()}, "(%.0fs)" % (time.time() - T0))

# ----------------------------------------------------------------- 2. awkward shapes, GQA, strides
print("\n== 2. awkward Nq/Nk, GQA, strided masks")
shapes = [(1, 1, 1, 7, 300), (1, 1, 1, 300, 7), (1, 1, 1, 129, 1025), (1, 1, 1, 1, 1), (1, 6, 2, 193, 130),
          (2, 4, 1, 64, 129), (1, 2, 2, 400, 390)]
if QUICK:
    shapes = shapes[:3]
kinds2 = ["bool", "additive", "key_padding_additive_f32", "per_head", "rows_2d", "fully_masked_rows", "late_start",
          "poison_hidden", "key_block_holes"]
for si, (B, hq, hkv, nq, nk) in enumerate(shapes):
    for causal in (False, True):
        for k_i, kind in enumerate(kinds2 if not QUICK else kinds2[:3]):
            ci += 1
            dtype = ("f16", "bf16")[ci % 2]
            layout = LAYOUTS[(ci // 2) % 4]
            ok, info, d = run_case(B, hq, hkv, nq, nk, dtype, causal, kind, layout, seed=900 + ci)
            expect(ok, "%s B%d H%d/%d %dx%d causal=%d %-24s %-10s %s"
                   % (dtype, B, hq, hkv, nq, nk, causal, kind, layout, info))
print("  (%.0fs)" % (time.time() - T0))

# ----------------------------------------------------------------- 2b. persistent blocks
print("\n== 2b. persistent blocks (d=128, 2-3 emulated SMs): each block reads the mask of several (batch, head) items")
pshapes = [(2, 4, 2, 113, 800, 3), (1, 3, 1, 300, 200, 2), (2, 2, 2, 129, 300, 3), (1, 2, 1, 700, 300, 3)]
for si, (B, hq, hkv, nq, nk, sms) in enumerate(pshapes if not QUICK else pshapes[::2] + pshapes[3:]):
    for causal in (False, True):
        for kind in (("bool", "per_head", "rows_2d", "key_padding_additive_f32", "poison_hidden") if not QUICK
                     else ("per_head", "poison_hidden")):
            ci += 1
            dtype = ("f16", "bf16")[ci % 2]
            layout = LAYOUTS[(ci // 2) % 4]
            ok, info, d = run_case(B, hq, hkv, nq, nk, dtype, causal, kind, layout, seed=1300 + ci, sms=sms)
            expect(ok, "[%d SMs] %s B%d H%d/%d %dx%d causal=%d %-24s %-10s %s"
                   % (sms, dtype, B, hq, hkv, nq, nk, causal, kind, layout, info))
print("  (%.0fs)" % (time.time() - T0))

# ----------------------------------------------------------------- 3. negative controls
print("\n== 3. negative controls: broken add_mask variants must be caught")


def neg(name, variant, kind="poison_hidden", nq=113, nk=300, causal=True, layout="padded", B=1, hq=2, sms=None):
    why = set()
    for seed in (1, 2):
        ok, info, d = run_case(B, hq, 1, nq, nk, "f16", causal, kind, layout, seed, kn=fe.Knobs(mask_variant=variant),
                               sms=sms)
        if not np.isfinite(d["err"]) or d["err"] > TOL["f16"] or not d["lse_ok"]:
            why.add("numbers")
        if not d["reads_ok"]:
            why.add("reads (oob %d unmapped %d hidden %d)" % (d["M"]["oob"], d["M"]["outside"], d["M"]["hidden_reads"]))
        if not d["cover"]:
            why.add("coverage")
    expect(bool(why), "caught: %-50s by %s" % (name, "; ".join(sorted(why))))


neg("no row_valid (rows past Nq read)", "no_row_valid", causal=False)
neg("no -inf test (hidden entries get +inf/NaN)", "no_hidden_test")
neg("column offset t instead of 2t", "col_t", kind="bool", causal=False)
neg("mask added before the hiding", "before_hide")
neg("mask base of the block's first item (persistent, 2 SMs)", "stale_base", kind="per_head", B=2, hq=3, sms=2)

print("\nFAILURES: %d   (%.0fs)" % (len(failures), time.time() - T0))
for f in failures:
    print("  ", f)
sys.exit(1 if failures else 0)
