"""Ring attention (fusedattn.distributed) on gloo groups of 2, 3 and 4 CPU
processes, against the float64 reference over the whole sequence."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

import fusedattn
from fusedattn import distributed as fd
from fusedattn.distributed.ring import step_block
from helpers.attention_cases import Case, check_backward, check_forward
from helpers.ring_workers import RingCase, grad_out_of, model_input, spawn_ring, tiny_model

WORLDS = (2, 3, 4)


def ring_cases(world: int) -> list[RingCase]:
    """Both layouts, causal and not, GQA and not, shards that are no multiple of a tile."""
    cases = []
    for layout in fd.LAYOUTS:
        per_rank = 37 if layout == "contiguous" else 38
        for is_causal in (False, True):
            for heads_q, heads_kv, head_dim in ((4, 2, 32), (3, 3, 24)):
                n = world * per_rank
                cases.append(RingCase(Case(2, heads_q, heads_kv, n, n, head_dim, is_causal=is_causal,
                                           seed=world + heads_kv), layout))
    if world == 3:
        cases.append(RingCase(Case(2, 4, 2, 6 * 19, 6 * 19, 32, dtype=torch.bfloat16, is_causal=True, seed=8),
                              "zigzag"))
    if world == 2:
        cases += [RingCase(Case(1, 4, 1, 2 * 260, 2 * 260, 64, is_causal=True, seed=5), "zigzag"),  # tiles + tail
                  RingCase(Case(2, 4, 2, 74, 74, 32, scale=0.3, seed=6), "contiguous")]
        cases += [RingCase(Case(2, 4, 2, 76, 76, 32, dtype=dtype, is_causal=True, seed=7), layout)
                  for dtype in (torch.bfloat16, torch.float16) for layout in fd.LAYOUTS]
    return cases


MODEL_RUNS = {2: [("contiguous", False), ("zigzag", False), ("contiguous", True)], 3: [("zigzag", False)], 4: []}


@pytest.fixture(scope="module")
def ring_results(tmp_path_factory):
    """world -> what rank 0 gathered, each world's processes spawned once."""
    cache: dict[int, dict] = {}

    def results(world: int) -> dict:
        if world not in cache:
            cache[world] = spawn_ring(world, tmp_path_factory.mktemp(f"ring{world}"), ring_cases(world),
                                      MODEL_RUNS[world])
        if isinstance(cache[world], str):  # a failed world fails each of its tests at once
            pytest.fail(cache[world])
        return cache[world]

    return results


@pytest.mark.parametrize("world, ring_case", [(w, rc) for w in WORLDS for rc in ring_cases(w)],
                         ids=lambda x: str(x))
def test_ring_matches_whole_sequence_attention(ring_results, world, ring_case):
    got = ring_results(world)[str(ring_case)]
    c = ring_case.case
    check_forward(c, out=got["out"])
    check_backward(c, grads=(got["dq"], got["dk"], got["dv"]), grad_out=grad_out_of(c))


@pytest.mark.parametrize("world, layout, compiled", [(w, layout, compiled) for w, runs in MODEL_RUNS.items()
                                                     for layout, compiled in runs])
def test_context_parallel_runs_a_model_on_the_ring(ring_results, world, layout, compiled):
    """A model of fusedattn.nn.MultiheadAttention layers, unchanged, inside
    context_parallel on sharded inputs: the same output and parameter
    gradients as on the whole sequence in one process (compiled: torch.compile
    guards on the block, so it cannot silently attend within a shard)."""
    got = ring_results(world)[f"model-{layout}-{'compiled' if compiled else 'eager'}"]
    model = tiny_model(seed=world)
    x, g = model_input(world, layout)
    out = model(x)
    (out * g).sum().backward()
    torch.testing.assert_close(got["out"], out.detach(), rtol=1e-4, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")


def _work(rank: int, world: int, layout: str, is_causal: bool) -> float:
    """Score entries rank computes over the ring, in units of (shard rows)^2."""
    total = 0.0
    for source in range(world):
        block = step_block(rank, source, 2 * 12, layout, is_causal)
        if block is not None:
            area = (block.q.stop - block.q.start) * (block.kv.stop - block.kv.start) / (2 * 12) ** 2
            total += area / 2 if block.causal else area
    return total


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_zigzag_balances_causal_work_and_contiguous_skips_hidden_steps(world):
    zigzag = {_work(r, world, "zigzag", True) for r in range(world)}
    assert zigzag == {world / 2}, f"zigzag work per rank differs: {zigzag}"
    for r in range(world):
        assert _work(r, world, "contiguous", True) == r + 0.5  # earlier shards whole, its own half
        assert sum(step_block(r, s, 24, "contiguous", True) is not None for s in range(world)) == r + 1
        assert _work(r, world, "contiguous", False) == _work(r, world, "zigzag", False) == world


def test_positions_of_each_layout():
    assert fd.positions(4, 0, 2, "zigzag").tolist() == [0, 1, 6, 7]
    assert fd.positions(4, 1, 2, "zigzag").tolist() == [2, 3, 4, 5]
    assert fd.positions(3, 2, 3, "contiguous").tolist() == [6, 7, 8]
    with pytest.raises(ValueError, match="multiple of 2, got 5"):
        fd.positions(5, 0, 2, "zigzag")
    with pytest.raises(ValueError, match="layout must be one of .* got 'ring'"):
        fd.positions(4, 0, 2, "ring")


@pytest.fixture
def one_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    yield
    dist.destroy_process_group()


def test_a_ring_of_one_is_attention(one_process_group):
    q, k, v = (torch.randn(s, generator=torch.Generator().manual_seed(3)).requires_grad_()
               for s in ((2, 4, 50, 32), (2, 2, 50, 32), (2, 2, 50, 32)))
    out = fd.ring_attention(q, k, v, is_causal=True, layout="zigzag")
    expected = fusedattn.attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_ranks_whose_shards_differ_are_told_so(tmp_path):
    """Rank 1 holds a longer shard than rank 0: both raise, neither waits on the other."""
    got = spawn_ring(2, tmp_path, [], [], mismatched_shards=True)
    assert isinstance(got, str) and "the ranks' shards differ" in got, got


def test_bad_input_says_what_was_expected(one_process_group):
    q, k = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    with pytest.raises(ValueError, match="layout must be one of .* got 'rings'"):
        fd.ring_attention(q, k, k, layout="rings")
    with pytest.raises(ValueError, match="equal shard lengths, dim 2\\), got 6, 5 and 5"):
        fd.ring_attention(q, k[:, :, :5], k[:, :, :5])
    with pytest.raises(ValueError, match="zigzag shard .* must be even, got 5"):
        fd.ring_attention(q[:, :, :5], k[:, :, :5], k[:, :, :5], layout="zigzag")
    with pytest.raises(ValueError, match="q must be 4-D .* got shape \\[2, 6, 8\\]"):
        fd.ring_attention(q[0], k, k)
    with pytest.raises(ValueError, match="v must have the head dim of q and k on the ring .* got 8 and 4"):
        fd.ring_attention(q, k, k[..., :4])
    with pytest.raises(ValueError, match="multiple of 2, got 7"):
        fd.shard(torch.randn(7, 3), 0, layout="zigzag")
    with fd.context_parallel():
        with pytest.raises(ValueError, match="no attn_mask or window yet \\(got window=\\(4, 0\\)\\)"):
            fusedattn.attention(q, k, k, window=(4, 0))
        with pytest.raises(ValueError, match="got attn_mask"):
            fusedattn.attention(q, k, k, attn_mask=torch.ones(6, 6, dtype=torch.bool))
        with pytest.raises(ValueError, match="no softcap or sinks yet \\(got softcap=2.0\\)"):
            fusedattn.attention(q, k, k, softcap=2.0)
        with pytest.raises(ValueError, match="no softcap or sinks yet \\(got sinks\\)"):
            fusedattn.attention(q, k, k, sinks=torch.zeros(2))
    with pytest.raises(ValueError, match="context_parallel: layout must be one of"):
        with fd.context_parallel(layout="zig"):
            pass


def test_without_a_process_group_the_error_says_how_to_start_one():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        fd.ring_attention(*(torch.randn(1, 2, 4, 8) for _ in range(3)))


def test_the_context_parallel_training_example_follows_one_process(tmp_path):
    """examples/train_context_parallel.py on 3 gloo processes: its loss curve is
    the one-process curve from the same seed."""
    import pathlib
    import re
    import subprocess
    import sys

    example = pathlib.Path(__file__).parent.parent / "examples" / "train_context_parallel.py"
    run = subprocess.run([sys.executable, str(example), "--world", "3", "--steps", "4", "--layout", "contiguous"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "4 steps, 3 processes (contiguous layout) against one" in run.stdout
    difference = float(re.search(r"largest difference along the way (\S+)", run.stdout).group(1))
    assert difference < 1e-4, run.stdout
