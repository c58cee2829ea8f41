"""Integer selectors for steps and layers: "0,1,4-6", a list of ints, or empty.

A Selector keeps inclusive ranges, never the expanded set: "0-1000000000"
parses instantly, uses no memory, and prints back as a range.

Step selectors (parse_selector(..., relative=True)) also take tokens relative to
the run: "first:k" (steps 0..k-1) and "last:k" (the last k steps of the run),
mixable with absolute ones ("first:2,last:2", "0,last:3"). "last:k" needs the
run's number of steps (fx_fp8.steps publishes it next to the step): such a
selector answers membership through contains(step, total) or resolve(total).
"""

from __future__ import annotations

import bisect
from typing import Iterable, Iterator, Optional

from fx_fp8.config.values import did_you_mean, short_repr

#: tokens relative to the run (step selectors only): first:k, last:k
RELATIVE_TOKENS = ("first", "last")


class Selector:
    """An immutable set of non-negative integers held as sorted, disjoint, inclusive ranges.

    `first` (k of "first:k") is held in `ranges` as 0..k-1 and kept only to print the selector
    as written; `last` (k of "last:k") selects the last k steps of a run, known only with the
    run's number of steps: a selector with `last` has no membership of its own (`in`, iter,
    len raise naming `what`, its key) and answers through contains(step, total) / resolve(total).
    """

    __slots__ = ("ranges", "_starts", "first", "last", "what")

    def __init__(
        self, ranges: Iterable[tuple[int, int]] = (), *, first: int = 0, last: int = 0, what: str = "selector"
    ):
        ranges = list(ranges)
        if first:
            ranges.append((0, first - 1))
        merged: list[tuple[int, int]] = []
        for lo, hi in sorted(ranges):
            if merged and lo <= merged[-1][1] + 1:
                merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
            else:
                merged.append((lo, hi))
        self.ranges: tuple[tuple[int, int], ...] = tuple(merged)
        self._starts = [lo for lo, _ in merged]
        self.first, self.last, self.what = first, last, what

    @classmethod
    def of(cls, values: Iterable[int]) -> "Selector":
        return cls((v, v) for v in values)

    @property
    def needs_total(self) -> bool:
        """Does membership depend on the run's number of steps ("last:k")?"""
        return self.last > 0

    def _absolute(self, op: str) -> None:
        if self.last:
            raise ValueError(
                f"{self.what} {short_repr(str(self))} counts from the end of the run (last:{self.last}): "
                f"{op} needs the run's number of steps; use .contains(step, total) or .resolve(total)"
            )

    def _has(self, i: int) -> bool:
        j = bisect.bisect_right(self._starts, i) - 1
        return j >= 0 and self.ranges[j][0] <= i <= self.ranges[j][1]

    def __contains__(self, i) -> bool:
        self._absolute("`in`")
        if isinstance(i, bool) or not isinstance(i, int):
            return False
        return self._has(i)

    def contains(self, step: int, total: Optional[int]) -> bool:
        """Is `step` selected in a run of `total` steps? `total` may be None only when nothing
        counts from the end (no "last:k"); ValueError naming the key otherwise."""
        if self.last:
            if total is None:
                raise ValueError(
                    f"fx_fp8: {self.what} {short_repr(str(self))} counts from the end of the run (last:{self.last}) but no "
                    f"number of steps was published: publish it with fx_fp8.set_step(i, total=N) or `with "
                    f"fx_fp8.denoising_step(i, total=N):` (fx_fp8.compile_pipeline publishes it from the "
                    f"scheduler), or use absolute steps"
                )
            if step >= total:
                raise ValueError(
                    f"fx_fp8: denoising step {step} is past the run's {total} steps (0-{total - 1}), "
                    f"so {self.what} {short_repr(str(self))} cannot place it: publish the step and the run's "
                    "number of steps that agree"
                )
            if step >= total - self.last:
                return True
        return self._has(step)

    def resolve(self, total: int) -> "Selector":
        """The absolute selector of a run of `total` steps ("first:2,last:2", 10 -> "0-1,8-9");
        absolute steps past the run are kept (they select nothing in it)."""
        if isinstance(total, bool) or not isinstance(total, int) or total < 1:
            raise ValueError(
                f"invalid number of steps {short_repr(total)} to resolve {self.what} {short_repr(str(self))}: "
                "expected an integer >= 1"
            )
        tail = [(max(total - self.last, 0), total - 1)] if self.last else []
        return Selector([*self.ranges, *tail], what=self.what)

    def __bool__(self) -> bool:
        return bool(self.ranges) or self.last > 0

    def __len__(self) -> int:
        self._absolute("len()")
        return sum(hi - lo + 1 for lo, hi in self.ranges)

    def __iter__(self) -> Iterator[int]:
        self._absolute("iterating")
        for lo, hi in self.ranges:
            yield from range(lo, hi + 1)

    def at_least(self, n: int) -> "Selector":
        """The part of this selector that is >= n (e.g. layers a model does not have)."""
        self._absolute("at_least()")
        return Selector(((max(lo, n), hi) for lo, hi in self.ranges if hi >= n), what=self.what)

    def __eq__(self, other) -> bool:
        if isinstance(other, Selector):
            return self.ranges == other.ranges and self.last == other.last
        if isinstance(other, (set, frozenset)):
            return not self.last and all(isinstance(v, int) for v in other) and self.ranges == Selector.of(other).ranges
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.ranges, self.last))

    def __str__(self) -> str:
        ranges = self.ranges
        parts = []
        if self.first:  # printed as written; the ranges past first:k follow it
            parts.append(f"first:{self.first}")
            ranges = tuple((max(lo, self.first), hi) for lo, hi in ranges if hi >= self.first)
        parts += [str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in ranges]
        if self.last:
            parts.append(f"last:{self.last}")
        return ",".join(parts)

    def __repr__(self) -> str:
        return f"Selector({str(self)!r})"


def parse_selector(value, *, what: str = "selector", relative: bool = False) -> Selector:
    """Parse `value` into a Selector.

    Accepts None / "" (empty), an int, a string of comma-separated integers and
    inclusive ranges ("0,1,4-6", whitespace tolerated; ASCII digits only), a
    Selector, or a list/tuple/set of ints or such strings. With `relative` (step
    selectors) also "first:k" and "last:k" (k >= 1). Anything else raises
    ValueError quoting the bad token, the whole selector and the key (`what`).
    """
    if value is None:
        return Selector(what=what)
    if isinstance(value, Selector):
        if value.last and not relative:
            raise ValueError(f"invalid {what} {short_repr(str(value))}: last:{value.last} selects denoising steps only")
        return value if value.what == what else Selector(value.ranges, first=value.first, last=value.last, what=what)
    if isinstance(value, bool):
        raise ValueError(f"invalid {what} {short_repr(value)}: expected integers like '0,1,4-6'")
    if isinstance(value, int):
        return Selector([(_check_int(value, str(value), value, what),) * 2], what=what)
    if isinstance(value, str):
        return _build(_parse_string(value, what, relative), what)
    if isinstance(value, Iterable):
        items = list(value)
        parts = _Parts()
        for item in items:
            if isinstance(item, bool) or not isinstance(item, (int, str)):
                raise ValueError(
                    f"invalid token {short_repr(item)} in {what} {short_repr(items)}: expected an integer or 'a-b' range"
                )
            if isinstance(item, str):
                parts.merge(_parse_string(item, what, relative))
            else:
                i = _check_int(item, str(item), items, what)
                parts.ranges.append((i, i))
        return _build(parts, what)
    raise ValueError(f"invalid {what} {short_repr(value)}: expected integers like '0,1,4-6' or a list of ints")


class _Parts:
    """What the tokens of one selector said: absolute ranges, first:k, last:k (the largest k wins)."""

    def __init__(self):
        self.ranges: list[tuple[int, int]] = []
        self.first = self.last = 0

    def merge(self, other: "_Parts") -> None:
        self.ranges += other.ranges
        self.first, self.last = max(self.first, other.first), max(self.last, other.last)


def _build(parts: _Parts, what: str) -> Selector:
    return Selector(parts.ranges, first=parts.first, last=parts.last, what=what)


def _check_int(i: int, token: str, whole, what: str) -> int:
    if i < 0:
        raise ValueError(f"invalid token {short_repr(token)} in {what} {short_repr(whole)}: indices must be >= 0")
    return i


def _parse_int(token: str, whole: str, what: str) -> int:
    t = token.strip()
    # isdigit() alone accepts '²' and other scripts' digits: only ASCII 0-9 are integers here
    if not (t.isascii() and t.isdigit()):
        raise ValueError(
            f"invalid token {short_repr(t)} in {what} {short_repr(whole)}: expected a non-negative integer (ASCII digits) "
            "or an inclusive range 'a-b'"
        )
    return int(t)


def _parse_relative(token: str, whole: str, what: str, relative: bool) -> tuple[str, int]:
    """ "first:2" -> ("first", 2), naming the key and the token when it is not one."""
    name, _, count = (p.strip() for p in token.partition(":"))
    if not relative:
        raise ValueError(
            f"invalid token {short_repr(token)} in {what} {short_repr(whole)}: first:k / last:k select denoising steps "
            "only; give integers or ranges like '0,1,4-6'"
        )
    if name not in RELATIVE_TOKENS:
        raise ValueError(
            f"invalid token {short_repr(token)} in {what} {short_repr(whole)}: unknown relative token {short_repr(name)}"
            f"{did_you_mean(name, RELATIVE_TOKENS)}; expected first:k or last:k"
        )
    if not (count.isascii() and count.isdigit()) or int(count) < 1:
        raise ValueError(
            f"invalid token {short_repr(token)} in {what} {short_repr(whole)}: expected {name}:k with k an integer >= 1 "
            f"(the {name} k steps of the run)"
        )
    return name, int(count)


def _parse_string(text: str, what: str, relative: bool = False) -> _Parts:
    parts = _Parts()
    if not text.strip():
        return parts
    for raw in text.split(","):
        token = raw.strip()
        if not token:
            raise ValueError(f"invalid empty token in {what} {short_repr(text)}: remove the stray comma")
        if ":" in token:
            name, k = _parse_relative(token, text, what, relative)
            setattr(parts, name, max(getattr(parts, name), k))
        elif "-" in token[1:]:  # a range "a-b"; a leading '-' is a negative number
            lo_s, hi_s = token.split("-", 1)
            if not lo_s.strip() or not hi_s.strip():
                raise ValueError(
                    f"invalid token {short_repr(token)} in {what} {short_repr(text)}: a range needs both ends, like '4-6'"
                )
            lo, hi = _parse_int(lo_s, text, what), _parse_int(hi_s, text, what)
            if hi < lo:
                raise ValueError(
                    f"invalid token {short_repr(token)} in {what} {short_repr(text)}: range end {hi} is below its start {lo}"
                )
            parts.ranges.append((lo, hi))
        else:
            i = _parse_int(token, text, what)
            parts.ranges.append((i, i))
    return parts


def step_patterns(a: Selector, b: Selector) -> set[tuple[bool, bool]]:
    """The (in a, in b) pairs some step of some run can have, for step selectors of which at least
    one counts from the end ("last:k"). Which pairs a run of N steps shows changes only where N,
    N - a.last or N - b.last crosses a fixed boundary (0, an absolute range's end, first:k), so
    the runs of N around those points (and one longer than all) show every pair; each run is
    checked range by range, never step by step."""
    fixed = {0} | {e for sel in (a, b) for lo, hi in sel.ranges for e in (lo, hi + 1)}
    offsets = {0, a.last, b.last}
    critical = {p + c for p in fixed for c in offsets}
    totals = {n for v in critical for n in (v - 1, v, v + 1) if n >= 1} | {max(critical) + 1}
    out: set[tuple[bool, bool]] = set()
    for n in totals:
        ra, rb = a.resolve(n), b.resolve(n)
        # every step of a segment between two boundaries is in the same selectors as the segment's start
        starts = sorted({0} | {e for sel in (ra, rb) for lo, hi in sel.ranges for e in (lo, hi + 1) if e < n})
        out.update((ra.contains(s, n), rb.contains(s, n)) for s in starts)
    return out


def format_selector(values) -> str:
    """Inverse of parse_selector: {0,1,2,5} -> "0-2,5"."""
    return str(values if isinstance(values, Selector) else Selector.of(values))
