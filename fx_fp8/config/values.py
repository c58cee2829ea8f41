"""Checks of single config values, shared by FP8Config and its nested settings: each returns the
normalised value or raises a ValueError naming the key and the bad value."""

from __future__ import annotations

import dataclasses
import difflib
import reprlib
from typing import Any, Mapping


_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 120
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 8
_SHORT.maxlevel = 3
#: the most characters of a value an error quotes
SHORT_REPR_CHARS = 400


def short_repr(value) -> str:
    """repr(value) abbreviated (reprlib: strings cut, at most 8 items a container and 3 levels,
    then SHORT_REPR_CHARS in all): a rejected value quoted in an error stays a line, and quoting it
    costs no more than its first items even when a YAML alias bomb made it billions of strings."""
    text = _SHORT.repr(value)
    return text if len(text) <= SHORT_REPR_CHARS else text[: SHORT_REPR_CHARS - 3] + "..."


def did_you_mean(key, known) -> str:
    """' (did you mean 'x'?)' for the known name closest to a misspelt key, or ''."""
    if len(str(key)) > 200:  # no key is that long: nothing to compare (difflib's time grows with it)
        return ""
    close = difflib.get_close_matches(str(key), [str(k) for k in known], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def closest(text: str, names, *, n: int = 1, cutoff: float = 0.6, variants=lambda name: [name]) -> list:
    """The `n` names most like `text`, best first: each name scores difflib's best ratio over its
    `variants` (the name itself by default), and only scores of at least `cutoff` count."""
    matcher = difflib.SequenceMatcher(b=text, autojunk=False)

    def score(name) -> float:
        best = 0.0
        for candidate in variants(name):
            matcher.set_seq1(candidate)
            if matcher.real_quick_ratio() > best and matcher.quick_ratio() > best:
                best = max(best, matcher.ratio())
        return best

    scored = sorted(((score(name), name) for name in names), key=lambda t: (-t[0], t[1]))
    return [name for s, name in scored[:n] if s >= cutoff]


def check_known_key(key, known, what: str, where: str = "") -> None:
    """Raise a ValueError for a key `known` lacks:
    "unknown <what> key 'x'<where> (did you mean 'y'?); known keys: [...]"."""
    if key not in known:
        raise ValueError(
            f"unknown {what} key {short_repr(key)}{where}{did_you_mean(key, known)}; known keys: {sorted(known)}"
        )


def check_choice(name: str, value, choices) -> Any:
    if isinstance(value, str):
        value = value.strip().lower()
        if value in ("none", "null", ""):
            value = None
    if value not in choices:
        shown = ", ".join(repr(c) for c in choices)
        raise ValueError(f"invalid {name} {short_repr(value)}: expected one of {shown}")
    return value


def is_off(value) -> bool:
    """None / "none" / "auto" / "": the value that switches a feature off."""
    return value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null", "", "auto"))


def check_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"invalid {name} {short_repr(value)}: expected an integer >= {minimum}")
    return value


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"invalid {name} {short_repr(value)}: expected true or false")
    return value


def dataclass_from_mapping(cls, data: Mapping[str, Any] | None, where: str, synonyms=()):
    """Build a dataclass from a mapping, refusing unknown keys with a hint. synonyms: keys `cls`
    takes besides its fields (named among the known keys, passed on to it)."""
    if data is None:
        return cls()
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        raise ValueError(f"invalid {where} {short_repr(data)}: expected a mapping")
    names = {f.name for f in dataclasses.fields(cls)} | set(synonyms)
    for key in data:
        if key not in names:
            raise ValueError(
                f"unknown key {short_repr(key)} in {where}{did_you_mean(key, names)}; known keys: {sorted(names)}"
            )
    return cls(**dict(data))
