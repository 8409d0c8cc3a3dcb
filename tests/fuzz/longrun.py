"""The long fuzz run: the same property as ``test_properties`` over millions of seeded inputs.

    python -m tests.fuzz.longrun --inputs 1000000 [--target evergreen ...] [--first-seed 0]

For each target, inputs come from seeds ``first_seed .. first_seed + inputs - 1`` (so any
failure reproduces from its seed with ``targets.run_one``). Prints one line per target with
the counts by kind (valid / hostile / raw: inputs, accepted) and every failure's seed and
text; exits 1 when any input broke the property.
"""

from __future__ import annotations

import argparse
import sys
import time

from tests.fuzz import targets

PROGRESS_EVERY = 100_000
"""Inputs between two progress lines (a cut-short run still reports its counts)."""


def run(name: str, num_inputs: int, first_seed: int, max_failures: int = 20) -> list[str]:
    """Run ``num_inputs`` inputs of target ``name``; print its counts; return the failures."""
    stats = targets.Stats()
    failures: list[str] = []
    started = time.monotonic()
    for seed in range(first_seed, first_seed + num_inputs):
        try:
            targets.run_one(name, seed, stats)
        except AssertionError as exc:
            stats.num_inputs += 1
            failures.append(str(exc))
            print(f"  FAIL {exc}", flush=True)
            if len(failures) >= max_failures:
                break
        if stats.num_inputs % PROGRESS_EVERY == 0:
            _report(name, stats, failures, started, "so far")
    _report(name, stats, failures, started, "done")
    return failures


def _report(name: str, stats: targets.Stats, failures: list[str], started: float, label: str) -> None:
    kinds = ", ".join(f"{kind} {n:,}/{ok:,} accepted" for kind, (n, ok) in sorted(stats.by_kind.items()))
    print(
        f"{name} ({label}): {stats.num_inputs:,} inputs in {time.monotonic() - started:.0f} s, "
        f"{len(failures)} failures ({kinds})",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    """Command line entry point (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=1_000_000, help="inputs per target")
    parser.add_argument("--first-seed", type=int, default=10**9, help="first seed")
    parser.add_argument("--target", action="append", choices=list(targets.TARGETS), help="target(s); default: all")
    args = parser.parse_args(argv)
    failed = False
    for name in args.target or list(targets.TARGETS):
        failed |= bool(run(name, args.inputs, args.first_seed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
