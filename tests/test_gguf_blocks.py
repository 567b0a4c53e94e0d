"""The CPU operators over GGUF blocks (fusedattn.gguf_blocks): exact
dequantisation, products within float32's error bound, rows that do not depend
on the rows beside them, and clear errors."""

import pytest
import torch

from fusedattn.gguf_blocks import BlockStack, BlockWeight, stack_blocks
from helpers.gguf_blocks import (BLOCKS, FORMATS, HALF_FIELDS, QUANTIZER_FORMATS, dequantize_reference, quantize,
                                 random_blocks)


def values(fmt: str, blocks: int) -> int:
    """The values in a row of that many blocks of fmt."""
    return blocks * BLOCKS[fmt][1]


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_is_exact(fmt):
    g = torch.Generator().manual_seed(0)
    k = values(fmt, 3)
    blocks = random_blocks(70, k, fmt, g)
    got = BlockWeight(blocks, fmt).dequantize()
    assert got.dtype == torch.float32 and got.shape == (70, k)
    assert torch.equal(got.double(), dequantize_reference(blocks, fmt))


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_float16_scale_dequantizes_as_gguf_pys(fmt):
    """Scales and minimums over all 65536 float16 bit patterns (subnormals, 65504, infinities,
    NaN) give gguf-py's values bit for bit, NaN where it has NaN."""
    gguf = pytest.importorskip("gguf")
    g = torch.Generator().manual_seed(8)
    size, values = BLOCKS[fmt]
    blocks = random_blocks(1024, 64 * values, fmt, g).reshape(-1, size)  # 65536 blocks
    patterns = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.uint8).reshape(-1, 2)
    for offset in HALF_FIELDS[fmt]:
        blocks[:, offset:offset + 2] = patterns[torch.randperm(65536, generator=g)]
    blocks = blocks.reshape(1024, -1)
    ours = BlockWeight(blocks, fmt).dequantize()
    theirs = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType[fmt.upper()]))
    assert torch.equal(ours.isnan(), theirs.isnan())
    assert torch.equal(ours.nan_to_num(0.0).view(torch.int32), theirs.nan_to_num(0.0).view(torch.int32))


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_is_gguf_pys(fmt):
    """Bit for bit what gguf-py (the models extra) makes of the same bytes."""
    gguf = pytest.importorskip("gguf")
    g = torch.Generator().manual_seed(7)
    blocks = random_blocks(9, values(fmt, 4), fmt, g)
    theirs = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType[fmt.upper()])
    assert torch.equal(BlockWeight(blocks, fmt).dequantize(), torch.from_numpy(theirs))


def test_dequantize_keeps_float16_subnormals_infinities_and_nan():
    scales = torch.tensor([2.0**-24, -(2.0**-20), 65504.0, float("inf"), float("nan")]).half()
    blocks = torch.zeros(5, 34, dtype=torch.uint8)
    blocks[:, :2] = scales.view(torch.uint8).reshape(5, 2)
    blocks[:, 2:] = 3  # every value q = 3
    got = BlockWeight(blocks, "q8_0").dequantize()[:, 0]
    assert torch.equal(got[:4], scales[:4].float() * 3) and got[4].isnan()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 5, 8, 67])
def test_linear_is_within_float32s_error_bound(fmt, rows):
    g = torch.Generator().manual_seed(rows)
    k = values(fmt, 5)
    blocks = random_blocks(130, k, fmt, g)  # 130 outputs: two full tiles of 64 and a partial one
    x = torch.randn(3, rows, k, generator=g)
    got = BlockWeight(blocks, fmt).linear(x)
    w = dequantize_reference(blocks, fmt)
    exact = x.double() @ w.T
    # |fl(x . w) - x . w| <= k u |x| . |w| for any order of summation (u = 2^-24).
    bound = k * 2.0**-24 * (x.double().abs() @ w.abs().T)
    assert got.shape == (3, rows, 130) and got.dtype == torch.float32
    assert ((got.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("k", [512, 1536])
def test_a_rows_product_does_not_depend_on_the_rows_beside_it(fmt, k):
    """Among rows padded to a multiple of 8 (the engine's _linear pads so; oneDNN's
    GEMM needs no padding, other BLAS do), across the kernel's slices of 256 rows."""
    g = torch.Generator().manual_seed(1)
    weight = BlockWeight(random_blocks(200, k, fmt, g), fmt)
    x = torch.randn(600, k, generator=g)
    padded = torch.zeros(8, k)
    alone = []
    for i in range(0, 600, 7):
        padded[0] = x[i]
        alone.append(weight.linear(padded)[0])
    for rows in (8, 16, 32, 40, 256, 264, 600):
        product = weight.linear(x[:rows])
        for j, i in enumerate(range(0, rows, 7)):
            assert torch.equal(product[i], alone[j]), (rows, i)


def test_rows_are_an_embedding_lookup():
    g = torch.Generator().manual_seed(2)
    weight = BlockWeight(random_blocks(50, 64, "q8_0", g), "q8_0")
    ids = torch.tensor([[3, 49, 3], [0, 7, 11]])
    assert torch.equal(weight.rows(ids), weight.dequantize()[ids])


@pytest.mark.parametrize("fmt", QUANTIZER_FORMATS)
def test_quantised_weights_are_near_the_original(fmt):
    """The tests' quantiser (it builds the engine's block models) rounds to the nearest level."""
    w = torch.randn(40, 64, generator=torch.Generator().manual_seed(3))
    weight = quantize(w, fmt)
    error = (weight.dequantize() - w).abs().reshape(40, 2, 32).amax(-1)
    d = weight.blocks.reshape(40, 2, -1)[..., :2].contiguous().view(torch.float16)[..., 0].float().abs()
    # Half a level (q4_0's levels -8..7 stop a level short on one side), and float16's rounding.
    assert (error <= (1.01 if fmt == "q4_0" else 0.51) * d + 1e-3).all()


def test_stacked_rows_keep_their_blocks_of_every_format():
    """Equal formats stack into one BlockWeight; a run of another format makes a
    BlockStack whose product and values are the parts' side by side, each part's
    bits those of its own product."""
    g = torch.Generator().manual_seed(4)
    a, b = (BlockWeight(random_blocks(n, 64, "q4_1", g), "q4_1") for n in (3, 5))
    c = BlockWeight(random_blocks(2, 64, "q8_0", g), "q8_0")
    stacked = stack_blocks([a, b])
    assert isinstance(stacked, BlockWeight) and stacked.format == "q4_1"
    assert torch.equal(stacked.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    mixed = stack_blocks([a, b, c])
    assert isinstance(mixed, BlockStack) and mixed.formats == ("q4_1", "q8_0")
    assert mixed.shape == (10, 64) and mixed.nbytes == a.nbytes + b.nbytes + c.nbytes
    assert torch.equal(mixed.dequantize(), torch.cat([a.dequantize(), b.dequantize(), c.dequantize()]))
    x = torch.randn(3, 64, generator=g)
    assert torch.equal(mixed.linear(x), torch.cat([stacked.linear(x), c.linear(x)], dim=-1))
    torch.testing.assert_close(mixed.linear(x), x @ mixed.dequantize().T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"the parts' rows must be equally long, got \[64, 32\]"):
        BlockStack((a, BlockWeight(random_blocks(2, 32, "q8_0", g), "q8_0")))


def test_bad_arguments_are_refused():
    g = torch.Generator().manual_seed(5)
    blocks = random_blocks(4, 64, "q4_1", g)
    with pytest.raises(ValueError, match=r"blocks must be a 2-D uint8 tensor \[rows, row bytes\], got torch.float32"):
        BlockWeight(blocks.float(), "q4_1")
    with pytest.raises(ValueError, match="a row of blocks must be a positive multiple of 20 bytes, got 30"):
        BlockWeight(blocks[:, :30], "q4_1")
    with pytest.raises(ValueError, match="format must be one of q4_0, q4_1, q5_0, q8_0, q4_K, q5_K, q6_K, got 'q5_k'"):
        BlockWeight(random_blocks(4, 256, "q5_K", g), "q5_k")
    with pytest.raises(ValueError, match="a row of blocks must be a positive multiple of 210 bytes, got 144"):
        BlockWeight(random_blocks(4, 256, "q4_K", g), "q6_K")
    with pytest.raises(RuntimeError, match="format must be one of q4_0, q4_1, q5_0, q8_0, q4_K, q5_K, q6_K, got 'q2'"):
        torch.ops.fusedattn.block_dequantize(blocks, "q2")
    with pytest.raises(RuntimeError, match="a row of blocks must be a positive multiple of 20 bytes, got 39"):
        torch.ops.fusedattn.block_dequantize(blocks[:, :39], "q4_1")
    with pytest.raises(RuntimeError, match=r"blocks must be a 2-D uint8 CPU tensor"):
        torch.ops.fusedattn.block_linear(torch.randn(2, 64), blocks.float(), "q4_1")
    with pytest.raises(RuntimeError, match=r"x must be a float32 CPU tensor \[\.\.\., 64\]"):
        torch.ops.fusedattn.block_linear(torch.randn(2, 65), blocks, "q4_1")
    with pytest.raises(RuntimeError, match=r"x must be a float32 CPU tensor"):
        torch.ops.fusedattn.block_linear(torch.randn(2, 64, dtype=torch.float64), blocks, "q4_1")


@pytest.mark.parametrize("fmt", FORMATS)
def test_operators_pass_opcheck(fmt):
    g = torch.Generator().manual_seed(6)
    k = values(fmt, 2)
    blocks = random_blocks(66, k, fmt, g)
    torch.library.opcheck(torch.ops.fusedattn.block_linear.default, (torch.randn(2, 3, k, generator=g), blocks, fmt))
    torch.library.opcheck(torch.ops.fusedattn.block_dequantize.default, (blocks, fmt))
    assert torch.ops.fusedattn.block_dequantize(blocks, fmt).shape == (66, k)
