"""lab/decode_sweep.py: every set's rate lands in its own row and column.

A stand-in `fusedattn` on PATH writes the bench's JSON with a rate that
encodes the set (its --capacity, batch and dtype), so a row taken from the
wrong set, or one dtype written over another, shows. A set of NAME=value
words (the environment settings fusedattn no longer reads) is refused.
"""

import os
import stat
import subprocess
import sys
import textwrap

ROOT = os.path.join(os.path.dirname(__file__), "..")
SCRIPT = os.path.join(ROOT, "decode_sweep.py")

FAKE_BENCH = textwrap.dedent('''\
    #!{python}
    import json, os, sys
    a = sys.argv
    def arg(name, default):
        return a[a.index(name) + 1] if name in a else default
    if os.environ.get("FAKE_FAIL") and "--batch" in a:
        sys.exit(3)
    if os.environ.get("FAKE_RAN"):
        open(os.environ["FAKE_RAN"], "a").write(" ".join(a[1:]) + "\\n")
    capacity = int(arg("--capacity", "0")) // 65536  # 0: each cache holds its N
    batch = int(arg("--batch", "8"))
    dtypes = arg("--dtype", "float16").split(",")
    rows = [{{"dtype": dt, "varlen": v, "seqlen": n,
              "results": {{"fusedattn": {{"tb_per_s": capacity + batch / 100 + (0.5 if dt == "bfloat16" else 0)
                                          + (0.25 if v else 0)}}}}}}
            for dt in dtypes for v in (False, True) for n in (4096,)]
    config = {{"batch": batch, "heads": 32, "kv_heads": int(arg("--kv-heads", "32")), "head_dim": 128}}
    json.dump({{"date": "today", "device": "fake", "torch": "0", "config": config, "rows": rows}},
              open(arg("--json", None), "w"))
''')


def run_sweep(tmp_path, *args, **env):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "fusedattn"
    fake.write_text(FAKE_BENCH.format(python=sys.executable))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    full_env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", **env}
    return subprocess.run([sys.executable, SCRIPT, str(tmp_path / "out"), *args], env=full_env,
                          capture_output=True, text=True)


def table(tmp_path):
    lines = (tmp_path / "out" / "sweep.md").read_text().splitlines()
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines if line.startswith("| ")][1:]


def test_sets_side_by_side(tmp_path):
    done = run_sweep(tmp_path, "--dtype", "float16,bfloat16", "--", "auto", "--",
                     "--capacity 131072", "--", "--capacity 196608 --batch 16")
    assert done.returncode == 0, done.stderr
    rows = {tuple(r[:7]): r[7:] for r in table(tmp_path)}
    # dtype, B, Hq, Hkv, d, lengths, N -> auto, capacity 128K, capacity 192K at B=16, best
    assert rows[("float16", "8", "32", "32", "128", "all N", "4096")] == ["0.08", "2.08", "-", "2: --capacity 131072"]
    assert rows[("bfloat16", "8", "32", "32", "128", "1..N", "4096")] == ["0.83", "2.83", "-", "2: --capacity 131072"]
    assert rows[("float16", "16", "32", "32", "128", "all N", "4096")] == [
        "-", "-", "3.16", "3: --capacity 196608 --batch 16"]
    assert len(rows) == 8


def test_a_failed_set_fails_the_sweep(tmp_path):
    done = run_sweep(tmp_path, "--", "auto", "--", "--batch 4", FAKE_FAIL="1")
    assert done.returncode == 1
    assert "set 2 (--batch 4) failed" in done.stderr
    assert len(table(tmp_path)) == 2  # the set that ran is still reported


def test_an_environment_setting_is_refused_before_any_set_runs(tmp_path):
    """FUSEDATTN_DECODE_SPLITS=2 once forced the split count; passed to the
    bench as an argument now it would fail one set late, or be dropped and
    time the planner's count under the set's name."""
    ran = tmp_path / "ran.txt"
    for args in (["--", "auto", "--", "FUSEDATTN_DECODE_SPLITS=2 --batch 16"],
                 ["FUSEDATTN_DECODE_WARPS=4", "--", "auto"]):
        done = run_sweep(tmp_path, *args, FAKE_RAN=str(ran))
        assert done.returncode == 1
        assert "FUSEDATTN_DECODE_" in done.stderr and "sets are bench arguments only" in done.stderr
    assert not ran.exists() and not (tmp_path / "out").exists()
