"""Integer selectors for steps and layers: "0,1,4-6", a list of ints, or empty.

A Selector keeps inclusive ranges, never the expanded set: "0-1000000000"
parses instantly, uses no memory, and prints back as a range.
"""
from __future__ import annotations

import bisect
from typing import Iterable, Iterator


class Selector:
    """An immutable set of non-negative integers held as sorted, disjoint, inclusive ranges."""

    __slots__ = ("ranges", "_starts")

    def __init__(self, ranges: Iterable[tuple[int, int]] = ()):
        merged: list[tuple[int, int]] = []
        for lo, hi in sorted(ranges):
            if merged and lo <= merged[-1][1] + 1:
                merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
            else:
                merged.append((lo, hi))
        self.ranges: tuple[tuple[int, int], ...] = tuple(merged)
        self._starts = [lo for lo, _ in merged]

    @classmethod
    def of(cls, values: Iterable[int]) -> "Selector":
        return cls((v, v) for v in values)

    def __contains__(self, i) -> bool:
        if isinstance(i, bool) or not isinstance(i, int):
            return False
        j = bisect.bisect_right(self._starts, i) - 1
        return j >= 0 and self.ranges[j][0] <= i <= self.ranges[j][1]

    def __bool__(self) -> bool:
        return bool(self.ranges)

    def __len__(self) -> int:
        return sum(hi - lo + 1 for lo, hi in self.ranges)

    def __iter__(self) -> Iterator[int]:
        for lo, hi in self.ranges:
            yield from range(lo, hi + 1)

    def at_least(self, n: int) -> "Selector":
        """The part of this selector that is >= n (e.g. layers a model does not have)."""
        return Selector((max(lo, n), hi) for lo, hi in self.ranges if hi >= n)

    def __eq__(self, other) -> bool:
        if isinstance(other, Selector):
            return self.ranges == other.ranges
        if isinstance(other, (set, frozenset)):
            return all(isinstance(v, int) for v in other) and self.ranges == Selector.of(other).ranges
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.ranges)

    def __str__(self) -> str:
        return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in self.ranges)

    def __repr__(self) -> str:
        return f"Selector({str(self)!r})"


def parse_selector(value, *, what: str = "selector") -> Selector:
    """Parse `value` into a Selector.

    Accepts None / "" (empty), an int, a string of comma-separated integers and
    inclusive ranges ("0,1,4-6", whitespace tolerated; ASCII digits only), a
    Selector, or a list/tuple/set of ints or such strings. Anything else raises
    ValueError quoting the bad token, the whole selector and the key (`what`).
    """
    if value is None:
        return Selector()
    if isinstance(value, Selector):
        return value
    if isinstance(value, bool):
        raise ValueError(f"invalid {what} {value!r}: expected integers like '0,1,4-6'")
    if isinstance(value, int):
        return Selector([(_check_int(value, str(value), value, what),) * 2])
    if isinstance(value, str):
        return _parse_string(value, what)
    if isinstance(value, Iterable):
        items = list(value)
        ranges: list[tuple[int, int]] = []
        for item in items:
            if isinstance(item, bool) or not isinstance(item, (int, str)):
                raise ValueError(f"invalid token {item!r} in {what} {items!r}: expected an integer or 'a-b' range")
            if isinstance(item, str):
                ranges.extend(_parse_string(item, what).ranges)
            else:
                i = _check_int(item, str(item), items, what)
                ranges.append((i, i))
        return Selector(ranges)
    raise ValueError(f"invalid {what} {value!r}: expected integers like '0,1,4-6' or a list of ints")


def _check_int(i: int, token: str, whole, what: str) -> int:
    if i < 0:
        raise ValueError(f"invalid token {token!r} in {what} {whole!r}: indices must be >= 0")
    return i


def _parse_int(token: str, whole: str, what: str) -> int:
    t = token.strip()
    # isdigit() alone accepts '²' and other scripts' digits: only ASCII 0-9 are integers here
    if not (t.isascii() and t.isdigit()):
        raise ValueError(
            f"invalid token {t!r} in {what} {whole!r}: expected a non-negative integer (ASCII digits) "
            "or an inclusive range 'a-b'"
        )
    return int(t)


def _parse_string(text: str, what: str) -> Selector:
    if not text.strip():
        return Selector()
    ranges: list[tuple[int, int]] = []
    for raw in text.split(","):
        token = raw.strip()
        if not token:
            raise ValueError(f"invalid empty token in {what} {text!r}: remove the stray comma")
        if "-" in token[1:]:  # a range "a-b"; a leading '-' is a negative number
            lo_s, hi_s = token.split("-", 1)
            if not lo_s.strip() or not hi_s.strip():
                raise ValueError(f"invalid token {token!r} in {what} {text!r}: a range needs both ends, like '4-6'")
            lo, hi = _parse_int(lo_s, text, what), _parse_int(hi_s, text, what)
            if hi < lo:
                raise ValueError(f"invalid token {token!r} in {what} {text!r}: range end {hi} is below its start {lo}")
            ranges.append((lo, hi))
        else:
            i = _parse_int(token, text, what)
            ranges.append((i, i))
    return Selector(ranges)


def format_selector(values) -> str:
    """Inverse of parse_selector: {0,1,2,5} -> "0-2,5"."""
    return str(values if isinstance(values, Selector) else Selector.of(values))
