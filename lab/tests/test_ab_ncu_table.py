"""lab/ab_ncu_table.py: each shape's row holds its own profiled calls' medians (the warm-up
calls dropped), a version's ratio is the first version's time over its own, and a version
whose launches do not split evenly over the shapes is reported instead of misread; the stall
table lists each version's median stall per reason, largest first."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import ab_ncu_table  # noqa: E402

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
          '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def write_csv(path, times_by_launch, stalls=()):
    lines = ["==PROF== Connected to process 1", HEADER]
    for i, ns in enumerate(times_by_launch):
        metrics = [("gpu__time_duration.sum", "nsecond", ns), ("smsp__inst_executed.sum", "inst", 1000 * ns)]
        metrics += [(ab_ncu_table.stall_metric(r), "", v * ns / 1000) for r, v in stalls]
        for metric, unit, value in metrics:
            lines.append(f'"{i}","1","python3","host","sm90_forward_kernel","1","7","(384, 1, 1)",'
                         f'"(132, 1, 1)","0","9.0","Command line profiler metrics","{metric}","{unit}","{value:,.3f}"')
    path.write_text("\n".join(lines) + "\n")


def test_rows_ratios_and_uneven_versions(tmp_path):
    # Two shapes, 3 warm-up + 3 profiled calls each; the warm-ups are slow and must not count.
    write_csv(tmp_path / "01-base.csv", [9e6] * 3 + [1000, 1100, 1050] + [9e6] * 3 + [2000, 2000, 2100])
    write_csv(tmp_path / "02-new.csv", [9e6] * 3 + [900, 1000, 950] + [9e6] * 3 + [2500, 2400, 2450])
    write_csv(tmp_path / "03-short.csv", [1000] * 5)
    rows, _, problems = ab_ncu_table.table(tmp_path, ["d=128,N=8192", "d=64,N=1024"], calls=3)
    assert rows["d=128,N=8192"]["01-base"] == (1050, 1050000)
    assert rows["d=128,N=8192"]["02-new"] == (950, 950000)
    assert rows["d=64,N=1024"]["02-new"] == (2450, 2450000)
    assert problems == ["03-short: 5 launches for 2 shape(s)"]
    text = ab_ncu_table.markdown(rows, problems)
    assert "| d=128,N=8192 | 1.1 | 1.1 | 0.9 | 0.9 | 1.105 |" in text  # 1050 / 950
    assert "| d=64,N=1024 | 2.0 | 2.0 | 2.5 | 2.5 | 0.816 |" in text  # 2000 / 2450
    assert "- 03-short: 5 launches" in text


def test_stalls_median_per_reason_largest_first(tmp_path):
    # One shape; stall values scale with the launch's time (v * ns / 1000), so the median launch's count.
    write_csv(tmp_path / "01-base.csv", [1000, 1200, 1100], stalls=[("wait", 1.0), ("no_instruction", 2.0)])
    write_csv(tmp_path / "02-new.csv", [1000, 1000, 1000], stalls=[("wait", 1.5), ("no_instruction", 0.5)])
    _, stalls, problems = ab_ncu_table.table(tmp_path, ["d=128,N=8192"], calls=3)
    assert not problems
    assert stalls["d=128,N=8192"]["01-base"] == {"no_instruction": 2.2, "wait": 1.1}
    text = ab_ncu_table.stall_markdown(stalls)
    lines = text.splitlines()
    first = lines.index("| reason | 01-base | 02-new |")
    assert lines[first + 2] == "| no_instruction | 2.200 | 0.500 |"  # the base's largest first
    assert lines[first + 3] == "| wait | 1.100 | 1.500 |"


def test_a_csv_of_other_metrics_is_reported(tmp_path):
    # ncu run without --metrics writes its default sections: no time to read.
    lines = ["==PROF== Connected to process 1", HEADER]
    for i in range(3):
        lines.append(f'"{i}","1","python3","host","sm90_forward_kernel","1","7","(384, 1, 1)","(132, 1, 1)","0","9.0",'
                     f'"GPU Speed Of Light Throughput","Duration","ns","1,000"')
    (tmp_path / "01-base.csv").write_text("\n".join(lines) + "\n")
    rows, _, problems = ab_ncu_table.table(tmp_path, ["d=128,N=8192"], calls=3)
    assert rows == {"d=128,N=8192": {}}
    assert problems == ["01-base: launches without gpu__time_duration.sum or smsp__inst_executed.sum "
                        "(were the metrics passed?)"]
