"""How much `import fx_fp8` adds to `import torch`, and how long `fx-fp8 --help` takes.

Each round starts a fresh interpreter that imports torch, then fx_fp8, timing both in that one
process (the ratio is (torch + fx_fp8) / torch: the machine's load cancels out), and lists the
heavy modules the import pulled in (none of diffusers, Triton, matplotlib, tabulate, RE2, sympy,
torch._dynamo is expected). `fx-fp8 --help` is timed end to end, interpreter start included.
The target: ratio at most 1.3, --help under 3 s.

    OMP_NUM_THREADS=1 python benchmarks/import_time.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HEAVY = (
    "diffusers",
    "transformers",
    "triton",
    "matplotlib",
    "tabulate",
    "re2",
    "sympy",
    "torch._dynamo",
    "torch._inductor",
)

PROBE = f"""
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import fx_fp8
t2 = time.perf_counter()
print(json.dumps({{"torch": t1 - t0, "fx_fp8": t2 - t1,
                  "heavy": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""


def one_import() -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def one_help() -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "fx_fp8", "--help"], check=True, capture_output=True)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"invalid --rounds {args.rounds}: expected a positive integer")
    rows = [one_import() for _ in range(args.rounds)]
    helps = [one_help() for _ in range(args.rounds)]
    ratios = [(r["torch"] + r["fx_fp8"]) / r["torch"] for r in rows]
    print(
        f"machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}"
    )
    print(f"import torch   median {statistics.median(r['torch'] for r in rows):.3f} s")
    print(f"import fx_fp8  median {statistics.median(r['fx_fp8'] for r in rows):.3f} s (after torch)")
    print(
        f"ratio (torch + fx_fp8) / torch: median {statistics.median(ratios):.3f}, max {max(ratios):.3f} (target <= 1.3)"
    )
    print(f"fx-fp8 --help: median {statistics.median(helps):.2f} s, max {max(helps):.2f} s (target < 3 s)")
    heavy = sorted({m for r in rows for m in r["heavy"]})
    print(f"heavy modules imported by `import fx_fp8`: {', '.join(heavy) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
