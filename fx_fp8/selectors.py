"""Integer selectors for steps and layers: "0,1,4-6", a list of ints, or empty."""
from __future__ import annotations

from typing import Iterable

def parse_selector(value, *, what: str = "selector") -> frozenset[int]:
    """Parse `value` into a frozenset of non-negative ints.

    Accepts None / "" (empty), an int, a string of comma-separated integers and
    inclusive ranges ("0,1,4-6", whitespace tolerated), or a list/tuple of ints or
    such strings. Anything else raises ValueError quoting the bad token and the
    whole selector.
    """
    if value is None:
        return frozenset()
    if isinstance(value, bool):
        raise ValueError(f"invalid {what} {value!r}: expected integers like '0,1,4-6'")
    if isinstance(value, int):
        return _check_int(value, str(value), value, what)
    if isinstance(value, str):
        return _parse_string(value, what)
    if isinstance(value, Iterable):
        out: set[int] = set()
        for item in value:
            if isinstance(item, bool) or not isinstance(item, (int, str)):
                raise ValueError(
                    f"invalid token {item!r} in {what} {list(value)!r}: expected an integer or 'a-b' range"
                )
            out |= parse_selector(item, what=what) if isinstance(item, str) else _check_int(item, str(item), value, what)
        return frozenset(out)
    raise ValueError(f"invalid {what} {value!r}: expected integers like '0,1,4-6' or a list of ints")


def _check_int(i: int, token: str, whole, what: str) -> frozenset[int]:
    if i < 0:
        raise ValueError(f"invalid token {token!r} in {what} {whole!r}: indices must be >= 0")
    return frozenset({i})


def _parse_int(token: str, whole: str, what: str) -> int:
    t = token.strip()
    if not t.isdigit():  # rejects "-1", "1.5", "a", "" and signs
        raise ValueError(
            f"invalid token {token.strip()!r} in {what} {whole!r}: expected a non-negative integer or an inclusive range 'a-b'"
        )
    return int(t)


def _parse_string(text: str, what: str) -> frozenset[int]:
    if not text.strip():
        return frozenset()
    out: set[int] = set()
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
            out.update(range(lo, hi + 1))
        else:
            out.add(_parse_int(token, text, what))
    return frozenset(out)


def format_selector(values: Iterable[int]) -> str:
    """Inverse of parse_selector: {0,1,2,5} -> "0-2,5"."""
    vals = sorted(set(values))
    parts, i = [], 0
    while i < len(vals):
        j = i
        while j + 1 < len(vals) and vals[j + 1] == vals[j] + 1:
            j += 1
        parts.append(str(vals[i]) if i == j else f"{vals[i]}-{vals[j]}")
        i = j + 1
    return ",".join(parts)
