"""The tiny model zoo: every model of the registry fx_fp8.tools.model_zoo (52 diffusers classes,
image, video and audio, the five families included), by name::

    from fx_fp8.tools.zoo import ZOO, build, make_inputs, output_tensor

    model = build("cogvideox", seed=0)
    kwargs = make_inputs("cogvideox", model, seed=0, variant=2)
    out = output_tensor(model(**kwargs))

See fx_fp8.tools.model_zoo for what an entry declares and what its notes say.
"""
from fx_fp8.tools.model_zoo import MODELS as ZOO
from fx_fp8.tools.model_zoo import VARIANTS, build, make_inputs, names, output_tensor
from fx_fp8.tools.model_zoo import TinyModel as ZooEntry

__all__ = ["ZooEntry", "ZOO", "VARIANTS", "build", "make_inputs", "output_tensor", "names"]
