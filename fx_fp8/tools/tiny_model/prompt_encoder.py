"""A tiny learned prompt encoder over the fixed vocabulary of :mod:`fx_fp8.tools.tiny_model.shapes`."""

from __future__ import annotations

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from .shapes import VOCAB

PAD_TOKEN = "<pad>"


class TinyPromptEncoder(ModelMixin, ConfigMixin):
    """Whitespace tokenizer + learned token/position embeddings.

    ``forward(input_ids)`` returns ``(prompt_embeds [B, T, D], pooled [B, D])``:

    * ``prompt_embeds = proj(tok_emb[ids] + pos_emb)`` (per-token, fed to the
      transformer as ``encoder_hidden_states``),
    * ``pooled = pool(flatten(tok_emb[ids] + pos_emb))`` (fed as ``pooled_projections``).

    The empty prompt ``""`` encodes to all padding (used as the unconditional input
    for classifier-free guidance; the model was trained with prompt dropout).
    """

    @register_to_config
    def __init__(
        self,
        vocab: tuple[str, ...] | list[str] = VOCAB,
        max_length: int = 8,
        embed_dim: int = 64,
        joint_attention_dim: int = 64,
        pooled_projection_dim: int = 64,
    ):
        super().__init__()
        self.token_embedding = nn.Embedding(len(vocab) + 1, embed_dim)  # index 0 = padding
        self.position_embedding = nn.Parameter(torch.zeros(max_length, embed_dim))
        self.proj = nn.Linear(embed_dim, joint_attention_dim)
        self.pool = nn.Linear(max_length * embed_dim, pooled_projection_dim)
        nn.init.normal_(self.token_embedding.weight, std=0.5)
        nn.init.normal_(self.position_embedding, std=0.5)
        self._word_to_id = {w: i + 1 for i, w in enumerate(vocab)}

    @property
    def pad_token_id(self) -> int:
        return 0

    def tokenize(self, prompt: str | list[str], device: torch.device | str | None = None) -> torch.Tensor:
        """Whitespace-tokenises prompts into ``[B, max_length]`` ids (0 = padding).

        Raises ``ValueError`` naming any word outside the vocabulary, or a prompt
        longer than ``max_length`` words.
        """
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        T = self.config.max_length
        ids = torch.zeros(len(prompts), T, dtype=torch.long)
        for b, p in enumerate(prompts):
            words = p.lower().split()
            if len(words) > T:
                raise ValueError(f"prompt {p!r} has {len(words)} words; at most {T} are supported")
            for j, w in enumerate(words):
                if w not in self._word_to_id:
                    raise ValueError(f"unknown word {w!r} in prompt {p!r}; vocabulary: {list(self.config.vocab)}")
                ids[b, j] = self._word_to_id[w]
        return ids.to(device) if device is not None else ids

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.token_embedding(input_ids) + self.position_embedding[: input_ids.shape[1]]
        prompt_embeds = self.proj(x)
        pooled = self.pool(x.flatten(1))
        return prompt_embeds, pooled

    def encode(self, prompt: str | list[str], device=None, dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokenises and encodes prompts: ``(prompt_embeds [B, T, D], pooled [B, D])``."""
        device = device if device is not None else self.device
        embeds, pooled = self(self.tokenize(prompt, device=device))
        if dtype is not None:
            embeds, pooled = embeds.to(dtype), pooled.to(dtype)
        return embeds, pooled
