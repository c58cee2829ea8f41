"""Quantized weights and what makes them: the one weight recipe, QuantizedLinear (a prepared
layer), compile-time copies owned by the model's modules and the inputs that feed them to a
graph, prepare_model, checkpoints, calibration, pre-quantized checkpoints, the quantization rules."""
