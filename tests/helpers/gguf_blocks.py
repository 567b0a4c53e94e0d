"""GGUF block weights for tests: random blocks, a quantiser, and a dequantiser
written from the format's definition (ggml's block_q4_0, block_q4_1 and
block_q8_0: float16 scale d, for q4_1 a float16 minimum m, then the values;
4-bit values are the low nibbles of 16 bytes followed by their high nibbles).
Its products d * q are exact in float32; q4_1's d * q + m is rounded once to
float32, as gguf-py and ggml compute it."""

import torch

from fusedattn.gguf_blocks import BlockWeight

BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q8_0": 34}
FORMATS = tuple(BLOCK_BYTES)


def _halves(raw: torch.Tensor) -> torch.Tensor:
    """float16 fields [..., 2] as bytes -> float64 [...]."""
    return raw.contiguous().view(torch.float16)[..., 0].double()


def dequantize_reference(blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, BLOCK_BYTES[fmt])
    d = _halves(b[..., 0:2])[..., None]
    if fmt == "q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).double()
        return (d * q).reshape(n, -1)
    packed = b[..., 4:] if fmt == "q4_1" else b[..., 2:]
    q = torch.cat([packed & 0x0F, packed >> 4], dim=-1).double()
    if fmt == "q4_1":  # the sum rounds to float32
        values = ((d * q).float() + _halves(b[..., 2:4])[..., None].float()).double()
    else:
        values = d * (q - 8)
    return values.reshape(n, -1)


def random_blocks(n: int, k: int, fmt: str, generator: torch.Generator) -> torch.Tensor:
    """uint8 [n, k / 32 * block bytes]: random values, scales of either sign
    (minimums too), every scale and minimum finite."""
    blocks = torch.randint(0, 256, (n, k // 32, BLOCK_BYTES[fmt]), dtype=torch.uint8, generator=generator)
    fields = 2 if fmt == "q4_1" else 1
    scales = (torch.randn(n, k // 32, fields, generator=generator) * 0.05).half()
    blocks[..., : 2 * fields] = scales.view(torch.uint8).reshape(n, k // 32, 2 * fields)
    return blocks.reshape(n, -1)


def quantize(w: torch.Tensor, fmt: str) -> BlockWeight:
    """w [n, k] (k a multiple of 32) as blocks, rounding to the nearest level."""
    n, k = w.shape
    x = w.double().reshape(n, k // 32, 32)
    if fmt == "q8_0":
        d = (x.abs().amax(-1, keepdim=True) / 127).half()
        q = torch.where(d.double() == 0, 0, (x / d.double()).round()).clamp(-127, 127).to(torch.int8)
        blocks = torch.cat([d.view(torch.uint8).reshape(n, -1, 2), q.view(torch.uint8)], dim=-1)
    else:
        if fmt == "q4_1":
            low = x.amin(-1, keepdim=True)
            d = ((x.amax(-1, keepdim=True) - low) / 15).half()
        else:  # ggml's choice: the value of largest magnitude is level -8 exactly
            extreme = x.gather(-1, x.abs().argmax(-1, keepdim=True))
            d = (extreme / -8).half()
        safe = torch.where(d.double() == 0, 1.0, d.double())
        if fmt == "q4_1":
            m = low.half()
            q = ((x - m.double()) / safe).round().clamp(0, 15).to(torch.uint8)
            head = torch.cat([d.view(torch.uint8).reshape(n, -1, 2), m.view(torch.uint8).reshape(n, -1, 2)], -1)
        else:
            q = (x / safe + 8).round().clamp(0, 15).to(torch.uint8)
            head = d.view(torch.uint8).reshape(n, -1, 2)
        blocks = torch.cat([head, q[..., :16] | (q[..., 16:] << 4)], dim=-1)
    return BlockWeight(blocks.reshape(n, -1).contiguous(), fmt)
