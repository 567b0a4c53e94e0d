"""`fusedattn bench --mask`'s masks (python/fusedattn/bench_mask.py): each kind's
entries and visible count against a brute-force count, and the parsing of kinds."""

import re

import pytest
import torch

from fusedattn import bench_mask
from fusedattn.bench_mask import MaskKind


def brute_visible(kind: MaskKind, b: int, i: int, j: int, n: int, blocks=None) -> bool:
    """Whether query i of batch item b sees key j, straight from the kind's definition."""
    if kind.name == "window":
        return 0 <= i - j <= kind.param
    if kind.name == "docs":
        length = n // kind.param
        doc = lambda x: min(x // length, kind.param - 1)  # noqa: E731
        return doc(i) == doc(j) and j <= i
    if kind.name == "random":
        return bool(blocks[i // 128, j // 128])
    length = [n, n // 2, n // 4, 3 * n // 4][b % 4]
    return j < length and (kind.name == "keypad" or j <= i)


KINDS = [MaskKind("window", 0), MaskKind("window", 5), MaskKind("window", 100), MaskKind("docs", 1),
         MaskKind("docs", 3), MaskKind("docs", 7), MaskKind("keypad"), MaskKind("causal_keypad")]
SHAPES = {"keypad": (5, 1, 1, 37), "causal_keypad": (5, 1, 37, 37)}


@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_masks_and_counts_against_brute_force(kind):
    batch, n = 5, 37  # every keypad length (the fifth item cycles back) and documents of unequal length
    mod, per_batch = bench_mask.mask_mod(kind, batch, n, "cpu")
    dense = bench_mask.dense_mask(mod, batch, n, "cpu")
    assert tuple(dense.shape) == SHAPES.get(kind.name, (1, 1, n, n)) and dense.dtype == torch.bool
    assert per_batch == (kind.name in SHAPES)
    brute = torch.tensor([[[[brute_visible(kind, b, i, j, n) for j in range(n)] for i in range(n)]]
                          for b in range(batch)])
    assert torch.equal(dense.expand(batch, 1, n, n), brute)
    assert bench_mask.visible_entries(dense, batch, n) == int(brute.sum())


@pytest.mark.parametrize("p", [0.0, 0.3, 0.9])
def test_random_blocks_against_brute_force(p):
    batch, n = 3, 300  # a partial last block
    kind = MaskKind("random", p)
    blocks = bench_mask._random_blocks(n, p, "cpu")
    assert blocks.shape == (3, 3)
    mod, per_batch = bench_mask.mask_mod(kind, batch, n, "cpu")
    dense = bench_mask.dense_mask(mod, batch, n, "cpu")
    assert dense.shape == (1, 1, n, n) and not per_batch
    count = sum(brute_visible(kind, 0, i, j, n, blocks) for i in range(n) for j in range(n))
    assert bench_mask.visible_entries(dense, batch, n) == batch * count
    assert torch.equal(bench_mask._random_blocks(n, p, "cpu"), blocks)  # the fixed seed
    if p == 0:
        assert count == n * n


def test_random_hides_about_p_of_the_blocks():
    blocks = bench_mask._random_blocks(128 * 40, 0.25, "cpu")
    assert abs(1 - blocks.float().mean().item() - 0.25) < 0.03


def test_parse_kinds():
    assert bench_mask.parse_kinds(["window:1024,docs:8", "keypad", " causal_keypad , random:0.5"]) == [
        MaskKind("window", 1024), MaskKind("docs", 8), MaskKind("keypad"), MaskKind("causal_keypad"),
        MaskKind("random", 0.5)]
    assert [str(k) for k in bench_mask.parse_kinds(["window:0,random:0"])] == ["window:0", "random:0.0"]
    assert bench_mask.parse_kinds(["keypad,random:.5", "keypad,random:0.50"]) == [
        MaskKind("keypad"), MaskKind("random", 0.5)]  # each kind once


@pytest.mark.parametrize("spec, message", [
    ("band:3", "unknown kind 'band:3'"),
    ("", "unknown kind ''"),
    ("window", "'window': give window:W"),
    ("window:1.5", "'window:1.5': give window:W"),
    ("window:-1", "'window:-1': W out of range"),
    ("docs:0", "'docs:0': K out of range"),
    ("random:1", "'random:1': P out of range"),
    ("random:-0.1", "'random:-0.1': P out of range"),
    ("random:nan", "'random:nan': P out of range"),
    ("keypad:4", "'keypad:4': keypad takes no parameter"),
])
def test_parse_kinds_refuses(spec, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        bench_mask.parse_kinds([spec])


def test_documents_need_n_of_at_least_k():
    kinds = bench_mask.parse_kinds(["docs:8"])
    assert bench_mask.seqlen_problem(kinds, [8, 64]) is None
    assert bench_mask.seqlen_problem(kinds, [64, 4]) == "--mask docs:8: 8 documents need every N >= 8, got 4"


@pytest.mark.parametrize("kind", [MaskKind("window", 8), MaskKind("keypad")], ids=str)
def test_blockmask_column_builds_once_and_times_the_builds(monkeypatch, kind):
    """The fusedattn-blockmask column, fusedattn.block_mask's calls recorded: FlexAttention's
    B convention (None unless the mask reads b), the build timed."""
    import fusedattn

    calls = []

    real = fusedattn.block_mask

    def block_mask(mod, b, h, nq, nk, device):
        calls.append((b, h, nq, nk))
        return real(mod, b, h, nq, nk, device=device)

    monkeypatch.setattr(fusedattn, "block_mask", block_mask)
    cfg = bench_mask.MaskConfig(torch.device("cpu"), [kind], batch=2, heads=2, head_dim=16, seqlens=[64],
                                dtypes=["float32"], repeats=1, warmup=0)
    row = bench_mask.measure_row(cfg, kind, 64)
    assert calls == [(2 if kind.name == "keypad" else None, None, 64, 64)] * (1 + bench_mask.BUILD_REPEATS)
    assert row["build"]["status"] == "ok" and row["build"]["ms"] > 0
    assert row["results"]["fusedattn-blockmask"]["status"] == "ok"
    assert row["results"]["fusedattn-blockmask"]["tflops"] > 0
