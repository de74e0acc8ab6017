"""The shared token sampler: one logit transform for rollout and replay of every token family.

The transform is transformers' image-generation order: classifier-free guidance on the logits
(l_u + w·(l_c − l_u), conditional rows first), then temperature, then top-k (the rest −∞).
Sampling draws each sample's tokens from its own torch.Generator (multinomial over the softmax,
as JanusForConditionalGeneration.generate does), so a sample is reproducible from its seed in
any batch. Tokens are drawn with a KV cache; the stored log-probs are then computed by one
teacher-forced pass — the very function replay differentiates, on the same micro-batch — so the
ratio before an update is exactly 1 (incremental and full-sequence attention differ in the last
bits; `sampler_log_probs` keeps the incremental ones to show how much).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class TokenRecipe:
    guidance_scale: float = 1.0  # CFG weight on the logits (1: no unconditional rows)
    temperature: float = 1.0
    top_k: int = 0  # 0: the whole codebook

    @property
    def guided(self) -> bool:
        return self.guidance_scale > 1

    def to_dict(self) -> dict:
        return {"sampler": "token", **asdict(self)}


@dataclass
class TokenTrajectory:
    tokens: torch.Tensor  # [B, N] sampled image tokens
    log_probs: torch.Tensor  # [B, N] teacher-forced log π(token) under the recipe's transform
    sampler_log_probs: torch.Tensor  # [B, N] the same from the incremental (KV-cache) decode


def transform_logits(logits: torch.Tensor, recipe: TokenRecipe, batch: int) -> torch.Tensor:
    """Raw logits [R, ..., V] (R = batch, or 2·batch with guidance) → the sampled distribution's
    logits [batch, ..., V] in float32."""
    logits = logits.float()
    if recipe.guided:
        cond, uncond = logits[:batch], logits[batch:]
        logits = uncond + (cond - uncond) * recipe.guidance_scale
    if recipe.temperature != 1.0:
        logits = logits / recipe.temperature
    if recipe.top_k:
        kth = torch.topk(logits, min(recipe.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return logits


def log_probs_and_entropy(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log π(tokens) and the entropy of π per position, from transformed logits [B, N, V]."""
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
    finite = torch.isfinite(logp)
    entropy = -(logp.exp() * torch.where(finite, logp, torch.zeros_like(logp))).sum(-1)  # top-k: 0·(−∞) → 0
    return chosen, entropy


def sequence_log_probs(family, cond, tokens: torch.Tensor, recipe: TokenRecipe) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs [B, N], entropies [B, N]) of stored tokens under `family`'s current weights —
    the rollout's stored values and replay's differentiable ones."""
    logits = family.sequence_logits(cond, tokens, recipe.guided)
    return log_probs_and_entropy(transform_logits(logits, recipe, tokens.shape[0]), tokens)


@torch.no_grad()
def sample_tokens(family, cond, generators: list[torch.Generator], recipe: TokenRecipe) -> TokenTrajectory:
    """Sample every image token of one micro-batch, then score the sequence teacher-forced."""
    b, n = len(generators), family.image_token_count()
    logits, state = family.first_logits(cond, recipe.guided)
    tokens, sampler_lp = [], []
    for i in range(n):
        z = transform_logits(logits, recipe, b)
        probs = torch.softmax(z, dim=-1)
        tok = torch.cat([torch.multinomial(probs[r:r + 1], 1, generator=g) for r, g in enumerate(generators)]).view(b)
        tokens.append(tok)
        sampler_lp.append(torch.log_softmax(z, dim=-1).gather(-1, tok[:, None]).squeeze(-1))
        if i + 1 < n:
            logits, state = family.next_logits(state, tok)
    seq = torch.stack(tokens, 1)
    log_probs, _ = sequence_log_probs(family, cond, seq, recipe)
    return TokenTrajectory(seq, log_probs, torch.stack(sampler_lp, 1))
