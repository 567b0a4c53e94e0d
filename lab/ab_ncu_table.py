"""Lab: the table of lab/ab_bench.sh's ncu mode. Reads one Nsight Compute CSV
per version (`ncu --csv --print-units base --metrics $(ab_ncu_table.py
--metrics)` over lab/ab_ncu_case.py) and prints, per shape, each version's
median kernel time and instructions of the profiled calls (the warm-up calls
dropped), the ratio to the first version, and the warps' stall reasons (warps
stalled per issued instruction, by reason; the larger ones differ between two
versions where the time went).

    python3 lab/ab_ncu_table.py CSV_DIR SHAPE [SHAPE ...] [--calls 3]
    python3 lab/ab_ncu_table.py --metrics    # the metrics to pass ncu

A version's launches are split evenly over the shapes in the order given (the
case script runs them in that order); a version whose launch count does not
divide evenly is reported, not guessed at.
"""

import argparse
import csv
import io
import pathlib
import statistics
import sys

TIME, INSTRUCTIONS = "gpu__time_duration.sum", "smsp__inst_executed.sum"
STALLS = ("no_instruction", "wait", "barrier", "long_scoreboard", "short_scoreboard", "math_pipe_throttle",
          "mio_throttle", "dispatch_stall", "branch_resolving", "membar", "sleeping", "selected", "not_selected")


def stall_metric(reason):
    return f"smsp__average_warps_issue_stalled_{reason}_per_issue_active.ratio"


METRICS = (TIME, INSTRUCTIONS) + tuple(stall_metric(r) for r in STALLS)


def launches(text):
    """The metrics of each launch, in launch order: [{metric: value}]."""
    start = text.find('"ID"')
    if start < 0:
        return []
    by_id = {}
    for row in csv.DictReader(io.StringIO(text[start:])):
        metrics = by_id.setdefault(int(row["ID"]), {})
        try:
            metrics[row["Metric Name"]] = float(row["Metric Value"].replace(",", ""))
        except ValueError:  # a metric this GPU or ncu does not collect reads "" or "n/a": left out
            pass
    return [by_id[i] for i in sorted(by_id)]


def table(csv_dir, shapes, calls):
    """{shape: {version: (median ns, median instructions)}}, {shape: {version: {reason: median stall}}}
    and the versions' problems."""
    rows, stalls, problems = {shape: {} for shape in shapes}, {shape: {} for shape in shapes}, []
    for path in sorted(pathlib.Path(csv_dir).glob("*.csv")):
        found = launches(path.read_text())
        if not found or len(found) % len(shapes):
            problems.append(f"{path.stem}: {len(found)} launches for {len(shapes)} shape(s)")
            continue
        if not all(TIME in m and INSTRUCTIONS in m for m in found):
            problems.append(f"{path.stem}: launches without {TIME} or {INSTRUCTIONS} (were the metrics passed?)")
            continue
        per_shape = len(found) // len(shapes)
        for s, shape in enumerate(shapes):
            mine = found[s * per_shape:(s + 1) * per_shape][-calls:]
            rows[shape][path.stem] = (statistics.median(m[TIME] for m in mine),
                                      statistics.median(m[INSTRUCTIONS] for m in mine))
            stalls[shape][path.stem] = {r: statistics.median(m[stall_metric(r)] for m in mine)
                                        for r in STALLS if all(stall_metric(r) in m for m in mine)}
    return rows, stalls, problems


def stall_markdown(stalls):
    """Per shape and version, the stall reasons (warps per issued instruction), largest first."""
    lines = []
    for shape, by_version in stalls.items():
        names = sorted(by_version)
        if not names or not by_version[names[0]]:
            continue
        reasons = sorted(by_version[names[0]], key=lambda r: -by_version[names[0]][r])
        lines += ["", f"Stalls at {shape} (warps stalled per issued instruction):", "",
                  "| reason | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 1)]
        for r in reasons:
            lines.append(f"| {r} | " + " | ".join(f"{by_version[n].get(r, float('nan')):.3f}" for n in names) + " |")
    return "\n".join(lines) + ("\n" if lines else "")


def markdown(rows, problems):
    names = sorted({n for r in rows.values() for n in r})
    lines = ["Forward kernel time (gpu__time_duration at base clocks, us) and instructions executed (millions), "
             "median of the profiled calls; time x V: the first version's time over V's (above 1, V is faster).", ""]
    lines.append("| shape | " + " | ".join(f"{n} us | {n} Minst" for n in names)
                 + "".join(f" | time x {n}" for n in names[1:]) + " |")
    lines.append("|" + "---|" * (2 * len(names) + len(names)))
    for shape, r in rows.items():
        cells = []
        for n in names:
            cells += [f"{r[n][0] / 1e3:.1f}", f"{r[n][1] / 1e6:.1f}"] if n in r else ["-", "-"]
        base = r.get(names[0], (None,))[0] if names else None
        cells += [f"{base / r[n][0]:.3f}" if n in r and base else "-" for n in names[1:]]
        lines.append(f"| {shape} | " + " | ".join(cells) + " |")
    lines += [f"- {p}" for p in problems]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] == ["--metrics"]:
        print(",".join(METRICS))
        sys.exit(0)
    parser = argparse.ArgumentParser()
    parser.add_argument("csv_dir")
    parser.add_argument("shapes", nargs="+")
    parser.add_argument("--calls", type=int, default=3, help="profiled calls per shape (ab_ncu_case.py's --calls)")
    a = parser.parse_args()
    rows, stalls, problems = table(a.csv_dir, a.shapes, a.calls)
    sys.stdout.write(markdown(rows, problems) + stall_markdown(stalls))
