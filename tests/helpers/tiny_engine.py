"""A small decoder with random weights (no model file, no tokenizer) for the
engine's batching tests: llama-shaped, or with Gemma 3's sliding-window layers."""

import torch

from fusedattn.engine import Engine
from fusedattn.gguf_blocks import stack_blocks
from fusedattn.gguf_models import ModelConfig
from helpers.gguf_blocks import quantize


def tiny_engine(sliding_window: int = 0, context: int = 2048, seed: int = 0, head_dim: int = 16,
                device: str = "cpu", blocks: str | None = None, value_blocks: str | None = None) -> Engine:
    """2 layers (the first sliding where sliding_window > 0), 4 query and 2 KV
    heads of head_dim, a 256-token vocabulary; float32 on the CPU, the engine's
    default dtype elsewhere. The weights do not depend on the device. blocks:
    the matrices (the embedding too) quantised to that GGUF format; value_blocks
    (with blocks): Q|K|V's V rows in this other one (a BlockStack, as Gemma 3's
    file has it)."""
    config = ModelConfig(arch="gemma3" if sliding_window else "llama", layers=2, hidden=64, ffn=96, heads=4,
                         kv_heads=2, head_dim=head_dim, vocab=256, rope_base=10000.0, norm_eps=1e-6, context=context,
                         sliding_window=sliding_window, global_every=2 if sliding_window else 0,
                         local_rope_base=10000.0 if sliding_window else 0.0)
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    c = config
    weights = {"embed": rand(c.vocab, c.hidden, scale=1.0), "output_norm": 1 + rand(c.hidden, scale=0.1)}
    for i in range(c.layers):
        b = f"blk.{i}"
        weights.update({
            f"{b}.attn_norm": 1 + rand(c.hidden, scale=0.1), f"{b}.ffn_norm": 1 + rand(c.hidden, scale=0.1),
            f"{b}.qkv": rand((c.heads + 2 * c.kv_heads) * c.head_dim, c.hidden),
            f"{b}.out": rand(c.hidden, c.heads * c.head_dim), f"{b}.gate_up": rand(2 * c.ffn, c.hidden),
            f"{b}.down": rand(c.hidden, c.ffn)})
    qk_rows = (c.heads + c.kv_heads) * c.head_dim

    def quantized(name, w):
        if w.dim() != 2:
            return w
        if value_blocks and name.endswith(".qkv"):  # Q's and K's rows in `blocks`, V's in `value_blocks`
            return stack_blocks([quantize(w[:qk_rows], blocks), quantize(w[qk_rows:], value_blocks)])
        return quantize(w, blocks)

    if blocks:
        weights = {name: quantized(name, w) for name, w in weights.items()}
    return Engine(config, weights, device=device)
