"""The number formats of quantized tensors: storage dtype and largest representable magnitude;
the activation dtypes the FP8 paths take; the name of weight-only (W8A16) storage."""

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
INT8_MAX = 127.0
#: storage dtype and largest magnitude of each linear quantization method
METHODS = {"fp8": (FP8_DTYPE, FP8_MAX), "int8": (torch.int8, INT8_MAX)}
#: activation / weight dtypes the quantized linears and attention take
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: a quantized linear's activation granularity when it is weight-only (W8A16): activations stay unquantized
WEIGHT_ONLY = "weight_only"
