"""The number formats of quantized tensors: storage dtype and largest representable magnitude."""
import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
INT8_MAX = 127.0
#: storage dtype and largest magnitude of each linear quantization method
METHODS = {"fp8": (FP8_DTYPE, FP8_MAX), "int8": (torch.int8, INT8_MAX)}
