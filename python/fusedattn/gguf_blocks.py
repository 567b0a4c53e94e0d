"""Weights kept as a GGUF file stores them (blocks of 32 quantised values, or
the k-quants' super-blocks of 256, and their scales), for the engine on the
CPU: SmolLM2's 98 MB file stays 98 MB in memory instead of 540 MB of float32,
and a decoding step reads that much less.
The products run in float32 on the values gguf-py's dequantisation gives
(``torch.ops.fusedattn.block_linear``, ``block_dequantize``)."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

__all__ = ["FORMATS", "BlockStack", "BlockWeight", "stack_blocks"]

# GGUF tensor type name -> (the operators' format, bytes per block, values per block)
FORMATS = {"Q4_0": ("q4_0", 18, 32), "Q4_1": ("q4_1", 20, 32), "Q5_0": ("q5_0", 22, 32), "Q8_0": ("q8_0", 34, 32),
           "Q4_K": ("q4_K", 144, 256), "Q5_K": ("q5_K", 176, 256), "Q6_K": ("q6_K", 210, 256)}
_BLOCKS = {fmt: (size, values) for fmt, size, values in FORMATS.values()}


@dataclasses.dataclass(frozen=True)
class BlockWeight:
    """A weight [out_features, in_features] as rows of blocks: uint8 [out_features, row bytes]."""

    blocks: Tensor
    format: str  # one of the operators' formats in FORMATS

    def __post_init__(self):
        _check_blocks("BlockWeight", self.blocks, self.format)

    @property
    def shape(self) -> torch.Size:
        size, values = _BLOCKS[self.format]
        return torch.Size([self.blocks.shape[0], self.blocks.shape[1] // size * values])

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def dequantize(self) -> Tensor:
        return torch.ops.fusedattn.block_dequantize(self.blocks, self.format)

    def rows(self, ids: Tensor) -> Tensor:
        """Rows ids of the weight in float32 (an embedding lookup): [*ids.shape, in_features]."""
        picked = torch.ops.fusedattn.block_dequantize(self.blocks[ids.reshape(-1)], self.format)
        return picked.view(*ids.shape, -1)

    def linear(self, x: Tensor) -> Tensor:
        """x [..., in_features] float32 times the weight's transpose."""
        return torch.ops.fusedattn.block_linear(x, self.blocks, self.format)


@dataclasses.dataclass(frozen=True)
class BlockStack:
    """Weights of different block formats with their rows stacked (Gemma's
    Q|K|V: q5_0 Q and K, q8_0 V): [sum of the parts' rows, in_features]; each
    part keeps its blocks and its own product."""

    parts: tuple[BlockWeight, ...]

    def __post_init__(self):
        lengths = [p.shape[1] for p in self.parts]
        if len(set(lengths)) != 1:
            raise ValueError(f"BlockStack: the parts' rows must be equally long, got {lengths}")

    @property
    def shape(self) -> torch.Size:
        return torch.Size([sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]])

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def formats(self) -> tuple[str, ...]:
        return tuple(p.format for p in self.parts)

    def dequantize(self) -> Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def linear(self, x: Tensor) -> Tensor:
        """x [..., in_features] float32 times the stack's transpose: the parts' products side by side."""
        return torch.cat([p.linear(x) for p in self.parts], dim=-1)


def stack_blocks(parts: list[BlockWeight]) -> BlockWeight | BlockStack:
    """The parts' rows in one weight: one BlockWeight where they share a
    format, else a BlockStack of runs of equal formats."""
    runs: list[list[BlockWeight]] = []
    for p in parts:
        if runs and runs[-1][0].format == p.format:
            runs[-1].append(p)
        else:
            runs.append([p])
    merged = [BlockWeight(torch.cat([p.blocks for p in run]), run[0].format) if len(run) > 1 else run[0]
              for run in runs]
    return merged[0] if len(merged) == 1 else BlockStack(tuple(merged))


def _check_blocks(op: str, blocks: Tensor, format: str) -> int:
    """The values per row of blocks; raises ValueError as the operators' checks do."""
    if format not in _BLOCKS:
        raise ValueError(f"{op}: format must be one of {', '.join(_BLOCKS)}, got {format!r}")
    size, values = _BLOCKS[format]
    if blocks.dtype != torch.uint8 or blocks.dim() != 2:
        raise ValueError(f"{op}: blocks must be a 2-D uint8 tensor [rows, row bytes], got {blocks.dtype} "
                         f"{list(blocks.shape)}")
    if blocks.shape[1] == 0 or blocks.shape[1] % size:
        raise ValueError(f"{op}: a row of blocks must be a positive multiple of {size} bytes, got {blocks.shape[1]}")
    return blocks.shape[1] // size * values


@torch.library.register_fake("fusedattn::block_linear")
def _block_linear_fake(x, blocks, format):
    k = _check_blocks("block_linear", blocks, format)
    if x.shape[-1] != k:
        raise ValueError(f"block_linear: x must be [..., {k}] (the blocks' row length), got {list(x.shape)}")
    return x.new_empty(*x.shape[:-1], blocks.shape[0])


@torch.library.register_fake("fusedattn::block_dequantize")
def _block_dequantize_fake(blocks, format):
    return blocks.new_empty(blocks.shape[0], _check_blocks("block_dequantize", blocks, format), dtype=torch.float32)
