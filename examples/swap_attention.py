"""Swap every nn.MultiheadAttention of an existing model for fusedattn's, in place.

    python examples/swap_attention.py
"""

import time

import torch

from fusedattn.nn import swap_attention

torch.manual_seed(0)
model = torch.nn.Transformer(d_model=256, nhead=8, num_encoder_layers=3, num_decoder_layers=3,
                             dim_feedforward=1024, dropout=0.0, batch_first=True).eval()
src, tgt = torch.randn(4, 1024, 256), torch.randn(4, 512, 256)
tgt_mask = torch.nn.Transformer.generate_square_subsequent_mask(512)


def run():
    with torch.no_grad():
        start = time.perf_counter()
        out = model(src, tgt, tgt_mask=tgt_mask, tgt_is_causal=True)
        return out, time.perf_counter() - start


stock, t_stock = run()
swap_attention(model)  # same module objects and weights, fused attention inside
fused, t_fused = run()
print(f"max |fused - stock| = {(fused - stock).abs().max():.2e}")
print(f"time: stock {t_stock * 1e3:.0f} ms, fusedattn {t_fused * 1e3:.0f} ms")
