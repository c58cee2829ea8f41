"""The tiny nn.Modules several test files build, written once.

TwoLinears and AttentionBlock are the smallest models that give the passes something to rewrite;
ToyDiT (with `toy` / `toy_inputs`) is a DiT whose module names match no sensitive-layer pattern, so
only the graph's structure can tell its conditioning, modulation and final projection apart;
`regional_toy` is that DiT with more blocks, compiled one block at a time by `compile_regionally`;
ToyScheduler steps the toy pipelines; ModulatedBlock is a DiT block's front (adaLN modulation feeding q, k, v and an MLP).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class TwoLinears(nn.Module):
    """x -> first -> relu (or nothing) -> second; `names` are the two linears' attribute names."""

    def __init__(
        self, dim: int = 64, hidden: int | None = None, names: tuple[str, str] = ("a", "b"), relu: bool = True
    ):
        super().__init__()
        hidden = dim if hidden is None else hidden
        self.names, self.relu = names, relu
        setattr(self, names[0], nn.Linear(dim, hidden))
        setattr(self, names[1], nn.Linear(hidden, dim))

    def forward(self, x):
        first, second = getattr(self, self.names[0]), getattr(self, self.names[1])
        h = first(x)
        return second(torch.relu(h) if self.relu else h)


class AttentionBlock(nn.Module):
    """One attention block: qkv linear, SDPA, output linear; then the model's final projection
    (a sensitive layer: weight-only under the default `sensitive`), after a relu if `relu`."""

    def __init__(self, dim=64, heads=2, relu=True):
        super().__init__()
        self.heads, self.relu = heads, relu
        self.to_qkv = nn.Linear(dim, 3 * dim)
        self.to_out = nn.Linear(dim, dim)
        self.proj_out = nn.Linear(dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.to_qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v)
        o = self.to_out(o.transpose(1, 2).reshape(b, s, d))
        return self.proj_out(torch.relu(o) if self.relu else o)


# -- a toy DiT whose names match no pattern -----------------------------------------------------
class ToyBlock(nn.Module):
    def __init__(self, dim: int, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.ada = nn.Linear(dim, 6 * dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, h, c):
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(F.silu(c))[:, None].chunk(6, dim=-1)
        b, s, d = h.shape
        n = F.layer_norm(h, (d,)) * (1 + scale1) + shift1
        q, k, v = (p(n).view(b, s, self.heads, d // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, d)
        h = h + gate1 * self.o(a)
        n = F.layer_norm(h, (d,)) * (1 + scale2) + shift2
        return h + gate2 * self.fc2(F.gelu(self.fc1(n)))


class ToyDiT(nn.Module):
    """Latents (B, C, H, W), a timestep (B,) and a pooled vector broadcast as (B, 1, P); with
    timestep=False the blocks are modulated by a learned vector instead (no conditioning input)."""

    def __init__(self, channels=16, dim=32, freq=64, pooled=48, timestep=True):
        super().__init__()
        self.freq = freq
        self.patch = nn.Linear(channels, dim)
        if timestep:
            self.t_fc1, self.t_fc2 = nn.Linear(freq, dim), nn.Linear(dim, dim)
            self.p_fc = nn.Linear(pooled, dim)
        else:
            self.cond = nn.Parameter(torch.randn(dim))
        self.blocks = nn.ModuleList([ToyBlock(dim) for _ in range(2)])
        self.final_ada = nn.Linear(dim, 2 * dim)
        self.head = nn.Linear(dim, channels)

    def forward(self, x, t=None, pooled=None):
        h = self.patch(x.flatten(2).transpose(1, 2))
        if t is not None:
            half = self.freq // 2
            freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
            emb = t[:, None].float() * freqs[None]
            c = self.t_fc2(F.silu(self.t_fc1(torch.cat([emb.cos(), emb.sin()], -1))))
            c = c + self.p_fc(pooled).squeeze(1)
        else:
            c = self.cond.expand(x.shape[0], -1)
        for block in self.blocks:
            h = block(h, c)
        shift, scale = self.final_ada(F.silu(c)).chunk(2, dim=-1)
        h = F.layer_norm(h, h.shape[-1:]) * (1 + scale[:, None]) + shift[:, None]
        return self.head(h).transpose(1, 2).reshape(x.shape)


class ToyScheduler:
    """The one scheduler call the toy pipelines make: a step of a fixed size."""

    def step(self, out, t, x):
        return x - 0.1 * out


def toy(timestep=True, seed=0):
    torch.manual_seed(seed)
    return ToyDiT(timestep=timestep).eval()


def toy_inputs(batch=1, side=8, timestep=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    kw = {"x": torch.randn(batch, 16, side, side, generator=g)}
    if timestep:
        kw.update(t=torch.rand(batch, generator=g) * 1000, pooled=torch.randn(batch, 1, 48, generator=g))
    return kw


class ToyPipe:
    """A denoising loop around a toy transformer (built by `make` after seeding 0): `steps` calls on
    toy_inputs, each followed by ToyScheduler.step; what compile_pipeline wraps."""

    def __init__(self, make=None):
        torch.manual_seed(0)
        self.transformer = (make or ToyDiT)().eval()
        self.scheduler = ToyScheduler()

    def __call__(self, steps=2):
        kw = toy_inputs()
        for i in range(steps):
            kw["x"] = self.scheduler.step(self.transformer(**kw), i, kw["x"])
        return kw["x"]


# -- regional compilation: the toy DiT with more blocks, each compiled on its own ---------------------
BLOCKS = 6


def regional_toy(seed=0):
    torch.manual_seed(seed)
    model = ToyDiT().eval()
    model.blocks = nn.ModuleList([ToyBlock(32) for _ in range(BLOCKS)])
    return model


def compile_regionally(model, **options):
    for block in model.blocks:
        block.compile(backend="fp8", options={"lowering": "reference", **options})
    return model


# -- a DiT block's front --------------------------------------------------------------------------------
class ModulatedBlock(nn.Module):
    """A DiT block's front: adaLN modulation of a LayerNorm output feeding q, k, v and an MLP."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(128, elementwise_affine=False)
        self.mod = nn.Linear(128, 256)
        self.to_q, self.to_k, self.to_v = (nn.Linear(128, 128) for _ in range(3))
        self.mlp = nn.Linear(128, 512)

    def forward(self, x, t):
        shift, scale = self.mod(t).chunk(2, -1)
        h = self.norm(x) * (1 + scale[:, None]) + shift[:, None]
        return self.to_q(h) + self.to_k(h) + self.to_v(h), self.mlp(h)
