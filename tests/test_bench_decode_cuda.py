"""The decode benchmark on CUDA (marker `gpu`): the timing it relies on and the
bytes it counts."""

import json

import pytest
import torch

from fusedattn import bench_decode, cli

pytestmark = pytest.mark.gpu


def _decode_calls():
    device = torch.device("cuda")
    q, k, v = (torch.randn(8, 32, n, 128, device=device, dtype=torch.float16) for n in (1, 4096, 4096))
    lengths = torch.full((8,), 4096, dtype=torch.int32, device=device)

    def calls():
        for _ in range(bench_decode.CALLS_PER_TIMING):
            torch.ops.fusedattn.forward_kvcache(q, k, v, lengths, None, None, True, None)

    calls()
    return calls


def test_queued_timing_sleeps_through_the_enqueue():
    """An interval whose sleep ended before the host queued its last call is
    timed again with a longer sleep; the calibrated sleep rarely needs that;
    the time per call is the GPU's (100 calls back to back, within 2x: a
    wrong division or unit would be off by 10x or more)."""
    calls = _decode_calls()
    timer = bench_decode.QueuedTiming(calls, torch.device("cuda"))
    calibrated = timer.cycles
    assert calibrated > 1
    for _ in range(10):
        timer()
    assert timer.short_sleeps <= 2

    timer.cycles, timer.short_sleeps = 1, 0  # far too short for 10 launches
    seconds = timer()
    assert timer.short_sleeps >= 1 and timer.cycles > 1

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        calls()
    end.record()
    end.synchronize()
    back_to_back = start.elapsed_time(end) / 1e3 / (10 * bench_decode.CALLS_PER_TIMING)
    assert 0.5 < seconds / back_to_back < 2.0


@pytest.mark.parametrize("launch_gaps", [False, True])
def test_bench_decode_counts_the_valid_bytes(tmp_path, monkeypatch, launch_gaps):
    """The JSON's bytes are the valid K and V; --launch-gaps times without
    sleeps, the default sleeps before every timed interval of every method."""
    sleeps = []
    real_sleep = torch.cuda._sleep
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: (sleeps.append(cycles), real_sleep(cycles))[1])
    out = tmp_path / "decode.json"
    args = ["bench", "--decode", "--batch", "3", "--heads", "4", "--kv-heads", "2", "--head-dim", "64",
            "--seqlens", "300", "--repeats", "2", "--warmup", "1", "--methods", "sdpa-flash",
            "--no-progress", "--json", str(out)]
    assert cli.main(args + (["--launch-gaps"] if launch_gaps else [])) == 0
    result = json.loads(out.read_text())
    assert result["config"]["launch_gaps"] is launch_gaps
    cfg = bench_decode.DecodeConfig(torch.device("cuda"), batch=3)
    timed_intervals = 0
    for row in result["rows"]:
        lengths = bench_decode.cache_lengths(cfg, 300, row["varlen"])
        fused = row["results"]["fusedattn"]
        assert fused["status"] == "ok"
        assert fused["kv_bytes"] == 2 * int(lengths.sum()) * 2 * 64 * 2  # K and V, Hkv=2, d=64, 2 bytes
        assert fused["tb_per_s"] == pytest.approx(fused["kv_bytes"] / fused["seconds"] / 1e12)
        flash = row["results"]["sdpa-flash"]
        assert flash["status"] == ("ok" if not row["varlen"] else "n/a (no per-sequence lengths)")
        timed_intervals += 2 * (2 if flash["status"] == "ok" else 1)  # repeats x methods timed
    if launch_gaps:
        assert sleeps == []
    else:
        assert len(sleeps) >= timed_intervals and "short_sleeps" in fused


def test_bench_decode_capacity(tmp_path, monkeypatch):
    """--capacity allocates caches longer than N: fusedattn is given caches of
    that many positions, the bytes counted stay the valid ones, the JSON
    records it, and SDPA (which would read the whole cache) is skipped on full
    rows too."""
    capacities = []
    real_methods = bench_decode.methods

    def recording(cfg):
        table = real_methods(cfg)
        fused = table["fusedattn"]
        table["fusedattn"] = lambda q, k, v, lengths, block_table: (capacities.append(k.shape[2]),
                                                                    fused(q, k, v, lengths, block_table))[1]
        return table

    monkeypatch.setattr(bench_decode, "methods", recording)
    out = tmp_path / "decode.json"
    assert cli.main(["bench", "--decode", "--batch", "3", "--heads", "4", "--kv-heads", "2", "--head-dim", "64",
                     "--seqlens", "300", "--capacity", "1000", "--repeats", "2", "--warmup", "1",
                     "--methods", "sdpa-flash", "--no-progress", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert capacities and set(capacities) == {1000}
    assert result["config"]["capacity"] == 1000
    cfg = bench_decode.DecodeConfig(torch.device("cuda"), batch=3)
    for row in result["rows"]:
        fused = row["results"]["fusedattn"]
        assert fused["status"] == "ok"
        assert fused["kv_bytes"] == 2 * int(bench_decode.cache_lengths(cfg, 300, row["varlen"]).sum()) * 2 * 64 * 2
        assert row["results"]["sdpa-flash"]["status"].startswith("n/a")
