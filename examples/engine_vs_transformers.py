"""Tokens/s of fusedattn's engine against transformers' generate (SDPA) on SmolLM2.

    python examples/engine_vs_transformers.py --batch 1,32 --prompt-tokens 512 --new-tokens 128 [--device cuda]

Both run in the engine's dtype (float32 on the CPU, float16 on CUDA), both
after a short warm-up run; the time covers prefill and decoding.
"""

import argparse
import os
import time

import torch
import transformers

from fusedattn.engine import Engine, smollm2_path

parser = argparse.ArgumentParser()
parser.add_argument("--batch", default="1", help="comma-separated batch sizes")
parser.add_argument("--prompt-tokens", type=int, default=512)
parser.add_argument("--new-tokens", type=int, default=128)
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
args = parser.parse_args()
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def tokens_per_second(generate, batch: int, new_tokens: int) -> float:
    if args.device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    made = generate(new_tokens)
    if args.device == "cuda":
        torch.cuda.synchronize()
    assert made == batch * new_tokens, (made, batch * new_tokens)
    return made / (time.perf_counter() - start)


engine = Engine.from_gguf(device=args.device)
path = smollm2_path()
model = transformers.AutoModelForCausalLM.from_pretrained(
    os.path.dirname(path), gguf_file=os.path.basename(path), attn_implementation="sdpa")
model = model.to(device=args.device, dtype=engine.dtype).eval()
text = "The history of attention in neural networks begins with alignment models for translation. " * 64
prompt = engine.tokenizer.encode(text)[: args.prompt_tokens]

for batch in (int(b) for b in args.batch.split(",")):
    prompts = [prompt] * batch
    ids = torch.tensor(prompts, device=args.device)

    def ours(n):
        return batch * sum(1 for _ in engine.generate(prompts, n, stop_tokens=set()))

    def theirs(n):
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=engine.tokenizer.eos_token_id)
        return batch * (out.shape[1] - ids.shape[1])

    for f in (ours, theirs):  # warm-up: CUDA context, cuBLAS handles, kernel caches
        tokens_per_second(f, batch, 4)
    a = tokens_per_second(ours, batch, args.new_tokens)
    b = tokens_per_second(theirs, batch, args.new_tokens)
    print(f"{args.device} {engine.dtype}, batch {batch}, {len(prompt)}-token prompt, {args.new_tokens} new tokens "
          f"(prefill included): fusedattn engine {a:.1f} tokens/s, transformers generate (sdpa) {b:.1f} "
          f"tokens/s, ratio {a / b:.2f}", flush=True)
