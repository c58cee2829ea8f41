"""benchmarks/supported_models.py --merge: rows measured anew join the page's table in the zoo's order, the
other rows stay as they were measured, and the counts, the largest error and the README's sentence follow."""

from __future__ import annotations

import collections
import importlib.util
from pathlib import Path

from fx_fp8.tools.model_zoo import registry as zoo

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("supported_models", ROOT / "benchmarks" / "supported_models.py")
sm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sm)


def _row(model: str, error: float, linear=(0, 4)) -> dict:
    entry = zoo.MODELS[model]
    return {
        "model": model,
        "class": entry.class_name,
        "kind": entry.kind,
        "error": error,
        "attention": (1, 1),
        "linear": linear,
        "native": collections.Counter({("linear", "below min_features"): 4 - linear[0]}),
    }


def test_merge_adds_and_replaces_rows_and_recounts():
    old = sm.page([_row("dit", 0.01), _row("wan", 0.02)], "Measured once.", "cmd")
    kept = next(line for line in old.split("\n") if line.startswith("| `WanTransformer3DModel`"))
    merged = sm.merge(old, [_row("minimax-h3", 0.03), _row("dit", 0.005, linear=(2, 4))], "Rows merged.")
    lines = merged.split("\n")
    table = [line.split(" | ")[1] for line in lines if line.startswith("| `")]
    assert table == ["dit", "minimax-h3", "wan (family)"]  # the zoo's order: image, then video by name
    assert kept in lines  # an unmeasured row is left as it was
    assert "| `DiTTransformer2DModel` | dit | image | 1/1 | 2/4 | 0.50 % |" in merged  # a measured row replaced
    assert "3 classes (1 image, 2 video, 0 audio)" in merged and "Largest: 3.00 % (minimax-h3)" in merged
    assert "Measured once. Rows merged." in merged
    assert zoo.NOT_IN_ZOO  # the classes left out, each named on the page
    assert sm.NOT_IN_ZOO_TITLE in lines and all(f"`{c}`" in merged for c in zoo.NOT_IN_ZOO)
    assert sm.merge(merged, [], "").count(sm.NOT_IN_ZOO_TITLE) == 1  # merging again does not repeat the list

    readme = (
        f"intro\n{sm.START}\n52 diffusers transformer classes (27 image, 20 video, 5 audio) compile; within "
        f"3.2 % of native.\n| table |\n{sm.END}\n"
    )
    assert sm.merge_readme_block(readme, merged) == (
        f"intro\n{sm.START}\n3 diffusers transformer classes (1 image, "
        f"2 video, 0 audio) compile; within 3.0 % of native.\n"
        f"| table |\n{sm.END}\n"
    )
