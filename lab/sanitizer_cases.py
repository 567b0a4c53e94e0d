"""Small CUDA calls for compute-sanitizer (memcheck, racecheck): the forward
and backward for every head dim, dtype, mask kind, causal, and sizes that end
mid-tile, and backward walks of several steps per key block, also in the
deterministic mode; a forward with several work items per persistent block;
forward_kvcache with and without appends, one and several splits, empty
caches, float16 and bfloat16, and a sequence whose length does not fit; the
splits merged both ways (in thread block clusters where sm_90 allows, and
through global memory), and at d=128 with blocks of 4 warps forced as well
as the planner's (8 on H100 and H200); the op's num_splits, merge_in_cluster
and warps arguments choose.
Run: compute-sanitizer --tool memcheck python3 lab/sanitizer_cases.py [GROUP ...]
with GROUP "attention" (forward and backward), "kvcache", or "deterministic" (the
backward's deterministic mode alone, which "attention" includes; default: the
first two)."""

import sys

import torch

sys.path.insert(0, "tests")
import fusedattn  # noqa: E402,F401
from fusedattn.bench import _deterministic_algorithms  # noqa: E402
from helpers.attention_cases import Case, make_inputs  # noqa: E402
from helpers.kvcache_cases import make_cache  # noqa: E402
from helpers.varlen_cases import packed  # noqa: E402

GROUPS = ("attention", "kvcache", "deterministic")
groups = sys.argv[1:] or ["attention", "kvcache"]
if unknown := set(groups) - set(GROUPS):
    sys.exit(f"sanitizer_cases: unknown group(s) {sorted(unknown)}; expected some of {GROUPS}")


def deterministic_cases():
    """The sm90 backward's deterministic mode (dQ added at turns by writer
    warps): several key blocks per query tile at its head dims (the wide
    kernel's at d=192), causal, windowed and soft-capped, walks rotated and
    not, and packed sequences (an empty one among them)."""
    with _deterministic_algorithms():
        for head_dim in (64, 128, 192):  # 192: the wide kernel's
            # 64 queries: fewer steps than key blocks, so the walks start together.
            calls = [(False, None, 300, None), (False, None, 64, None), (True, None, 300, None),
                     (False, (100, 20), 300, None)] + ([(True, None, 300, 6.0)] if head_dim <= 128 else [])
            for causal, window, seqlen_q, cap in calls:
                case = Case(batch=1, heads_q=2, heads_kv=1, seqlen_q=seqlen_q, seqlen_k=400, head_dim=head_dim,
                            dtype=torch.bfloat16, mask="none", is_causal=causal, window=window)
                q, k, v, _ = make_inputs(case, "cuda")
                out, lse = torch.ops.fusedattn.forward(q, k, v, None, causal, None, None, window, cap)
                torch.ops.fusedattn.backward(torch.randn_like(out), q, k, v, out, lse, None, causal, None, None,
                                             window, cap)
        q, k, v, cu_q, cu_k = packed([300, 0, 70, 129], [260, 5, 70, 300], d=64, dtype=torch.float16, device="cuda",
                                     requires_grad=True)
        for causal in (False, True):
            fusedattn.attention_varlen(q, k, v, cu_q, cu_k, is_causal=causal).sum().backward()


def attention_cases():
    for head_dim in (32, 64, 128):
        for dtype in (torch.float16, torch.bfloat16):
            for mask, causal in (("none", False), ("none", True), ("bool", True), ("additive", False),
                                 ("key_block_holes", True)):
                case = Case(batch=1, heads_q=2, heads_kv=1, seqlen_q=70, seqlen_k=331,
                            head_dim=head_dim, dtype=dtype, mask=mask, is_causal=causal)
                q, k, v, m = make_inputs(case, "cuda")
                out, lse = torch.ops.fusedattn.forward(q, k, v, m, causal, None)
                torch.ops.fusedattn.backward(torch.randn_like(out), q, k, v, out, lse, m, causal, None)
            # One query head per key head (no head split) and 400 queries: every
            # key block walks several steps, so the backward's Q/dO ring wraps and
            # its double-buffered dS is reused (the case above has one step per
            # block at d=64).
            for causal in (False, True):
                case = Case(batch=1, heads_q=2, heads_kv=2, seqlen_q=400, seqlen_k=390, head_dim=head_dim,
                            dtype=dtype, mask="none", is_causal=causal)
                q, k, v, _ = make_inputs(case, "cuda")
                out, lse = torch.ops.fusedattn.forward(q, k, v, None, causal, None)
                torch.ops.fusedattn.backward(torch.randn_like(out), q, k, v, out, lse, None, causal, None)

    # The wide head dims' forwards: sm90's 112- and 80-key tiles, soft-capped
    # too, and sm80's loader, which deals a 192 row's 24 chunks over its 128
    # threads; and sm90's wide backward at d=192 (the walk's ring wrapping,
    # with and without head splits).
    for head_dim in (192, 256):
        case = Case(batch=1, heads_q=2, heads_kv=1, seqlen_q=200, seqlen_k=331, head_dim=head_dim,
                    dtype=torch.float16, mask="none", is_causal=True)
        q, k, v, _ = make_inputs(case, "cuda")
        for family, softcap in (("auto", None), ("auto", 5.0), ("sm80", None)):
            torch.ops.fusedattn.forward(q, k, v, None, True, None, family, None, softcap)
        if head_dim == 192:
            for heads_q, heads_kv in ((2, 1), (2, 2)):
                case = Case(batch=1, heads_q=heads_q, heads_kv=heads_kv, seqlen_q=300, seqlen_k=231,
                            head_dim=head_dim, dtype=torch.bfloat16, mask="none", is_causal=False)
                q, k, v, _ = make_inputs(case, "cuda")
                out, lse = torch.ops.fusedattn.forward(q, k, v, None, False, None)
                torch.ops.fusedattn.backward(torch.randn_like(out), q, k, v, out, lse, None, False, None)

    deterministic_cases()

    # More query blocks than SMs (2 x 72 heads x 2 blocks = 288 items, 128 or
    # 192 query rows a block): the persistent sm90 forward's blocks (d=128, and
    # d=64 under causal) take several items each, and under causal with Nq > Nk
    # some items see no key (racecheck found a WAR on the item slot here,
    # 2026-11-30).
    for head_dim, causal, seqlen_k in ((128, False, 300), (128, True, 100), (64, True, 100), (64, True, 300)):
        case = Case(batch=2, heads_q=72, heads_kv=24, seqlen_q=256, seqlen_k=seqlen_k, head_dim=head_dim,
                    dtype=torch.float16, mask="none", is_causal=causal)
        q, k, v, _ = make_inputs(case, "cuda")
        torch.ops.fusedattn.forward(q, k, v, None, causal, None)


def kvcache_cases():
    # merge_in_cluster: True requires the splits to merge in clusters (sm_90;
    # these small grids fit), False merges through global memory.
    cluster = True if torch.cuda.get_device_capability() >= (9, 0) else None
    for head_dim, warps in ((32, None), (64, None), (128, None), (128, 4)):
        for splits, merge in ((1, None), (4, cluster), (4, False)):
            choices = {"num_splits": splits, "merge_in_cluster": merge, "warps": warps}
            for nq, n_new, heads, dtype in ((1, 1, (4, 4), torch.float16), (3, 3, (8, 2), torch.bfloat16),
                                            (2, 0, (6, 1), torch.float16)):
                args = [t if t is None else t.cuda()
                        for t in make_cache(B=3, Hq=heads[0], Hkv=heads[1], d=head_dim, max_len=333, nq=nq,
                                            n_new=n_new, dtype=dtype)]
                torch.ops.fusedattn.forward_kvcache(*args, True, None, **choices)
                args[3][1] = 400  # max_len is 333: does not fit: NaN for sequence 1, no append
                torch.ops.fusedattn.forward_kvcache(*args, False, None, **choices)


if "attention" in groups:
    attention_cases()
if "kvcache" in groups:
    kvcache_cases()
if "deterministic" in groups and "attention" not in groups:
    deterministic_cases()
torch.cuda.synchronize()
print(f"sanitizer cases ({', '.join(groups)}): done")
