"""Swap every nn.MultiheadAttention of an existing model for fusedattn's, in place.

    python examples/swap_attention.py

The stock model and its swapped copy are timed fairly: both warm up first,
then their timed calls alternate (which goes first alternates too), and each
reports the median of its calls.
"""

import copy
import statistics
import time

import torch

from fusedattn.nn import swap_attention

WARMUP, REPEATS = 2, 7

torch.manual_seed(0)
stock = torch.nn.Transformer(d_model=256, nhead=8, num_encoder_layers=3, num_decoder_layers=3,
                             dim_feedforward=1024, dropout=0.0, batch_first=True).eval()
fused = swap_attention(copy.deepcopy(stock))  # same weights, fused attention inside
src, tgt = torch.randn(4, 1024, 256), torch.randn(4, 512, 256)
tgt_mask = torch.nn.Transformer.generate_square_subsequent_mask(512)


def run(model) -> tuple[torch.Tensor, float]:
    with torch.no_grad():
        start = time.perf_counter()
        out = model(src, tgt, tgt_mask=tgt_mask, tgt_is_causal=True)
        return out, time.perf_counter() - start


models = {"stock": stock, "fusedattn": fused}
outputs = {name: run(model)[0] for name, model in models.items()}
for _ in range(WARMUP - 1):
    for model in models.values():
        run(model)
times = {name: [] for name in models}
for r in range(REPEATS):
    for name in list(models)[:: 1 if r % 2 == 0 else -1]:  # neither always runs first
        times[name].append(run(models[name])[1])
median = {name: statistics.median(t) for name, t in times.items()}

print(f"max |fused - stock| = {(outputs['fusedattn'] - outputs['stock']).abs().max():.2e}")
print(f"time (median of {REPEATS} after {WARMUP} warm-up calls): stock {median['stock'] * 1e3:.0f} ms, "
      f"fusedattn {median['fusedattn'] * 1e3:.0f} ms, speed-up {median['stock'] / median['fusedattn']:.2f}x")
