"""The installed fusedattn's decode table under several settings, side by side.

    python3 lab/decode_sweep.py OUTDIR [common bench args] -- SET [-- SET ...]

Each SET is a space-separated string of bench arguments (e.g. "--batch 16",
"--capacity 131072 --lengths full"); "auto" is an empty set. Every set runs
`fusedattn bench --decode --methods fusedattn` once, with the common
arguments first. OUTDIR gets one JSON per set and sweep.md: TB/s per row and
set, and each row's best set. The ab_bench.sh habit for one build: the
settings of a rule (batch, heads, capacity) measured in the same minutes.
fusedattn reads no environment variables: a set forces a split count with
the bench's --num-splits (the merge path and warps are the op's
merge_in_cluster and warps arguments, which the bench does not take), and a
set of NAME=value words is refused rather than silently measuring the
planner's choice.
"""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys


def parse(argv: list[str]) -> tuple[pathlib.Path, list[str], list[str]]:
    if len(argv) < 3 or "--" not in argv:
        sys.exit(__doc__)
    out = pathlib.Path(argv[0])
    split = argv.index("--")
    common = argv[1:split]
    sets = [s for s in argv[split + 1:] if s != "--"]
    for words in [" ".join(common), *sets]:
        if setting := next((w for w in words.split() if re.match(r"[A-Z_][A-Z0-9_]*=", w)), None):
            sys.exit(f"decode_sweep: {setting!r}: sets are bench arguments only (fusedattn reads no "
                     "environment variables; `fusedattn bench --decode --num-splits N` forces a split count)")
    return out, common, sets or ["auto"]


def run_set(out: pathlib.Path, index: int, common: list[str], words: str) -> dict | None:
    args = [word for word in words.split() if word != "auto"]
    path = out / f"set-{index}.json"
    cmd = ["fusedattn", "bench", "--decode", "--no-progress", "--methods", "fusedattn", "--json", str(path),
           *common, *args]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        print(f"set {index} ({words}) ran past 300 s", file=sys.stderr)
        return None
    if done.returncode != 0:
        print(f"set {index} ({words}) failed:\n{done.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(path.read_text())


def main() -> int:
    out, common, sets = parse(sys.argv[1:])
    out.mkdir(parents=True, exist_ok=True)
    runs = []  # (set index, words, result), in the order given
    for i, words in enumerate(sets, 1):
        run = run_set(out, i, common, words)
        print(f"[{i}/{len(sets)}] {words}: {'ok' if run else 'FAILED'}", flush=True)
        if run:
            runs.append((i, words, run))
    if not runs:
        return 1
    first = runs[0][2]
    rates: dict[tuple, dict[int, float]] = {}  # row -> set index -> TB/s
    for i, _, run in runs:
        c = run["config"]
        for r in run["rows"]:
            key = (r["dtype"], c["batch"], c["heads"], c["kv_heads"], c["head_dim"],
                   "1..N" if r["varlen"] else "all N", r["seqlen"])
            res = r["results"]["fusedattn"]
            if res.get("status", "ok") == "ok":
                rates.setdefault(key, {})[i] = res["tb_per_s"]
    names = {i: f"{i}: {words}" for i, words, _ in runs}
    lines = [f"{first['device']}, torch {first['torch']}, {first['date']}; fusedattn TB/s; "
             f"common arguments: {' '.join(common) or '-'}", "",
             "| dtype | B | Hq | Hkv | d | lengths | N | " + " | ".join(names.values()) + " | best |",
             "|" + "---|" * (8 + len(names))]
    for key, row in rates.items():
        best = max(row, key=row.get)
        cells = [f"{row[i]:.2f}" if i in row else "-" for i in names]
        lines.append("| " + " | ".join(map(str, key)) + " | " + " | ".join(cells) + f" | {names[best]} |")
    text = "\n".join(lines) + "\n"
    (out / "sweep.md").write_text(text)
    print(text)
    return 0 if len(runs) == len(sets) else 1


if __name__ == "__main__":
    sys.exit(main())
