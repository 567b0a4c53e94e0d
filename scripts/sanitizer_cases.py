"""Small CUDA forward calls for compute-sanitizer (memcheck, racecheck):
every head dim, dtype, mask kind, causal, and sizes that end mid-tile.
Run: compute-sanitizer --tool memcheck python3 scripts/sanitizer_cases.py"""

import sys

import torch

sys.path.insert(0, "tests")
import fusedattn  # noqa: E402,F401
from attention_cases import Case, make_inputs  # noqa: E402

for head_dim in (32, 64, 128):
    for dtype in (torch.float16, torch.bfloat16):
        for mask, causal in (("none", False), ("none", True), ("bool", True), ("additive", False),
                             ("key_block_holes", True)):
            case = Case(batch=1, heads_q=2, heads_kv=1, seqlen_q=70, seqlen_k=331,
                        head_dim=head_dim, dtype=dtype, mask=mask, is_causal=causal)
            q, k, v, m = make_inputs(case, "cuda")
            torch.ops.fusedattn.forward(q, k, v, m, causal, None)
torch.cuda.synchronize()
print("sanitizer cases: done")
