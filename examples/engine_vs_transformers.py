"""Tokens/s of fusedattn's engine against transformers' generate (SDPA) on SmolLM2.

    python examples/engine_vs_transformers.py --batch 1 --prompt-tokens 512 --new-tokens 128 [--device cuda]
"""

import argparse
import os
import time

import torch
import transformers

from fusedattn.engine import Engine, smollm2_path

parser = argparse.ArgumentParser()
parser.add_argument("--batch", type=int, default=1)
parser.add_argument("--prompt-tokens", type=int, default=512)
parser.add_argument("--new-tokens", type=int, default=128)
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
args = parser.parse_args()
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def sync():
    if args.device == "cuda":
        torch.cuda.synchronize()


engine = Engine.from_gguf(device=args.device)
text = "The history of attention in neural networks begins with alignment models for translation. " * 64
prompt = engine.tokenizer.encode(text)[: args.prompt_tokens]
prompts = [prompt] * args.batch

sync()
start = time.perf_counter()
steps = sum(1 for _ in engine.generate(prompts, args.new_tokens, stop_tokens=set()))
sync()
ours = args.batch * steps / (time.perf_counter() - start)

path = smollm2_path()
model = transformers.AutoModelForCausalLM.from_pretrained(
    os.path.dirname(path), gguf_file=os.path.basename(path), attn_implementation="sdpa")
model = model.to(args.device).eval()
ids = torch.tensor(prompts, device=args.device)
with torch.no_grad():
    sync()
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                         min_new_tokens=args.new_tokens, do_sample=False,
                         pad_token_id=engine.tokenizer.eos_token_id)
    sync()
    theirs = args.batch * (out.shape[1] - ids.shape[1]) / (time.perf_counter() - start)

print(f"{args.device}, batch {args.batch}, {args.prompt_tokens}-token prompt, {args.new_tokens} new tokens "
      f"(prefill included): fusedattn engine {ours:.1f} tokens/s, transformers generate (sdpa) "
      f"{theirs:.1f} tokens/s, ratio {ours / theirs:.2f}")
