"""Module-name patterns for ignored_layers (one parser, used by the config, the passes and prepare_model).

Rules, checked in this order for each pattern:
  1. "re:<regex>"  - the regular expression must match the whole module name.
  2. a glob (contains *, ? or [) - fnmatch against the whole name.
  3. a plain name  - matches any run of whole dotted components:
     "img_mlp" matches "transformer_blocks.7.img_mlp.net.0.proj",
     "attn.to_q" matches "blocks.0.attn.to_q", but "mlp" does not match "img_mlp".
A module is ignored if any pattern matches it (patterns never cancel each other).
"""
from __future__ import annotations

import fnmatch
import functools
import re
from typing import Iterable, Optional


def validate_pattern(pattern: str) -> None:
    if not isinstance(pattern, str) or not pattern.strip():
        raise ValueError(f"invalid ignored_layers pattern {pattern!r}: empty")
    if pattern.startswith("re:"):
        try:
            re.compile(pattern[3:])
        except re.error as e:
            raise ValueError(f"invalid ignored_layers pattern {pattern!r}: bad regular expression ({e})") from None


@functools.lru_cache(maxsize=4096)
def _compiled(pattern: str):
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
