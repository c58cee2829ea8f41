"""Tools around the core: the fx-fp8 command line, sensitivity search, image metrics,
model sources, tiny models and pipelines for tests and examples.

Nothing in the core (config, backend, passes, ops, weights, steps, report)
imports from here.
"""
