"""AttentionQuantConfig: how FP8Config's attention is quantized (the `attention` key)."""

from __future__ import annotations

from dataclasses import dataclass

from fx_fp8.config.values import check_bool, check_choice, check_int, is_number, short_repr

ATTENTION_GRANULARITIES = ("tensor", "head", "block", "mx")
ATTENTION_KERNELS = ("auto", "triton", "cudnn", "gluon")  # gluon: a GPU-run candidate, never picked by auto


@dataclass(frozen=True)
class AttentionQuantConfig:
    """How Q, K, V (and the softmax probabilities P) are quantized.

    granularity: "tensor" (one scale per tensor), "head" (per batch x head),
      "block" (per batch x head x block of rows; Q rows in q_block, K/V rows in kv_block),
      "mx" (MXFP8: power-of-two e8m0 scales per 32 elements; q_block / kv_block are ignored).
    hadamard: rotate Q and K over the head dim by an orthonormal Hadamard matrix
      (QK^T is unchanged, outlier channels are spread out).
    smooth_k: subtract K's mean over tokens before quantizing (softmax is invariant).
    quantize_p: quantize the probabilities to e4m3 before P@V (what the fused
      device kernels do), scale `p_scale`.
    min_kv_ratio: attention whose key length is below min_kv_ratio x its query
      length (cross-attention to a short prompt) stays native; joint attention
      (keys = the image tokens plus a few more) is quantized.
    cross_attention: quantize attention whatever its key length (overrides min_kv_ratio).
    kernel: CUDA attention kernel: "auto", "triton", "cudnn" or "gluon" (a GPU-run candidate, numerically
      unverified; see ops/gluon_fp8_attention.py) (ignored elsewhere).
    """

    granularity: str = "block"
    q_block: int = 128
    kv_block: int = 256
    hadamard: bool = True
    smooth_k: bool = True
    quantize_p: bool = True
    p_scale: float = 448.0
    min_kv_ratio: float = 0.5
    cross_attention: bool = False
    kernel: str = "auto"

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - frozen dataclass normalisation
        set_("granularity", check_choice("attention.granularity", self.granularity, ATTENTION_GRANULARITIES))
        set_("kernel", check_choice("attention.kernel", self.kernel, ATTENTION_KERNELS))
        check_int("attention.q_block", self.q_block)
        check_int("attention.kv_block", self.kv_block)
        for name in ("hadamard", "smooth_k", "quantize_p", "cross_attention"):
            check_bool(f"attention.{name}", getattr(self, name))
        # P in [0, 1] is multiplied by p_scale before the e4m3 cast: below 1 the small probabilities
        # round to zero (below 2**-10 all of them, and the attention output is 0)
        if not is_number(self.p_scale) or not 1 <= self.p_scale <= 448:
            raise ValueError(
                f"invalid attention.p_scale {short_repr(self.p_scale)}: expected a number in [1, 448] (the softmax "
                "probabilities are multiplied by it before the FP8 cast; below 1 small probabilities "
                "round to zero, and at 1e-3 the attention output is all zeros)"
            )
        if not is_number(self.min_kv_ratio) or not 0 <= self.min_kv_ratio <= 1:
            raise ValueError(
                f"invalid attention.min_kv_ratio {short_repr(self.min_kv_ratio)}: expected a number in [0, 1]"
            )
