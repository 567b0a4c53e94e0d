"""Training through fusedattn follows training through PyTorch's SDPA from the same seed."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusedattn


class TinyAttentionLM(nn.Module):
    def __init__(self, attend, vocab=32, width=64, heads=2):
        super().__init__()
        self.attend, self.heads = attend, heads
        self.embed = nn.Embedding(vocab, width)
        self.qkv, self.out, self.head = nn.Linear(width, 3 * width), nn.Linear(width, width), nn.Linear(width, vocab)

    def forward(self, ids):
        b, n = ids.shape
        x = self.embed(ids)
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        dtype = torch.bfloat16 if x.is_cuda else x.dtype  # the CUDA kernels take 16-bit inputs
        attn = self.attend(q.to(dtype), k.to(dtype), v.to(dtype)).to(x.dtype)
        return self.head(x + self.out(attn.transpose(1, 2).reshape(b, n, -1)))


def losses(attend, device, steps=25):
    torch.manual_seed(0)
    model = TinyAttentionLM(attend).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, 32, (4, 97), generator=data).to(device)
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        out.append(loss.item())
    return torch.tensor(out)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_training_follows_sdpa(device):
    fused = losses(lambda q, k, v: fusedattn.attention(q, k, v, is_causal=True), device)
    sdpa = losses(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), device)
    assert fused[-1] < fused[0]  # it learns
    # float32 on the CPU: the same curve; bfloat16 attention on CUDA: close.
    tol = 1e-4 if device == "cpu" else 3e-2
    torch.testing.assert_close(fused, sdpa, atol=tol, rtol=tol)
