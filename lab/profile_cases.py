"""One forward and one backward call of fusedattn for a profiler, after a
warm-up: B=4, H=32, d=128, N=4096, float16 (the seed table's middle; --batch,
--heads, --seqlen, --head-dim change it), causal with --causal, under a dense
mask with --mask (lab/mask_cases.py's kinds); --forward-only leaves out the
backward, --sdpa-cudnn times SDPA's cuDNN forward instead. With --decode
instead one forward_kvcache call (the decode bench's shape: B=8, Hq=32,
Hkv=--kv-heads, d=128, float16, a cache of --seqlen keys, all full or, with
--varlen, the bench's per-sequence lengths)
after a warm-up one; with --decode --sdpa-cudnn the same shape through SDPA's
cuDNN backend (q of 1 token against the whole cache: what its kernels do at
the decode table's row). The planner chooses unless told: --family sm80|sm90
forces the forward's and backward's kernel family, --num-splits,
--merge-in-cluster yes|no and --warps 4|8 the decode kernel's (the operators'
family, num_splits, merge_in_cluster and warps arguments); --deterministic
runs the calls under torch.use_deterministic_algorithms(True). Run under ncu,
e.g. lab/gpu_check.sh's profile and profile_decode stages."""

import argparse

import torch

import fusedattn  # noqa: F401  (registers the operators)
from fusedattn.bench import _sdpa_backend
from fusedattn.bench_decode import DecodeConfig, cache_lengths
from mask_cases import KINDS_HELP, dense_mask

parser = argparse.ArgumentParser()
parser.add_argument("--causal", action="store_true")
parser.add_argument("--seqlen", type=int, default=4096)
parser.add_argument("--head-dim", type=int, default=128)
parser.add_argument("--decode", action="store_true")
parser.add_argument("--kv-heads", type=int, default=32, help="--decode: key/value heads (8: GQA 32/8)")
parser.add_argument("--varlen", action="store_true", help="--decode: the bench's per-sequence lengths in [1, N]")
parser.add_argument("--sdpa-cudnn", action="store_true", help="SDPA's cuDNN backend instead (forward only)")
parser.add_argument("--forward-only", action="store_true")
parser.add_argument("--mask", help="attn_mask: " + KINDS_HELP)
parser.add_argument("--batch", type=int, default=4)
parser.add_argument("--heads", type=int, default=32)
parser.add_argument("--family", choices=["sm80", "sm90"], help="the forward's and backward's kernel family")
parser.add_argument("--num-splits", type=int, dest="num_splits", help="--decode: splits of each sequence's keys")
parser.add_argument("--merge-in-cluster", choices=["yes", "no"], dest="merge_in_cluster",
                    help="--decode: merge the splits in thread block clusters (yes: required) or never")
parser.add_argument("--warps", type=int, choices=[4, 8], help="--decode: warps per decode block")
parser.add_argument("--deterministic", action="store_true", help="under torch.use_deterministic_algorithms(True)")
args = parser.parse_args()
torch.use_deterministic_algorithms(args.deterministic)  # the process's whole life: one call pair
merge_in_cluster = None if args.merge_in_cluster is None else args.merge_in_cluster == "yes"
sdpa_cudnn = _sdpa_backend("cudnn")  # f(q, k, v, causal)

if args.decode:
    cfg = DecodeConfig(torch.device("cuda"), kv_heads=args.kv_heads, head_dim=args.head_dim)
    q = torch.randn(cfg.batch, cfg.heads, 1, cfg.head_dim, device="cuda", dtype=torch.float16)
    k_cache, v_cache = (torch.randn(cfg.batch, cfg.kv_heads, args.seqlen, cfg.head_dim, device="cuda",
                                    dtype=torch.float16) for _ in range(2))
    lengths = cache_lengths(cfg, args.seqlen, args.varlen).cuda()
    for _ in range(2):
        if args.sdpa_cudnn:
            sdpa_cudnn(q, k_cache, v_cache, False)
        else:
            torch.ops.fusedattn.forward_kvcache(q, k_cache, v_cache, lengths, None, None, True, None,
                                                args.num_splits, merge_in_cluster, args.warps)
    torch.cuda.synchronize()
    raise SystemExit(0)

shape = (args.batch, args.heads, args.seqlen, args.head_dim)
mask = None if args.mask is None else dense_mask(args.mask, args.batch, args.seqlen, "cuda")
q, k, v, grad = (torch.randn(shape, device="cuda", dtype=torch.float16) for _ in range(4))
# A warm-up pair, then the profiled pair (gpu_check.sh skips the first two launches).
for _ in range(2):
    if args.sdpa_cudnn:
        sdpa_cudnn(q, k, v, args.causal)
        continue
    out, lse = torch.ops.fusedattn.forward(q, k, v, mask, args.causal, None, args.family)
    if not args.forward_only:
        torch.ops.fusedattn.backward(grad, q, k, v, out, lse, mask, args.causal, None, args.family)
torch.cuda.synchronize()
