"""The command line: `fusedattn bench` writes a table, JSON and a plot."""

import json
import os
import subprocess
import sys

import pytest
import torch

from fusedattn import cli


def test_bench_json_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = cli.main(["bench", "--device", "cpu", "--seqlens", "64,128", "--dtype", "float32",
                   "--causal", "both", "--heads", "2", "--head-dim", "16", "--repeats", "2",
                   "--no-progress", "--json", str(out_json), "--plot", str(out_png)])
    assert rc == 0
    result = json.loads(out_json.read_text())
    assert [(r["seqlen"], r["causal"]) for r in result["rows"]] == [
        (64, False), (128, False), (64, True), (128, True)]
    for row in result["rows"]:
        for name in ("naive", "sdpa", "fusedattn"):
            cell = row["results"][name]
            assert cell["status"] == "ok" and cell["seconds"] > 0 and cell["tflops"] > 0
        assert row["fusedattn_speedup"]["sdpa"] > 0
        assert row["arithmetic_intensity"] > 0
    assert out_png.stat().st_size > 1000
    table = capsys.readouterr().out
    assert "fusedattn GFLOP/s" in table and "x sdpa" in table


def test_bench_rejects_unknown_dtype():
    with pytest.raises(SystemExit, match="unknown dtype"):
        cli.main(["bench", "--device", "cpu", "--dtype", "float8", "--no-progress"])


def test_bench_methods_picks_columns(tmp_path):
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--device", "cpu", "--methods", "sdpa", "--seqlens", "64", "--dtype", "float32",
                     "--causal", "no", "--repeats", "1", "--warmup", "0", "--no-progress",
                     "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["methods"] == ["sdpa", "fusedattn"]
    (row,) = result["rows"]
    assert set(row["results"]) == {"sdpa", "fusedattn"} and row["fusedattn_speedup"]["sdpa"] > 0


def test_bench_methods_rejects_unknown_names():
    with pytest.raises(SystemExit, match=r"--methods: unknown method\(s\) \['sdpa-flash'\]; this device has"):
        cli.main(["bench", "--device", "cpu", "--methods", "sdpa,sdpa-flash", "--no-progress"])
    with pytest.raises(SystemExit, match=r"--methods: unknown method\(s\) \['sdpa'\]; this device has \['sdpa-flash'"):
        cli.main(["bench", "--decode", "--methods", "sdpa", "--no-progress"])


def test_bench_backward_on_the_cpu(tmp_path):
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--device", "cpu", "--backward", "--seqlens", "64", "--dtype", "float32",
                     "--causal", "yes", "--repeats", "1", "--warmup", "0", "--no-progress",
                     "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["config"]["backward"] is True
    (row,) = result["rows"]
    assert row["results"]["fusedattn"]["status"] == "ok" and row["fusedattn_speedup"]["sdpa"] > 0


def test_bench_interleaves_the_methods_timed_calls():
    """After each method's peak-memory call and warm-up, every repeat calls each method once,
    starting one further along each time; all methods get the same inputs, and a method that
    cannot run is left out of the rotation."""
    from fusedattn import bench

    calls, inputs = [], []

    def method(name):
        def call(q, k, v, causal):
            calls.append(name)
            inputs.append(q.data_ptr())
            return q
        return call

    def refuses(q, k, v, causal):
        raise NotImplementedError("no such backend here")

    cfg = bench.Config(torch.device("cpu"), batch=1, heads=2, head_dim=16, seqlens=[32], dtypes=["float32"],
                       causal=[False], repeats=4, warmup=1)
    table = {"a": method("a"), "b": method("b"), "no": refuses, "c": method("c")}
    results = bench.measure_row(cfg, "float32", False, 32, table)
    # peak memory + 1 warm-up each, then the repeats: a b c, b c a, c a b, a b c.
    assert calls == ["a", "a", "b", "b", "c", "c"] + list("abcbcacababc")
    assert len(set(inputs)) == 1
    assert results["no"]["status"].startswith("n/a (no such backend")
    assert all(results[m]["status"] == "ok" and results[m]["seconds"] > 0 for m in "abc")


def test_bench_holds_a_methods_setting_through_forward_and_backward(monkeypatch):
    """A kernel-family or deterministic column holds its setting through the
    backward too (it runs after the method returns), then restores it."""
    from fusedattn import bench

    monkeypatch.setenv("FUSEDATTN_KERNEL_FAMILY", "auto")
    seen = []

    def recording(method):
        def call(q, k, v, causal):
            seen.append((os.environ["FUSEDATTN_KERNEL_FAMILY"], torch.are_deterministic_algorithms_enabled()))
            return _RecordingBackward.apply(method(q, k, v, causal), seen)
        call.setting = method.setting
        return call

    cfg = bench.Config(torch.device("cpu"), batch=1, heads=2, head_dim=16, seqlens=[32], dtypes=["float32"],
                       causal=[False], repeats=1, warmup=0, backward=True)
    cell = bench.measure(cfg, "float32", False, 32, "fusedattn-sm80", recording(bench._kernel_family("sm80")))
    assert cell["status"] == "ok"
    assert seen and set(seen) == {("sm80", False), ("sm80 (backward)", False)}
    assert os.environ["FUSEDATTN_KERNEL_FAMILY"] == "auto"
    seen.clear()
    cell = bench.measure(cfg, "float32", False, 32, "fusedattn-deterministic",
                         recording(bench._Fusedattn(bench._deterministic_algorithms)))
    assert cell["status"] == "ok"
    assert set(seen) == {("auto", True), ("auto (backward)", True)}
    assert not torch.are_deterministic_algorithms_enabled()


class _RecordingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seen):
        ctx.seen = seen
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.seen.append((os.environ["FUSEDATTN_KERNEL_FAMILY"] + " (backward)",
                         torch.are_deterministic_algorithms_enabled()))
        return grad, None


def test_bench_decode_options_are_checked():
    with pytest.raises(SystemExit, match="--kv-heads needs --decode"):
        cli.main(["bench", "--device", "cpu", "--kv-heads", "8", "--no-progress"])
    with pytest.raises(SystemExit, match="--launch-gaps needs --decode"):
        cli.main(["bench", "--device", "cpu", "--launch-gaps", "--no-progress"])
    with pytest.raises(SystemExit, match="--capacity needs --decode"):
        cli.main(["bench", "--device", "cpu", "--capacity", "8192", "--no-progress"])
    with pytest.raises(SystemExit, match=r"--capacity must be at least every N \(the largest is 4096\), got 2048"):
        cli.main(["bench", "--decode", "--device", "cpu", "--seqlens", "1024,4096", "--capacity", "2048",
                  "--no-progress"])
    with pytest.raises(SystemExit, match="--plot does not apply to --decode"):
        cli.main(["bench", "--decode", "--plot", "x.png", "--no-progress"])
    with pytest.raises(SystemExit, match="the decode benchmark needs a CUDA device"):
        cli.main(["bench", "--decode", "--device", "cpu", "--no-progress"])
    # Known column names pass --methods' check and reach the device check.
    with pytest.raises(SystemExit, match="the decode benchmark needs a CUDA device"):
        cli.main(["bench", "--decode", "--device", "cpu", "--methods", "sdpa-cudnn", "--no-progress"])


def test_bench_decode_lengths():
    """Per-sequence lengths are seeded, within [1, N], and used for the byte count."""
    from fusedattn import bench_decode

    cfg = bench_decode.DecodeConfig(torch.device("cpu"), batch=16)
    varlen = bench_decode.cache_lengths(cfg, 1000, True)
    assert torch.equal(varlen, bench_decode.cache_lengths(cfg, 1000, True))
    assert varlen.min() >= 1 and varlen.max() <= 1000 and len(set(varlen.tolist())) > 1
    assert (bench_decode.cache_lengths(cfg, 1000, False) == 1000).all()


@pytest.mark.gpu
def test_bench_decode_on_cuda(tmp_path):
    out = tmp_path / "decode.json"
    assert cli.main(["bench", "--decode", "--batch", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "64",
                     "--seqlens", "256,1000", "--repeats", "2", "--no-progress", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 4
    for row in rows:
        assert row["results"]["fusedattn"]["tb_per_s"] > 0
        if row["varlen"]:
            assert row["results"]["sdpa-flash"]["status"].startswith("n/a")


def test_python_dash_m_entry_point():
    done = subprocess.run([sys.executable, "-m", "fusedattn", "--help"], capture_output=True,
                          text=True, check=True)
    assert "bench" in done.stdout


@pytest.mark.gpu
def test_bench_decode_methods_on_cuda(tmp_path):
    out = tmp_path / "decode.json"
    assert cli.main(["bench", "--decode", "--batch", "2", "--heads", "4", "--head-dim", "64", "--seqlens", "256",
                     "--lengths", "full", "--repeats", "2", "--methods", "sdpa-cudnn", "--no-progress",
                     "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["methods"] == ["sdpa-cudnn", "fusedattn"]
    (row,) = result["rows"]
    assert set(row["results"]) == {"sdpa-cudnn", "fusedattn"}
