"""Module-name patterns for ignored_layers (one parser, used by the config, the passes and prepare_model).

Rules, checked in this order for each pattern:
  1. "re:<regex>"  - the regular expression must match the whole module name.
  2. a glob (contains *, ? or [) - fnmatch against the whole name.
  3. a plain name  - matches any run of whole dotted components:
     "img_mlp" matches "transformer_blocks.7.img_mlp.net.0.proj",
     "attn.to_q" matches "blocks.0.attn.to_q", but "mlp" does not match "img_mlp".
  4. "preset:<name>" - a named set of patterns (PRESETS), e.g. "preset:vllm-omni-flux".
A module is ignored if any pattern matches it (patterns never cancel each other).

A regular expression with a quantified group that itself holds an unbounded quantifier
("(a+)*", "(.*.*)*z") can take exponential time on a name that does not match: it is refused
when the config is validated, naming the pattern.
"""
from __future__ import annotations

import fnmatch
import functools
import re
import re._constants as _sre
import re._parser as _sre_parse
from typing import Iterable, Optional

#: named sets of ignored_layers patterns ("preset:<name>")
PRESETS: dict[str, tuple[str, ...]] = {
    # vLLM-Omni keeps every FLUX dual-stream block in BF16 (FP8 on the joint-attention path was
    # visibly noisy on FLUX.1 with per-tensor weight scales); fx_fp8 quantizes them by default
    "vllm-omni-flux": ("re:transformer_blocks\\..*",),
}
PRESET_PREFIX = "preset:"


def validate_pattern(pattern: str) -> None:
    if not isinstance(pattern, str) or not pattern.strip():
        raise ValueError(f"invalid ignored_layers pattern {pattern!r}: empty")
    if pattern.startswith(PRESET_PREFIX):
        if pattern[len(PRESET_PREFIX):] not in PRESETS:
            raise ValueError(f"unknown ignored_layers preset {pattern!r}: expected one of "
                             f"{', '.join(PRESET_PREFIX + k for k in PRESETS)}")
        return
    if pattern.startswith("re:"):
        try:
            parsed = _sre_parse.parse(pattern[3:])
            re.compile(pattern[3:])
        except re.error as e:
            raise ValueError(f"invalid ignored_layers pattern {pattern!r}: bad regular expression ({e})") from None
        if _nested_unbounded(parsed, inside_repeat=False):
            raise ValueError(f"invalid ignored_layers pattern {pattern!r}: a repeated group holds an unbounded "
                             "quantifier (as in '(a+)*' or '(.*.*)*'), which can take exponential time to fail to "
                             "match; write it without the nesting, or bound the inner repeat (e.g. '\\d{1,4}')")


_REPEATS = (_sre.MAX_REPEAT, _sre.MIN_REPEAT, getattr(_sre, "POSSESSIVE_REPEAT", None))


def _nested_unbounded(items, inside_repeat: bool) -> bool:
    """Does an unbounded repeat sit inside a repeat that can match more than once?"""
    for op, av in items:
        if op in _REPEATS and op is not None:
            lo, hi, body = av
            if inside_repeat and hi == _sre.MAXREPEAT:
                return True
            if _nested_unbounded(body, inside_repeat or hi > 1):
                return True
        elif op is _sre.SUBPATTERN:
            if _nested_unbounded(av[-1], inside_repeat):
                return True
        elif op is _sre.BRANCH:
            if any(_nested_unbounded(b, inside_repeat) for b in av[1]):
                return True
        elif op in (_sre.ASSERT, _sre.ASSERT_NOT):
            if _nested_unbounded(av[1], inside_repeat):
                return True
        elif op is getattr(_sre, "ATOMIC_GROUP", None):
            if _nested_unbounded(av, inside_repeat):
                return True
    return False


@functools.lru_cache(maxsize=4096)
def _compiled(pattern: str):
    if pattern.startswith(PRESET_PREFIX):
        members = [_compiled(p) for p in PRESETS[pattern[len(PRESET_PREFIX):]]]
        return lambda name: any(m(name) for m in members)
    if pattern.startswith("re:"):
        rx = re.compile(pattern[3:])
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
    for p in patterns:
        if matches(p, name):
            return p
    return None
