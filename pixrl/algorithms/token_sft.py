"""Supervised fine-tuning on the preferred image-token sequences of archived rollouts: the token
families' counterpart of diffusion_sft (SFT on each pair's winner; with dpo=best_worst, each prompt
group's best rollout), through the same `pixrl dpo` command.

L = −mean over the winners' image tokens of log π_θ(token | prompt, earlier tokens), under the
scored policy's logit transform (`guidance_scale`, `temperature`; default the conditional policy
itself, the likelihood a language model's SFT trains). No reference model; losers are read with
the pairs and ignored.
"""

from __future__ import annotations

import dataclasses

import torch
from pydantic import BaseModel, ConfigDict, Field

from .base import Algorithm, register_algorithm
from .token_sampling import TokenRecipe


class TokenSFTSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    guidance_scale: float = Field(1.0, ge=1.0, description="CFG weight of the scored policy (1: conditional only)")
    temperature: float = Field(1.0, gt=0, description="temperature of the scored policy")


@register_algorithm("token_sft")
class TokenSFT(Algorithm):
    """A micro-batch is b winners then their b losers (stored image tokens and prompts)."""

    Settings = TokenSFTSettings
    needs = frozenset({"tokens"})
    offline = True

    @property
    def needs_reference(self) -> bool:
        return False

    @property
    def token_recipe(self) -> TokenRecipe:
        """The logit transform whose likelihood SFT maximises."""
        return TokenRecipe(self.settings.guidance_scale, self.settings.temperature, 0)

    def losses(self, batch, policy):
        tokens = policy.tensor(batch["tokens"]).long()
        b = len(tokens) // 2
        winners = dataclasses.replace(policy, cond=policy.cond.select(list(range(b))))
        lp, entropy = winners.log_probs(tokens[:b])
        loss = -lp.mean()
        with torch.no_grad():
            metrics = {"logp_w": lp.sum(-1).mean(), "entropy": entropy.mean()}
        yield loss, metrics
