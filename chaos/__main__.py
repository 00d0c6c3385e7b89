"""``python -m chaos --seed 7 --duration 600 [--db sqlite|postgres]``: exit 0
only with no violation, no canary leak and (when the duration allows) every
fault kind really injected."""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

from chaos.faults import KINDS
from chaos.harness import Session


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--duration", type=float, default=600, help="seconds of faults")
    parser.add_argument("--db", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("--workdir", type=Path, default=None, help="kept for inspection")
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="roundtable-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    outcome = asyncio.run(Session(args.seed, args.duration, args.db, workdir).run())

    print("\nfaults injected, by kind:")
    for kind in KINDS:
        print(f"  {kind:24} {outcome.faults.get(kind, 0)}")
    for note in outcome.notes:
        print(note)
    for run in outcome.unsettled:
        print(f"unsettled: {run}")
    for violation in outcome.violations:
        print(f"VIOLATION {violation}")
    for leak in outcome.leaks:
        print(f"CANARY LEAK {leak}")
    if outcome.missing_kinds:
        print(f"NOT INJECTED: {', '.join(outcome.missing_kinds)}")
    print(outcome.summary)
    print(f"workdir: {workdir}")
    return 0 if outcome.ok else 1


if __name__ == "__main__":
    sys.exit(main())
