"""ab_grid_table: each version's median over its rounds, ratios to the first version."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from ab_grid_table import table  # noqa: E402


def test_medians_over_rounds_and_ratios_to_the_first_version():
    lines = [
        "01-base d=128 N=8192 B=4 H=16 causal=0 mask=none kernel_us=100.0 total_us=110 TFLOP/s=1",
        "02-new d=128 N=8192 B=4 H=16 causal=0 mask=none kernel_us=90.0 total_us=99 TFLOP/s=1",
        "02-new d=128 N=8192 B=4 H=16 causal=0 mask=none kernel_us=70.0 total_us=99 TFLOP/s=1",
        "01-base d=128 N=8192 B=4 H=16 causal=0 mask=none kernel_us=120.0 total_us=130 TFLOP/s=1",
        "02-new d=64 N=2048 B=4 H=32 causal=1 mask=keypad kernel_us=50.0 total_us=60 TFLOP/s=1",
        "",
        "a warning line the tools printed",
    ]
    text = table(lines)
    assert "median of 2 round(s)" in text
    rows = [line for line in text.splitlines() if line.startswith("| d=")]
    assert rows[0] == "| d=128 N=8192 B=4 H=16 causal=0 mask=none | 110 | 80 | 0.727 |"
    assert rows[1] == "| d=64 N=2048 B=4 H=32 causal=1 mask=keypad | - | 50 | - |"


def test_each_mode_is_a_row_of_its_own():
    lines = [
        "01-base d=64 N=2048 B=4 H=32 causal=0 mask=none mode=default kernel_us=100.0 total_us=1 TFLOP/s=1",
        "01-base d=64 N=2048 B=4 H=32 causal=0 mask=none mode=deterministic kernel_us=125.0 total_us=1 TFLOP/s=1",
        "02-new d=64 N=2048 B=4 H=32 causal=0 mask=none mode=deterministic kernel_us=100.0 total_us=1 TFLOP/s=1",
    ]
    rows = [line for line in table(lines).splitlines() if line.startswith("| d=")]
    assert rows == ["| d=64 N=2048 B=4 H=32 causal=0 mask=none mode=default | 100 | - | - |",
                    "| d=64 N=2048 B=4 H=32 causal=0 mask=none mode=deterministic | 125 | 100 | 0.800 |"]


def test_no_timings_is_an_error():
    with pytest.raises(SystemExit, match="no kernel_us lines"):
        table(["nothing here"])
