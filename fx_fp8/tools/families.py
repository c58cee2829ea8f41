"""Tiny random diffusers transformers by family name, with example inputs.

For inspection and tests without any download: `build_tiny_transformer("flux")` returns a
randomly initialised model whose structure (module names, block lists, attention kinds) matches
the real family, at hidden sizes of 64-128. The families are entries of the registry
fx_fp8.tools.model_zoo (their configs: fx_fp8/tools/model_zoo/families.py); the zoo builds the
same configs.
"""
from fx_fp8.tools.model_zoo import (ALIASES, FAMILIES, build_tiny_transformer, canonical_family, example_inputs,
                                    normalize_name, output_tensor)

__all__ = ["ALIASES", "FAMILIES", "build_tiny_transformer", "canonical_family", "example_inputs", "normalize_name",
           "output_tensor"]
