"""The tiny model's prompt sets: the tuning set it was fine-tuned and gated on, and a held-out set.

TUNING (``tuning_cases``): prompt i drawn from the grammar with ``numpy.random.default_rng(i)``
and noise seed i, i < 16. The FP8-aware fine-tune (``examples/train_tiny_dit.py``) picked its
checkpoints by the FP8-vs-native PSNR on these cases, and ``benchmarks/tiny_quality.py``
reports on them by default: numbers on them are in-sample.

HELDOUT: 48 (prompt, noise seed) cases the model was never tuned or evaluated on: prompts of
the grammar that are not among the tuning prompts, noise seeds 1000-1047 (the tuning set
uses 0-15). Fixed here once (the 106 remaining prompts in a permutation drawn with
``default_rng(20261202)``, the first 48) and never used to choose a config, a checkpoint or
a default: evaluate with ``python benchmarks/tiny_quality.py --prompt-set heldout``.
CONFIRM (``confirm_cases``): 48 more cases apart from both (the remaining prompts, noise seeds
2000-2047), read once to check a decision made after the held-out set had been seen.
48 cases because one 32x32 image's PSNR swings by several dB with a few flipped edge
pixels (std about 7-8 dB per image): the mean of 10 cases has a std of about 2 dB between draws.
"""

from __future__ import annotations

import numpy as np

from .shapes import all_prompts, random_prompt

TUNING_SIZE = 16

HELDOUT: tuple[tuple[str, int], ...] = (
    ("a blue triangle on a red background", 1000),
    ("a red circle on a yellow background", 1001),
    ("a yellow cross on a blue background", 1002),
    ("a yellow square on a blue background", 1003),
    ("a green square on a blue background", 1004),
    ("a red cross on a black background", 1005),
    ("a black cross on a red background", 1006),
    ("a white triangle on a red background", 1007),
    ("a red cross on a blue background", 1008),
    ("a white square on a green background", 1009),
    ("a green triangle on a yellow background", 1010),
    ("a blue circle on a yellow background", 1011),
    ("a yellow circle on a black background", 1012),
    ("a blue square on a red background", 1013),
    ("a green triangle on a blue background", 1014),
    ("a blue circle on a white background", 1015),
    ("a blue square on a white background", 1016),
    ("a black cross on a green background", 1017),
    ("a red triangle on a blue background", 1018),
    ("a black triangle on a yellow background", 1019),
    ("a yellow cross on a white background", 1020),
    ("a white triangle on a green background", 1021),
    ("a red cross on a yellow background", 1022),
    ("a white circle on a yellow background", 1023),
    ("a yellow square on a white background", 1024),
    ("a green cross on a white background", 1025),
    ("a blue square on a green background", 1026),
    ("a yellow triangle on a green background", 1027),
    ("a yellow circle on a blue background", 1028),
    ("a red triangle on a white background", 1029),
    ("a green circle on a yellow background", 1030),
    ("a white triangle on a black background", 1031),
    ("a white square on a red background", 1032),
    ("a yellow square on a red background", 1033),
    ("a white circle on a blue background", 1034),
    ("a red triangle on a green background", 1035),
    ("a white circle on a black background", 1036),
    ("a blue triangle on a green background", 1037),
    ("a blue circle on a green background", 1038),
    ("a red cross on a white background", 1039),
    ("a yellow circle on a white background", 1040),
    ("a red circle on a green background", 1041),
    ("a red triangle on a yellow background", 1042),
    ("a yellow cross on a red background", 1043),
    ("a green square on a yellow background", 1044),
    ("a green cross on a blue background", 1045),
    ("a yellow triangle on a blue background", 1046),
    ("a green circle on a white background", 1047),
)


def tuning_cases(n: int = TUNING_SIZE) -> list[tuple[str, int]]:
    """The first `n` (prompt, noise seed) cases of the tuning set (prompt i from seed i)."""
    if n < 1:
        raise ValueError(f"tuning_cases: n must be >= 1, got {n}")
    return [(random_prompt(np.random.default_rng(i)), i) for i in range(n)]


def heldout_cases(n: int | None = None) -> list[tuple[str, int]]:
    """The first `n` held-out (prompt, noise seed) cases (all 48 without `n`)."""
    if n is not None and not 1 <= n <= len(HELDOUT):
        raise ValueError(f"heldout_cases: n must be in 1..{len(HELDOUT)}, got {n}")
    return list(HELDOUT[:n])


def confirm_cases(n: int | None = None) -> list[tuple[str, int]]:
    """A third set, apart from both: the grammar's prompts that are neither tuning nor held-out
    prompts, in `all_prompts()` order, the first 48, noise seeds 2000-2047. It checks a decision
    made after the held-out set had been read (see docs/tiny_model.md)."""
    used = {p for p, _ in tuning_cases()} | {p for p, _ in HELDOUT}
    cases = [(p, 2000 + j) for j, p in enumerate([p for p in all_prompts() if p not in used][:48])]
    if n is not None and not 1 <= n <= len(cases):
        raise ValueError(f"confirm_cases: n must be in 1..{len(cases)}, got {n}")
    return cases[:n]


PROMPT_SETS = {"tuning": tuning_cases, "heldout": heldout_cases, "confirm": confirm_cases}


def prompt_cases(name: str, n: int | None = None) -> list[tuple[str, int]]:
    """(prompt, noise seed) cases of the set `name` ("tuning", "heldout" or "confirm")."""
    if name not in PROMPT_SETS:
        raise ValueError(f"unknown prompt set {name!r}; expected one of {sorted(PROMPT_SETS)}")
    return PROMPT_SETS[name](n) if n is not None else PROMPT_SETS[name]()
