"""The decode benchmark on CUDA (marker `gpu`): the timing it relies on and the
bytes it counts."""

import json

import pytest
import torch

from fusedattn import bench_decode, cli

pytestmark = pytest.mark.gpu


def test_the_sleep_outlasts_the_enqueue():
    """The timed interval starts on a GPU that has every call queued: the sleep
    before it is still running when the host has enqueued the last call."""
    device = torch.device("cuda")
    q, k, v = (torch.randn(8, 32, n, 128, device=device, dtype=torch.float16) for n in (1, 4096, 4096))
    lengths = torch.full((8,), 4096, dtype=torch.int32, device=device)

    def calls():
        for _ in range(bench_decode.CALLS_PER_TIMING):
            torch.ops.fusedattn.forward_kvcache(q, k, v, lengths, None, None, True, None)

    calls()
    cycles = bench_decode._sleep_cycles(calls, device)
    assert cycles > 0
    for _ in range(5):
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        slept = torch.cuda.Event()
        slept.record()
        calls()
        assert not slept.query(), "the GPU finished its sleep before the host had queued the calls"
    torch.cuda.synchronize()


@pytest.mark.parametrize("launch_gaps", [False, True])
def test_bench_decode_counts_the_valid_bytes(tmp_path, launch_gaps):
    out = tmp_path / "decode.json"
    args = ["bench", "--decode", "--batch", "3", "--heads", "4", "--kv-heads", "2", "--head-dim", "64",
            "--seqlens", "300", "--repeats", "2", "--warmup", "1", "--methods", "sdpa-flash",
            "--no-progress", "--json", str(out)]
    assert cli.main(args + (["--launch-gaps"] if launch_gaps else [])) == 0
    result = json.loads(out.read_text())
    assert result["config"]["launch_gaps"] is launch_gaps
    cfg = bench_decode.DecodeConfig(torch.device("cuda"), batch=3)
    for row in result["rows"]:
        lengths = bench_decode.cache_lengths(cfg, 300, row["varlen"])
        fused = row["results"]["fusedattn"]
        assert fused["status"] == "ok"
        assert fused["kv_bytes"] == 2 * int(lengths.sum()) * 2 * 64 * 2  # K and V, Hkv=2, d=64, 2 bytes
        assert fused["tb_per_s"] == pytest.approx(fused["kv_bytes"] / fused["seconds"] / 1e12)
        flash = row["results"]["sdpa-flash"]
        assert flash["status"] == ("ok" if not row["varlen"] else "n/a (no per-sequence lengths)")
