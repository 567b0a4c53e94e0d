"""The installed fusedattn's decode table under several settings, side by side.

    python3 scripts/decode_sweep.py OUTDIR [common bench args] -- SET [-- SET ...]

Each SET is a space-separated string of NAME=value words (the bench's
environment, e.g. "FUSEDATTN_DECODE_SPLITS=2 FUSEDATTN_DECODE_CLUSTER_MERGE=0")
and bench arguments (e.g. "--batch 16"); "auto" is an empty set. Every set
runs `fusedattn bench --decode --methods fusedattn` once, with the common
arguments first. OUTDIR gets one JSON per set and sweep.md: TB/s per row and
set, and each row's best set. The ab_bench.sh habit for one build: the
settings of a rule (splits, merge path, batch) measured in the same minutes.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys


def parse(argv: list[str]) -> tuple[pathlib.Path, list[str], list[str]]:
    if len(argv) < 3 or "--" not in argv:
        sys.exit(__doc__)
    out = pathlib.Path(argv[0])
    split = argv.index("--")
    common = argv[1:split]
    sets = [s for s in argv[split + 1:] if s != "--"]
    return out, common, sets or ["auto"]


def run_set(out: pathlib.Path, index: int, common: list[str], words: str) -> dict | None:
    env, args = dict(os.environ), []
    for word in words.split():
        if word == "auto":
            continue
        name, eq, value = word.partition("=")
        if eq and name.isupper():
            env[name] = value
        else:
            args.append(word)
    path = out / f"set-{index}.json"
    cmd = ["fusedattn", "bench", "--decode", "--no-progress", "--methods", "fusedattn", "--json", str(path),
           *common, *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        print(f"set {index} ({words}) failed:\n{done.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(path.read_text())


def label(words: str) -> str:
    return words.replace("FUSEDATTN_DECODE_", "")


def main() -> int:
    out, common, sets = parse(sys.argv[1:])
    out.mkdir(parents=True, exist_ok=True)
    runs = {}
    for i, words in enumerate(sets, 1):
        runs[words] = run_set(out, i, common, words)
        print(f"[{i}/{len(sets)}] {words}: {'ok' if runs[words] else 'FAILED'}", flush=True)
    done = {k: v for k, v in runs.items() if v}
    if not done:
        return 1
    first = next(iter(done.values()))
    rates: dict[tuple, dict[str, float]] = {}
    for words, run in done.items():
        for r in run["rows"]:
            key = (run["config"]["batch"], run["config"]["kv_heads"], "1..N" if r["varlen"] else "all N",
                   r["seqlen"])
            res = r["results"]["fusedattn"]
            if res.get("status", "ok") == "ok":
                rates.setdefault(key, {})[words] = res["tb_per_s"]
    lines = [f"{first['device']}, torch {first['torch']}, {first['date']}; fusedattn TB/s; "
             f"common arguments: {' '.join(common) or '-'}", "",
             "| B | kv heads | lengths | N | " + " | ".join(map(label, done)) + " | best |",
             "|" + "---|" * (5 + len(done))]
    for key, row in rates.items():
        best = max(row, key=row.get)
        cells = [f"{row[w]:.2f}" if w in row else "-" for w in done]
        lines.append("| " + " | ".join(map(str, key)) + " | " + " | ".join(cells) + f" | {label(best)} |")
    text = "\n".join(lines) + "\n"
    (out / "sweep.md").write_text(text)
    print(text)
    return 0 if len(done) == len(sets) else 1


if __name__ == "__main__":
    sys.exit(main())
