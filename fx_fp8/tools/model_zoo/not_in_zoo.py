"""The diffusers transformer classes the zoo does not build, each with the reason, and the rule that says
which diffusers exports are transformer classes (tests check that each is in the zoo or listed here)."""

from __future__ import annotations

from types import MappingProxyType

#: diffusers class name -> why the zoo has no tiny model of it
NOT_IN_ZOO = MappingProxyType(
    {
        "HunyuanDiT2DMultiControlNetModel": "a list of HunyuanDiT2DControlNetModel built from models, not from a "
        "config; it calls each net's forward (the zoo's hunyuan-dit-controlnet)",
        "RFD4ProteinaTransformer": "a protein-structure model (backbone coordinates and latents in, velocities and "
        "logits out): no image, video or audio, the zoo's kinds; it does build and run at "
        "width 32 from a config of its own (2 layers, 2 features per factory)",
    }
)


def diffusers_transformer_classes() -> list[str]:
    """The model classes diffusers exports whose names say transformer ("Transformer" or "DiT"), VAEs left out."""
    import diffusers

    found = []
    for name in dir(diffusers):
        if ("Transformer" in name or "DiT" in name) and not name.endswith("Vae"):
            obj = getattr(diffusers, name)
            if isinstance(obj, type) and issubclass(obj, diffusers.ModelMixin):
                found.append(name)
    return sorted(found)
