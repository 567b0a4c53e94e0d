"""Markdown tables for README.md's Performance section from `fusedattn bench` JSON.

    python lab/readme_tables.py forward docs/bench/readme/h200-...-forward-d128.json [...]
    python lab/readme_tables.py decode docs/bench/readme/h200-...-decode-mha.json [...]
    python lab/readme_tables.py cpu docs/bench/readme/cpu-...json
    python lab/readme_tables.py mask FORWARD.json BACKWARD.json   (`fusedattn bench --mask`, then --backward)
    python lab/readme_tables.py varlen FORWARD.json BACKWARD.json [...]   (`fusedattn bench --varlen`, pairs per d)

`forward` also takes --backward tables; `--dtype=float16` after the kind picks
the dtype shown (default bfloat16; `cpu` wants `--dtype=float32`). Each row shows
fusedattn's rate and its speed-up over every other method in the file (> 1:
fusedattn is faster), causal and not side by side; below the table, the range of
each speed-up per dtype, for the sentence that summarises the other dtypes.
"""

from __future__ import annotations

import json
import sys

SHORT = {"sdpa-cudnn": "cuDNN", "sdpa-flash": "FA2", "sdpa-efficient": "mem-eff", "sdpa": "SDPA",
         "naive": "naive", "sdpa-math": "math"}


def _n(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


ORDER = ["sdpa-cudnn", "sdpa-flash", "sdpa-efficient", "sdpa", "naive"]


def _others(result) -> list[str]:
    rest = [m for m in result["methods"] if m != "fusedattn"]
    return sorted(rest, key=lambda m: ORDER.index(m) if m in ORDER else len(ORDER))


def _load(paths):
    return [json.load(open(p)) for p in paths]


def attention_table(results, unit: str, scale: float, dtype: str) -> str:
    """Rows (d, N); a column group per causal setting: fusedattn's rate and x every other method."""
    others = _others(results[0])
    head = ["d", "N"]
    for causal in ("no", "yes"):
        head += [f"causal {causal}: {unit}"] + [f"x {SHORT.get(m, m)}" for m in others]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for res in results:
        cells = {(row["seqlen"], row["causal"]): row for row in res["rows"] if row["dtype"] == dtype}
        for n in sorted({n for n, _ in cells}):
            line = [str(res["config"]["head_dim"]), _n(n)]
            for causal in (False, True):
                row = cells.get((n, causal))
                line.append(f"{row['results']['fusedattn']['tflops'] * scale:.0f}" if row else "-")
                line += [f"{row['fusedattn_speedup'][m]:.2f}" if row and m in row["fusedattn_speedup"] else "-"
                         for m in others]
            lines.append("| " + " | ".join(line) + " |")
    return "\n".join(lines)


def speedup_ranges(results, dtype: str) -> str:
    """'x m lo-hi' over every row of one dtype, for the sentence under a table."""
    spans = {}
    for res in results:
        for row in res["rows"]:
            if row["dtype"] == dtype:
                for m, s in row["fusedattn_speedup"].items():
                    spans.setdefault(m, []).append(s)
    return ", ".join(f"x {SHORT.get(m, m)} {min(v):.2f}-{max(v):.2f}" for m, v in spans.items())


def decode_table(results) -> str:
    """One row per (heads, dtype, N): full caches against SDPA, then lengths drawn from [1, N]
    (fusedattn alone: SDPA has no per-sequence lengths)."""
    others = _others(results[0])
    head = ["Hq/Hkv", "dtype", "N", "TB/s"] + [f"{SHORT.get(m, m)} TB/s" for m in others] \
        + [f"x {SHORT.get(m, m)}" for m in others] + ["TB/s, lengths 1..N"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for res in results:
        c = res["config"]
        varlen = {(row["dtype"], row["seqlen"]): row for row in res["rows"] if row["varlen"]}
        for row in (row for row in res["rows"] if not row["varlen"]):
            r = row["results"]
            line = [f"{c['heads']}/{c['kv_heads']}", row["dtype"], _n(row["seqlen"]),
                    f"{r['fusedattn']['tb_per_s']:.2f}"]
            line += [f"{r[m]['tb_per_s']:.2f}" if r.get(m, {}).get("tb_per_s") else "n/a" for m in others]
            line += [f"{row['fusedattn_speedup'][m]:.2f}" if m in row["fusedattn_speedup"] else "-"
                     for m in others]
            v = varlen.get((row["dtype"], row["seqlen"]))
            line.append(f"{v['results']['fusedattn']['tb_per_s']:.2f}" if v else "-")
            lines.append("| " + " | ".join(line) + " |")
    return "\n".join(lines)


def mask_table(forward, backward) -> str:
    """Rows (mask, N): fusedattn given the BlockMask, forward and forward + backward, with
    x FlexAttention and x SDPA; `window=` (for windows) as the last column pair."""
    back = {(row["mask"], row["seqlen"]): row for row in backward["rows"]}

    def rate(row, m):
        r = row["results"].get(m, {}) if row else {}
        return r["tflops"] if r.get("status") == "ok" else None

    head = ["mask", "N", "visible", "forward TFLOP/s", "x Flex", "x SDPA", "fwd+bwd TFLOP/s", "x Flex", "x SDPA",
            "window= fwd, fwd+bwd x Flex"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in forward["rows"]:
        b = back.get((row["mask"], row["seqlen"]))
        line = [row["mask"], _n(row["seqlen"]), f"{row['visible_fraction']:.1%}"]
        for r in (row, b):
            ours = rate(r, "fusedattn-blockmask") if r else None
            line.append(f"{ours:.0f}" if ours else "-")
            line += [f"{ours / rate(r, m):.2f}" if ours and rate(r, m) else "-" for m in ("flex", "sdpa")]
        w = [rate(r, "fusedattn-window") / rate(r, "flex") for r in (row, b)
             if rate(r, "fusedattn-window") and rate(r, "flex")]
        line.append(" / ".join(f"{x:.2f}" for x in w) if w else "")
        lines.append("| " + " | ".join(line) + " |")
    return "\n".join(lines)


def varlen_table(pairs) -> str:
    """Rows (d, mix): fusedattn varlen, forward and forward + backward, with x FlexAttention's
    document mask, x SDPA on jagged tensors and x the dense causal kernel at the mix's rms length."""
    def rate(row, m):
        r = row["results"].get(m, {})
        return r["tflops"] if r.get("status") == "ok" else None

    anchors = ("flex-docs", "sdpa-jagged", "fusedattn-dense-rms")
    head = ["d", "mix", "forward TFLOP/s", "x Flex", "x jagged", "x dense", "fwd+bwd TFLOP/s", "x Flex", "x jagged",
            "x dense"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for forward, backward in pairs:
        back = {row["mix"]: row for row in backward["rows"] if "step" not in row}
        for row in (r for r in forward["rows"] if "step" not in r):
            line = [str(forward["config"]["head_dim"]), row["mix"]]
            for r in (row, back.get(row["mix"])):
                ours = rate(r, "fusedattn-varlen") if r else None
                line.append(f"{ours:.0f}" if ours else "-")
                line += [f"{ours / rate(r, m):.2f}" if ours and rate(r, m) else "-" for m in anchors]
            lines.append("| " + " | ".join(line) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("forward", "decode", "cpu", "mask", "varlen"):
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    if argv[0] == "varlen":
        if len(argv) < 3 or len(argv) % 2 != 1:
            print(__doc__.strip().splitlines()[6], file=sys.stderr)
            return 2
        results = _load(argv[1:])
        print(varlen_table(list(zip(results[::2], results[1::2]))))
        return 0
    if argv[0] == "mask":
        if len(argv) != 3:
            print(__doc__.strip().splitlines()[5], file=sys.stderr)
            return 2
        print(mask_table(*_load(argv[1:3])))
        return 0
    dtype = "bfloat16"
    if argv[1].startswith("--dtype="):
        dtype, argv = argv[1].split("=", 1)[1], argv[:1] + argv[2:]
    results = _load(argv[1:])
    if argv[0] == "decode":
        print(decode_table(results))
        return 0
    unit, scale = ("GFLOP/s", 1e3) if argv[0] == "cpu" else ("TFLOP/s", 1.0)
    print(attention_table(results, unit, scale, dtype))
    for other in dict.fromkeys(row["dtype"] for res in results for row in res["rows"]):
        print(f"\n{other}: {speedup_ranges(results, other)}")
    return 0
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
