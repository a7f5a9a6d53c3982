"""Run the nodemedic benchmarks, print a table of figures against their targets, exit 1 if any is missed."""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Sequence

# Run as a script (`python benchmarks/run.py`): the sibling modules import each other by bare name.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import deep  # noqa: E402
import idle  # noqa: E402
import kube  # noqa: E402
import latency  # noqa: E402
import nvml  # noqa: E402
import recovery  # noqa: E402
import slurm  # noqa: E402
import storm  # noqa: E402
import throughput  # noqa: E402
from harness import FULL, QUICK, Result, Sizes  # noqa: E402

BENCHMARKS: dict[str, ModuleType] = {m.NAME: m for m in (latency, throughput, storm, nvml, kube, slurm, recovery, deep, idle)}
HEADER = ("BENCHMARK", "METRIC", "VALUE", "TARGET", "RESULT")


def _verdict(r: Result) -> str:
    return "-" if r.passed is None else ("PASS" if r.passed else "FAIL")


def run_one(name: str, sizes: Sizes) -> list[Result]:
    """One benchmark's rows; a crash becomes a single FAIL row rather than ending the run."""
    started = time.monotonic()
    print(f"running {name} ...", file=sys.stderr, flush=True)
    try:
        results = BENCHMARKS[name].run(sizes)
    except Exception as exc:  # noqa: BLE001 - one broken benchmark must not hide the others' figures
        traceback.print_exc(file=sys.stderr)
        results = [Result(name, "completed", f"error: {type(exc).__name__}: {str(exc)[:200]}", "no error", False)]
    print(f"  {name} took {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
    return results


def print_table(results: list[Result]) -> None:
    rows = [HEADER, *((r.bench, r.metric, r.value, r.target or "-", _verdict(r)) for r in results)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER))]
    for i, row in enumerate(rows):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    p.add_argument("--only", action="append", choices=sorted(BENCHMARKS), metavar="NAME",
                   help=f"run only this benchmark (repeatable): {', '.join(BENCHMARKS)}")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = QUICK if args.quick else FULL
    names = [n for n in BENCHMARKS if not args.only or n in args.only]
    started = time.monotonic()
    results = [r for name in names for r in run_one(name, sizes)]
    print(f"\nnodemedic benchmarks ({'quick' if args.quick else 'full'}): Python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs, {time.monotonic() - started:.0f} s\n")
    print_table(results)
    missed = [r for r in results if r.passed is False]
    print(f"\n{len(missed)} target(s) missed" if missed else "\nall targets met")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
