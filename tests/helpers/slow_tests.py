"""Regenerate tests/slow_tests.txt from a `pytest --durations=0` report of the fast run.

    python -m pytest -m "not slow" --durations=0 -q > durations.txt
    python tests/helpers/slow_tests.py durations.txt [--threshold 0.4]

Tests whose call + setup took longer than the threshold are listed (the ones already listed
stay listed: they no longer run in the fast run, so the report cannot time them).
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import re

LIST = pathlib.Path(__file__).resolve().parent.parent / "slow_tests.txt"
LINE = re.compile(r"([\d.]+)s (call|setup|teardown)\s+(\S.*?)\s*$")  # ids may hold spaces: test[a b]


def read_list(path: pathlib.Path = LIST) -> tuple[list[str], set[str]]:
    """(header comment lines, test node ids)."""
    header, ids = [], set()
    for line in path.read_text().splitlines() if path.exists() else []:
        if line.startswith("#"):
            header.append(line)
        elif line.strip():
            ids.add(line.strip())
    return header, ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("durations")
    ap.add_argument("--threshold", type=float, default=0.4)
    args = ap.parse_args()
    spent: collections.Counter = collections.Counter()
    for line in pathlib.Path(args.durations).read_text().splitlines():
        m = LINE.match(line)
        if m:
            spent[m.group(3)] += float(m.group(1))
    header, ids = read_list()
    ids |= {t for t, s in spent.items() if s > args.threshold}
    LIST.write_text("\n".join(header + sorted(ids)) + "\n")
    print(f"{len(ids)} tests listed in {LIST}")


if __name__ == "__main__":
    main()
