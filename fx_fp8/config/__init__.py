"""Settings: the FP8Config dataclasses, their keys and value checks, YAML / vLLM-Omni files,
step and layer selectors, ignored_layers patterns, calibration step groups."""
