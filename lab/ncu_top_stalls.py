"""Where a kernel's warps wait, instruction by instruction: reads the SASS
source page of an Nsight Compute report (`ncu -i REPORT --page source --csv
--print-source sass > SOURCE.csv`, from a report taken with --set full) and
prints the instructions with the most warp-stall samples, with each one's
share of all samples and its main stall reasons.

    python3 lab/ncu_top_stalls.py SOURCE.csv [--top 40]
"""

import argparse
import csv
import sys


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("source_csv")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    # The page opens with a "Kernel Name" line; the table's header is the line
    # that starts with "Address".
    with open(args.source_csv, newline="") as f:
        lines = f.readlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"Address"')), None)
    if start is None:
        sys.exit(f"ncu_top_stalls: no table header (\"Address\", ...) in {args.source_csv}")
    rows = list(csv.DictReader(lines[start:]))
    if not rows:
        sys.exit(f"ncu_top_stalls: no rows in {args.source_csv}")
    columns = rows[0].keys()
    total_column = next((c for c in columns if c.startswith("Warp Stall Sampling (All")), None)
    if total_column is None:
        sys.exit(f"ncu_top_stalls: no 'Warp Stall Sampling (All Samples)' column; columns: {list(columns)}")
    # Per-reason sample columns, as ncu names them in the source view (stall_*).
    reasons = [c for c in columns if c.lower().startswith("stall_") or c.startswith("smsp__pcsamp")]
    total = sum(number(r[total_column]) for r in rows) or 1.0
    text_column = next(c for c in ("Source", "Sass", "SASS") if c in columns)
    address_column = next((c for c in ("Address", "# Address") if c in columns), None)
    print(f"{len(rows)} instructions, {total:.0f} stall samples")
    for r in sorted(rows, key=lambda r: -number(r[total_column]))[: args.top]:
        top = sorted(((number(r[c]), c) for c in reasons), reverse=True)[:3]
        why = ", ".join(f"{c.replace('stall_', '')} {v / max(number(r[total_column]), 1):.0%}" for v, c in top if v)
        where = r[address_column] if address_column else ""
        print(f"{number(r[total_column]) / total:6.1%}  {where:>6}  {r[text_column][:70]:70}  {why}")


if __name__ == "__main__":
    main()
