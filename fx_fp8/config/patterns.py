r"""Module-name patterns for ignored_layers (one parser, used by the config, the passes and prepare_model).

Rules, checked in this order for each pattern:
  1. "re:<regex>"  - the regular expression must match the whole module name.
  2. a glob (contains *, ? or [) - fnmatch against the whole name.
  3. a plain name  - matches any run of whole dotted components:
     "img_mlp" matches "transformer_blocks.7.img_mlp.net.0.proj",
     "attn.to_q" matches "blocks.0.attn.to_q", but "mlp" does not match "img_mlp".
  4. "preset:<name>" - a named set of patterns (PRESETS), e.g. "preset:vllm-omni-flux".
A module is ignored if any pattern matches it (patterns never cancel each other).
Given as one string ("a, re:b{1,2}"), patterns are separated by the commas outside brackets: a
comma inside {...}, [...] or (...) belongs to its pattern, so a `re:` pattern stays whole.

No regular expression can stall a compile: `re:` patterns run on RE2 (the google-re2 package),
which reads each character of a name once whatever the pattern's shape. Python's backtracking re
takes exponential time to fail on "(a+)+z" (minutes to years for one module name). A pattern is
first checked by Python's re (its syntax errors are the familiar ones), then compiled by RE2; what
RE2 lacks (backreferences, lookaround, atomic groups, possessive repeats, \Z, some inline flags)
is refused when the config is validated, naming the pattern. RE2's \d \w \s \b are ASCII.
"""

from __future__ import annotations

import fnmatch
import functools
import re
import warnings
from typing import Iterable, Optional

import re2

from fx_fp8.config.values import closest, short_repr

#: named sets of ignored_layers patterns ("preset:<name>")
PRESETS: dict[str, tuple[str, ...]] = {
    # vLLM-Omni keeps every FLUX dual-stream block in BF16 (FP8 on the joint-attention path was
    # visibly noisy on FLUX.1 with per-tensor weight scales); fx_fp8 quantizes them by default
    "vllm-omni-flux": ("re:transformer_blocks\\..*",),
}
PRESET_PREFIX = "preset:"


_CLOSERS = {"(": ")", "[": "]", "{": "}"}


def split_patterns(text: str) -> list[str]:
    """The patterns of a comma-separated string: a comma inside {...}, [...] or (...) (a regex
    repeat "{1,2}", a class "[,]", a group) is part of its pattern; a backslash escapes the next
    character. An unclosed bracket is a ValueError naming the pattern and the string, rather than
    halves that would match nothing."""
    parts, start, stack, i = [], 0, [], 0
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if stack and stack[-1] == "[":  # inside a class only its closing bracket counts
            if c == "]":
                stack.pop()
        elif c in _CLOSERS:
            stack.append(c)
        elif stack and c == _CLOSERS[stack[-1]]:
            stack.pop()
        elif c == "," and not stack:
            parts.append(text[start:i])
            start = i + 1
        i += 1
    if stack:
        raise ValueError(
            f"invalid ignored_layers pattern {short_repr(text[start:].strip())} in {short_repr(text)}: "
            f"its {stack[-1]!r} is never closed (a comma inside brackets does not separate "
            "patterns); close it, or give the patterns as a list"
        )
    parts.append(text[start:])
    return parts


def validate_pattern(pattern: str) -> None:
    if not isinstance(pattern, str) or not pattern.strip():
        raise ValueError(f"invalid ignored_layers pattern {short_repr(pattern)}: empty")
    if pattern.startswith(PRESET_PREFIX):
        if pattern[len(PRESET_PREFIX) :] not in PRESETS:
            raise ValueError(
                f"unknown ignored_layers preset {short_repr(pattern)}: expected one of "
                f"{', '.join(PRESET_PREFIX + k for k in PRESETS)}"
            )
        return
    if pattern.startswith("re:"):
        _regex(pattern)


_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # a refused pattern is our ValueError, not a line on stderr
#: '{,n}': Python's re reads a repeat of 0 to n, RE2 the literal text
_OPEN_LOWER_BOUND = re.compile(r"(?<!\\)\{,\d*\}")


@functools.lru_cache(maxsize=4096)
def _regex(pattern: str):
    """The compiled RE2 regex of a 're:' pattern; ValueError naming the pattern where Python's re
    finds it malformed or RE2 cannot run it."""
    body = pattern[3:]
    try:
        re.compile(body)
    except re.error as e:
        raise ValueError(
            f"invalid ignored_layers pattern {short_repr(pattern)}: bad regular expression ({e})"
        ) from None
    if _OPEN_LOWER_BOUND.search(body):
        raise ValueError(
            f"invalid ignored_layers pattern {short_repr(pattern)}: write '{{0,n}}' for '{{,n}}' (RE2, which "
            "matches re: patterns, would read '{,n}' as literal text)"
        )
    try:
        return re2.compile(body, _RE2_OPTIONS)
    except re2.error as e:
        detail = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        what = next(
            (name for marks, name in _RE2_LACKS if any(re.search(m, body) for m in marks)), "a construct RE2 lacks"
        )
        raise ValueError(
            f"invalid ignored_layers pattern {short_repr(pattern)}: it uses {what}, which RE2 (the linear-time matcher that "
            f"keeps any pattern from stalling a compile) cannot run ({detail}). RE2 lacks backreferences, "
            "lookaround, atomic groups, possessive repeats, \\Z (a re: pattern matches the whole name anyway) and "
            "inline flags other than i / m / s / U; list the layers to ignore as patterns of their own instead "
            "(a layer is ignored when any pattern matches it)"
        ) from None


#: constructs of Python's re that RE2 lacks (regexes over the pattern's text) -> their name, for the refusal
_RE2_LACKS = (
    ((r"\(\?=", r"\(\?!"), "a lookahead"),
    ((r"\(\?<=", r"\(\?<!"), "a lookbehind"),
    ((r"\\[1-9]", r"\(\?P="), "a backreference"),
    ((r"\(\?>",), "an atomic group"),
    ((r"[*+?}]\+",), "a possessive repeat"),
    ((r"\\Z",), "\\Z"),
    ((r"\(\?[a-zA-Z]*[aLux]",), "an inline flag RE2 lacks"),
)


@functools.lru_cache(maxsize=4096)
def _compiled(pattern: str):
    if pattern.startswith(PRESET_PREFIX):
        members = [_compiled(p) for p in PRESETS[pattern[len(PRESET_PREFIX) :]]]
        return lambda name: any(m(name) for m in members)
    if pattern.startswith("re:"):
        rx = _regex(pattern)
        return lambda name: rx.fullmatch(name) is not None
    if any(c in pattern for c in "*?["):
        return lambda name: fnmatch.fnmatchcase(name, pattern)
    want = pattern.strip(".").split(".")
    n = len(want)

    def plain(name: str) -> bool:
        parts = name.split(".")
        return any(parts[i : i + n] == want for i in range(len(parts) - n + 1))

    return plain


def matches(pattern: str, name: str) -> bool:
    return _compiled(pattern)(name)


def first_match(patterns: Iterable[str], name: str) -> Optional[str]:
    """The first of `patterns` that matches `name`, or None. Remembered per (patterns, name): every
    block instance of a regional compile asks the same questions about its layers."""
    return _first_match(patterns if isinstance(patterns, tuple) else tuple(patterns), name)


@functools.lru_cache(maxsize=1 << 16)
def _first_match(patterns: tuple, name: str) -> Optional[str]:
    for p in patterns:
        if matches(p, name):
            return p
    return None


def closest_names(pattern: str, names: Iterable[str], n: int = 3) -> list[str]:
    """The `n` names most like `pattern` (its text after 're:' / 'preset:'), best first: a plain
    pattern is compared with each run of as many dotted components as it has ("img_mlpp" finds
    "blocks.0.img_mlp.net.0.proj"), any other with the whole name."""
    text = pattern.split(":", 1)[1] if pattern.startswith(("re:", PRESET_PREFIX)) else pattern
    plain = not pattern.startswith(("re:", PRESET_PREFIX)) and not any(c in pattern for c in "*?[")
    width = len(text.strip(".").split("."))

    def variants(name: str) -> list[str]:
        parts = name.split(".")
        return ([".".join(parts[i : i + width]) for i in range(len(parts) - width + 1)] if plain else []) + [name]

    return closest(text, names, n=n, cutoff=0.5, variants=variants)


def warn_unmatched_patterns(
    patterns: Iterable[str], names: Iterable[str], where: str, *, stacklevel: int = 3
) -> list[str]:
    """Warn once, naming each ignored_layers pattern that matches none of `names` (the model's
    linears) and the closest names: a typo would quantize the layer meant to stay native, and an
    entry point that frees or never loads the original weights cannot wait for a compile to say
    so. Returns the unmatched patterns."""
    names = list(names)
    unmatched = [p for p in patterns if not any(matches(p, name) for name in names)]
    if unmatched:
        lines = []
        for p in unmatched:
            close = closest_names(p, names)
            lines.append(
                f"{short_repr(p)} (closest: {', '.join(map(repr, close))})"
                if close
                else f"{short_repr(p)} (no linear's name is close)"
            )
        warnings.warn(
            f"fx_fp8: {where}: ignored_layers pattern(s) matched no linear of the model, so no layer is kept "
            f"native by them: {'; '.join(lines)}",
            stacklevel=stacklevel,
        )
    return unmatched
