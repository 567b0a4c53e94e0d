"""GGUF block weights for tests: random blocks, a quantiser, and a dequantiser
written from the formats' definitions (ggml's block_q4_0 ... block_q6_K):

- q4_0, q4_1, q5_0, q8_0: blocks of 32 values, a float16 scale d (q4_1 also a
  float16 minimum m); 4-bit values are the low nibbles of 16 bytes followed by
  their high nibbles, q5_0's fifth bit of value i bit i of a 32-bit word.
- q4_K, q5_K: super-blocks of 256 values, float16 d and dmin, 12 bytes packing
  a 6-bit scale and minimum per sub-block j of 32 (j < 4: the low 6 bits of
  bytes j and j + 4; j >= 4: the low and high nibbles of byte j + 4 below the
  top 2 bits of bytes j - 4 and j), then (q5_K) 32 bytes whose bit j is
  sub-block j's fifth bit and 128 bytes of nibbles, sub-blocks 2i and 2i + 1
  the low and high nibbles of bytes 32i .. 32i + 31; value (d * scale) * q - dmin * min.
- q6_K: super-blocks of 256: 128 bytes of low nibbles, 64 of 2-bit high parts,
  16 signed 8-bit scales (one per 16 values), float16 d; value (d * scale) * (q - 32).

Every product is exact in float64 and in float32; where gguf-py and ggml
round (q4_1's sum, q4_K's and q5_K's difference), the reference rounds the
exact value to float32 once, as one float32 operation does."""

import torch

from fusedattn.gguf_blocks import BlockWeight

# format -> (bytes per block, values per block)
BLOCKS = {"q4_0": (18, 32), "q4_1": (20, 32), "q5_0": (22, 32), "q8_0": (34, 32),
          "q4_K": (144, 256), "q5_K": (176, 256), "q6_K": (210, 256)}
FORMATS = tuple(BLOCKS)
QUANTIZER_FORMATS = ("q4_0", "q4_1", "q8_0")  # those quantize() writes
# Byte offsets of each format's float16 fields (scales, minimums).
HALF_FIELDS = {"q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q8_0": (0,), "q4_K": (0, 2), "q5_K": (0, 2),
                "q6_K": (208,)}


def _halves(raw: torch.Tensor) -> torch.Tensor:
    """float16 fields [..., 2] as bytes -> float64 [...]."""
    return raw.contiguous().view(torch.float16)[..., 0].double()


def _to_float32(x: torch.Tensor) -> torch.Tensor:
    return x.float().double()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n]: the low nibbles, then the high ones."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., 12] -> the 8 sub-blocks' 6-bit scales and minimums, [..., 8] each."""
    d, m, md = packed[..., 0:4].long(), packed[..., 4:8].long(), packed[..., 8:12].long()
    scale = torch.cat([d & 63, (md & 0x0F) | ((d >> 6) << 4)], dim=-1)
    minimum = torch.cat([m & 63, (md >> 4) | ((m >> 6) << 4)], dim=-1)
    return scale, minimum


def _dequantize_blocks(b: torch.Tensor, fmt: str) -> torch.Tensor:
    """b [..., block bytes] -> float64 [..., block values]."""
    if fmt == "q8_0":
        return _halves(b[..., 0:2])[..., None] * b[..., 2:].contiguous().view(torch.int8).double()
    if fmt in ("q4_0", "q4_1"):
        d = _halves(b[..., 0:2])[..., None]
        if fmt == "q4_0":
            return d * (_nibbles(b[..., 2:]).double() - 8)
        return _to_float32(d * _nibbles(b[..., 4:]).double() + _halves(b[..., 2:4])[..., None])
    if fmt == "q5_0":
        high = b[..., 2:6].contiguous().view(torch.int32)  # [..., 1], little-endian
        fifth = (high >> torch.arange(32)) & 1
        return _halves(b[..., 0:2])[..., None] * ((_nibbles(b[..., 6:]).long() | (fifth << 4)) - 16).double()
    if fmt in ("q4_K", "q5_K"):
        d, dmin = _halves(b[..., 0:2])[..., None], _halves(b[..., 2:4])[..., None]
        scale, minimum = _k_scales(b[..., 4:16])
        nibbles = b[..., -128:].reshape(*b.shape[:-1], 4, 32)
        q = torch.stack([nibbles & 0x0F, nibbles >> 4], dim=-2).reshape(*b.shape[:-1], 8, 32).long()
        if fmt == "q5_K":
            high = b[..., 16:48].long()  # bit j: sub-block j's fifth bit
            q = q | (((high[..., None, :] >> torch.arange(8)[:, None]) & 1) << 4)
        values = (d * scale)[..., None] * q - (dmin * minimum)[..., None]
        return _to_float32(values).reshape(*b.shape[:-1], 256)
    assert fmt == "q6_K", fmt
    low = b[..., 0:128].reshape(*b.shape[:-1], 2, 2, 32)  # [half, bytes 0-31 or 32-63 of it, 32]
    low = torch.stack([low[..., 0, :] & 0x0F, low[..., 1, :] & 0x0F, low[..., 0, :] >> 4, low[..., 1, :] >> 4], -2)
    low = low.reshape(*b.shape[:-1], 2, 4, 32)  # runs of 32 in value order
    high = b[..., 128:192].reshape(*b.shape[:-1], 2, 1, 32).long() >> (2 * torch.arange(4))[:, None]
    q = (low.long() | ((high & 3) << 4)) - 32
    scales = b[..., 192:208].contiguous().view(torch.int8).double()
    d = _halves(b[..., 208:210])[..., None]
    return _to_float32((d * scales).repeat_interleave(16, dim=-1) * q.reshape(*b.shape[:-1], 256))


def dequantize_reference(blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """blocks uint8 [n, row bytes] -> float64 [n, k]."""
    n = blocks.shape[0]
    return _dequantize_blocks(blocks.reshape(n, -1, BLOCKS[fmt][0]), fmt).reshape(n, -1)


def random_blocks(n: int, k: int, fmt: str, generator: torch.Generator) -> torch.Tensor:
    """uint8 [n, k / block values * block bytes]: random values, scales of
    either sign (minimums too), every float16 field finite."""
    size, values = BLOCKS[fmt]
    blocks = torch.randint(0, 256, (n, k // values, size), dtype=torch.uint8, generator=generator)
    for offset in HALF_FIELDS[fmt]:
        scale = (torch.randn(n, k // values, 1, generator=generator) * 0.05).half()
        blocks[..., offset:offset + 2] = scale.view(torch.uint8)
    return blocks.reshape(n, -1)


def quantize(w: torch.Tensor, fmt: str) -> BlockWeight:
    """w [n, k] (k a multiple of 32) as blocks of a QUANTIZER_FORMATS format,
    rounding to the nearest level."""
    assert fmt in QUANTIZER_FORMATS, fmt
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
