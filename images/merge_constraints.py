"""Print constraints.txt with the pins of an overlay file in place of its own, minus dropped packages.

The vLLM images install vLLM, whose wheel metadata caps packages that constraints.txt pins higher for the
rest of the project (fastapi); pip fails on two pins of one package, so the overlay's pin must replace the
base one rather than be added beside it. Dropped packages (torch) are the ones the base image provides.

    python3 images/merge_constraints.py constraints.txt constraints-vllm.txt --drop torch > /tmp/c.txt
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

_PIN = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*(\S+)\s*$")


def canonical(name: str) -> str:
    """PEP 503 normalised project name (pip matches constraints by it)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(text: str) -> dict[str, str]:
    """name (canonical) -> pinned version, for every ``name==version`` line of a constraints file."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        m = _PIN.match(line.split("#", 1)[0])
        if m:
            out[canonical(m[1])] = m[2]
    return out


def merge(base: str, overlay: str, drop: tuple[str, ...] = ()) -> str:
    """``base`` without the lines the overlay re-pins or ``drop`` names, then the overlay's pins."""
    replaced = set(pins(overlay)) | {canonical(d) for d in drop}
    kept = []
    for line in base.splitlines():
        m = _PIN.match(line.split("#", 1)[0])
        if m and canonical(m[1]) in replaced:
            continue
        kept.append(line)
    added = [f"{name}=={version}" for name, version in pins(overlay).items() if name not in drop]
    return "\n".join([*kept, *added]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", type=Path)
    parser.add_argument("overlay", type=Path)
    parser.add_argument("--drop", action="append", default=[], help="a package the base image provides")
    args = parser.parse_args(argv)
    sys.stdout.write(merge(args.base.read_text(), args.overlay.read_text(), tuple(args.drop)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
