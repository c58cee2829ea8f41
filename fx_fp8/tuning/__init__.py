"""`fx-fp8 tune` / fx_fp8.tune: every FP8 decision measured on this GPU (shapes, candidates, run);
the table it writes is fx_fp8.ops.tune_table's."""

from fx_fp8.tuning.run import format_summary, tune

__all__ = ["tune", "format_summary"]
