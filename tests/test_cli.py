"""The command line: `fusedattn bench` writes a table, JSON and a plot."""

import json
import subprocess
import sys

import pytest

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


def test_python_dash_m_entry_point():
    done = subprocess.run([sys.executable, "-m", "fusedattn", "--help"], capture_output=True,
                          text=True, check=True)
    assert "bench" in done.stdout
