"""DPO over token sequences (Rafailov et al. 2023) for token-autoregressive image models, from
archived rollouts: the offline counterpart of token_grpo, through the same `pixrl dpo` command.

log π(y) is the sum of the image tokens' log-probs under a fixed logit transform (`guidance_scale`,
`temperature`; default the conditional policy itself, as DPO trains a language model's own
likelihood). L = −log σ(β·[(log π_θ(y_w) − log π_ref(y_w)) − (log π_θ(y_l) − log π_ref(y_l))]);
ln 2 at the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from .base import Algorithm, register_algorithm
from .token_sampling import TokenRecipe


class ScoredPolicySettings(BaseModel):
    """The logit transform an offline token algorithm scores stored sequences under."""

    model_config = ConfigDict(extra="forbid")
    guidance_scale: float = Field(1.0, ge=1.0, description="CFG weight of the scored policy (1: conditional only)")
    temperature: float = Field(1.0, gt=0, description="temperature of the scored policy")


class TokenDPOSettings(ScoredPolicySettings):
    beta: float = Field(0.1, gt=0, description="β of the DPO loss on sequence log-likelihood ratios")


def sequence_dpo_loss(lp_w: torch.Tensor, lp_l: torch.Tensor, ref_w: torch.Tensor, ref_l: torch.Tensor,
                      beta: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO over sequence log-probs [b] of winners and losers (trained and reference policies)."""
    inside = beta * ((lp_w - ref_w) - (lp_l - ref_l))
    loss = -F.logsigmoid(inside).mean()
    with torch.no_grad():
        metrics = {"implicit_acc": (inside > 0).float().mean(), "implicit_margin": inside.mean(),
                   "logp_w": lp_w.mean(), "logp_l": lp_l.mean()}
    return loss, metrics


class OfflineTokenAlgorithm(Algorithm):
    """An offline algorithm over stored image-token sequences: a micro-batch is b winners then
    their b losers (tokens and prompts), scored under the settings' logit transform."""

    needs = frozenset({"tokens"})
    offline = True

    @property
    def token_recipe(self) -> TokenRecipe:
        """The logit transform whose sequence likelihood the algorithm trains."""
        return TokenRecipe(self.settings.guidance_scale, self.settings.temperature, 0)


@register_algorithm("token_dpo")
class TokenDPO(OfflineTokenAlgorithm):
    Settings = TokenDPOSettings

    @property
    def needs_reference(self) -> bool:
        return True

    def losses(self, batch, policy):
        tokens = policy.tensor(batch["tokens"]).long()
        b = len(tokens) // 2
        lp, _ = policy.log_probs(tokens)
        with torch.no_grad():
            ref, _ = policy.log_probs(tokens, reference=True)
        seq, ref_seq = lp.sum(-1), ref.sum(-1)
        yield sequence_dpo_loss(seq[:b], seq[b:], ref_seq[:b], ref_seq[b:], self.settings.beta)
