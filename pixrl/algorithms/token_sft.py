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

from .base import register_algorithm
from .token_dpo import OfflineTokenAlgorithm, ScoredPolicySettings


@register_algorithm("token_sft")
class TokenSFT(OfflineTokenAlgorithm):
    Settings = ScoredPolicySettings

    @property
    def needs_reference(self) -> bool:
        return False

    def losses(self, batch, policy):
        tokens = policy.tensor(batch["tokens"]).long()
        b = len(tokens) // 2
        winners = dataclasses.replace(policy, cond=policy.cond.select(list(range(b))))
        lp, entropy = winners.log_probs(tokens[:b])
        loss = -lp.mean()
        with torch.no_grad():
            metrics = {"logp_w": lp.sum(-1).mean(), "entropy": entropy.mean()}
        yield loss, metrics
