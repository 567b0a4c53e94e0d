"""The engine on the CPU with a GGUF file's block formats kept against the same
model with its stacks of mixed formats (a fused Q|K|V of q5_0 and q8_0)
converted to float32, and with every matrix of another format than q8_0
converted: prefill and decode times, alternating the three, medians of --rounds.

    python lab/block_formats_speed.py [--model FILE.gguf] [--rounds 3] [--tokens 32]

The default model is Gemma-3-270M (q5_0, q4_K, q6_K and q8_0 blocks) and a
prompt of about 490 tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

from fusedattn.engine import Engine, gemma3_path
from fusedattn.gguf_blocks import BlockStack, BlockWeight

parser = argparse.ArgumentParser()
parser.add_argument("--model", default=None, help="a GGUF file (default: Gemma-3-270M)")
parser.add_argument("--rounds", type=int, default=3)
parser.add_argument("--tokens", type=int, default=32, help="decoding steps timed")
args = parser.parse_args()

engine = Engine.from_gguf(args.model or gemma3_path())
blocks = [dict(layer) for layer in engine.layers]
stacks_converted = [{name: w.dequantize() if isinstance(w, BlockStack) else w for name, w in layer.items()}
                    for layer in engine.layers]
converted = [{name: w.dequantize() if isinstance(w, BlockStack) or isinstance(w, BlockWeight) and w.format != "q8_0"
              else w for name, w in layer.items()} for layer in engine.layers]
prompt = engine.tokenizer.encode("Count with me: " + ", ".join(str(i) for i in range(1, 120)))
variants = {"blocks": blocks, "stacks in float32": stacks_converted, "float32": converted}
times = {name: ([], []) for name in variants}
for _ in range(args.rounds):
    for name, layers in variants.items():
        engine.layers = layers
        start = time.perf_counter()
        for step, _ in enumerate(engine.generate([prompt], args.tokens + 1)):
            if step == 0:
                first = time.perf_counter()
        times[name][0].append(first - start)
        times[name][1].append((time.perf_counter() - first) / args.tokens)
for name, (prefill, decode) in times.items():
    print(f"{name:17} prompt {len(prompt)} tokens: prefill {statistics.median(prefill) * 1e3:.0f} ms, "
          f"decode {statistics.median(decode) * 1e3:.1f} ms a token")
