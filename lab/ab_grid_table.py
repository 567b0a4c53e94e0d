"""ab_bench.sh grid's table: reads the lines backward_grid.py printed for each
version (`TAG d=.. N=.. ... kernel_us=..`, any number of rounds) and prints a
markdown table of each version's median kernel time per shape and its ratio
to the first version's.

    python3 lab/ab_grid_table.py GRID.txt
"""

import argparse
import statistics

SHAPE_KEYS = ("d", "N", "B", "H", "causal", "mask", "mode")


def table(lines) -> str:
    times: dict[str, dict[str, list[float]]] = {}
    for line in lines:
        if not line.strip():
            continue
        tag, *fields = line.split()
        kv = dict(f.split("=", 1) for f in fields if "=" in f)
        if "kernel_us" not in kv:
            continue
        shape = " ".join(f"{k}={kv[k]}" for k in SHAPE_KEYS if k in kv)
        times.setdefault(shape, {}).setdefault(tag, []).append(float(kv["kernel_us"]))
    names = list(dict.fromkeys(tag for per_tag in times.values() for tag in per_tag))
    if not names:
        raise SystemExit("ab_grid_table: no kernel_us lines")
    rounds = max(len(t) for per_tag in times.values() for t in per_tag.values())
    out = [f"Kernel time in us, the median of {rounds} round(s) per version; x = over {names[0]}.", "",
           "| shape | " + " | ".join(f"{n} us" for n in names) + " | " + " | ".join(f"x {n}" for n in names[1:]) + " |",
           "|" + "---|" * (2 * len(names))]
    for shape, per_tag in times.items():
        median = {n: statistics.median(t) for n, t in per_tag.items()}
        base = median.get(names[0])
        cells = [f"{median[n]:.0f}" if n in median else "-" for n in names]
        ratios = [f"{median[n] / base:.3f}" if n in median and base else "-" for n in names[1:]]
        out.append(f"| {shape} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("grid", help="the lines backward_grid.py printed, every version and round")
    with open(parser.parse_args().grid) as f:
        print(table(f))
