"""The Dynamo backends: options to config, one plan per Dynamo graph (passes per instance and
step variant, the downstream compile), the per-call dispatch, the first-call log."""
