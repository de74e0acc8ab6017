"""The shared token sampler: one logit transform for rollout and replay of every token family.

The transform is transformers' image-generation order: classifier-free guidance on the logits
(l_u + w·(l_c − l_u), conditional rows first), then temperature, then top-k (the rest −∞).
Sampling draws each sample's tokens from its own torch.Generator (multinomial over the softmax,
as JanusForConditionalGeneration.generate does), so a sample is reproducible from its seed in
any batch. Tokens are drawn with a KV cache; the stored log-probs are then computed by one
teacher-forced pass — the very function replay differentiates, on the same micro-batch — so the
ratio before an update is exactly 1 (incremental and full-sequence attention differ in the last
bits; `sampler_log_probs` keeps the incremental ones to show how much).

With a semantic chain of thought (`cot_tokens` > 0, T2I-R1's BiCoT), each sample first draws a
text from the language-model head after a reasoning prompt (temperature `cot_temperature`, no
guidance, until the end-of-sentence token or the budget), then its image tokens after the image
prompt that embeds that text; one generator per sample draws both, a finished text draws no
more, so a sample stays independent of its batch. The text's log-probs are teacher-forced too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class TokenRecipe:
    guidance_scale: float = 1.0  # CFG weight on the logits (1: no unconditional rows)
    temperature: float = 1.0
    top_k: int = 0  # 0: the whole codebook
    cot_tokens: int = 0  # semantic chain of thought before the image: at most this many text tokens (0: none)
    cot_temperature: float = 1.0
    cot_template: str = ""  # the reasoning prompt, with {prompt}

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
    cot_tokens: torch.Tensor | None = None  # [B, C] the chain of thought (pad after the end)
    cot_mask: torch.Tensor | None = None  # [B, C] 1 = a sampled text token (end-of-sentence included)
    cot_log_probs: torch.Tensor | None = None  # [B, C] teacher-forced, 0 where masked
    cot_behavior_log_probs: torch.Tensor | None = None  # [B, C] under the text server that sampled it, 0 where masked


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


def text_log_probs(family, text_cond, cot_tokens: torch.Tensor, cot_mask: torch.Tensor,
                   temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs [B, C], entropies [B, C]) of a stored chain of thought, 0 where masked."""
    logits = family.text_sequence_logits(text_cond, cot_tokens).float()
    if temperature != 1.0:
        logits = logits / temperature
    lp, ent = log_probs_and_entropy(logits, cot_tokens)
    m = cot_mask.to(lp.dtype)
    return lp * m, ent * m


def behavior_gap(policy_lp, behavior_lp, mask) -> dict[str, float]:
    """How far a text server's log-probs of the sampled text are from the policy's (arrays [B, C];
    mask 1 = sampled): the mean and largest |Δ log π| and the mean log-ratio policy − server."""
    import numpy as np

    m = np.asarray(mask).astype(bool)
    d = (np.asarray(policy_lp, np.float64) - np.asarray(behavior_lp, np.float64))[m]
    if not d.size:
        return {}
    return {"cot/behavior_gap_mean": float(np.abs(d).mean()), "cot/behavior_gap_max": float(np.abs(d).max()),
            "cot/behavior_log_ratio_mean": float(d.mean())}


@torch.no_grad()
def sample_text(family, text_cond, generators: list[torch.Generator], recipe: TokenRecipe):
    """(tokens [B, C], mask [B, C], teacher-forced log-probs [B, C]) of one micro-batch's chains
    of thought: multinomial draws at `cot_temperature` until each row's end-of-sentence token."""
    b, budget, eos = len(generators), recipe.cot_tokens, family.eos_id
    tokens = torch.full((b, budget), family.pad_id, dtype=torch.long, device=text_cond.ids.device)
    mask = torch.zeros((b, budget), dtype=torch.long, device=tokens.device)
    live = [True] * b
    logits, state = family.first_logits(text_cond, guided=False, text=True)
    for i in range(budget):
        probs = torch.softmax(logits.float() / recipe.cot_temperature, dim=-1)
        for r, g in enumerate(generators):
            if live[r]:  # a finished row draws no more from its generator
                tokens[r, i] = torch.multinomial(probs[r:r + 1], 1, generator=g).view(())
                mask[r, i] = 1
                live[r] = int(tokens[r, i]) != eos
        if not any(live):
            break
        if i + 1 < budget:
            logits, state = family.next_logits(state, tokens[:, i], text=True)
    lp, _ = text_log_probs(family, text_cond, tokens, mask, recipe.cot_temperature)
    return tokens, mask, lp


@torch.no_grad()
def sample_with_cot(family, cot, rows: list[int], generators: list[torch.Generator],
                    recipe: TokenRecipe, text_sampler=None) -> TokenTrajectory:
    """A micro-batch of set rows `rows` (a CotPrompts set): the chain of thought, then the image
    tokens after the image prompt that embeds it. `text_sampler` (engines/vllm_text.py): another
    process draws the text; its log-probs are still the policy's, teacher-forced."""
    text_cond = cot.text.select(rows)
    behavior = None
    if text_sampler is None:
        cot_tokens, cot_mask, cot_lp = sample_text(family, text_cond, generators, recipe)
    else:
        cot_tokens, cot_mask, behavior = text_sampler.sample(text_cond, generators, recipe.cot_tokens,
                                                             recipe.cot_temperature, family.pad_id, family.eos_id)
        cot_lp, _ = text_log_probs(family, text_cond, cot_tokens, cot_mask, recipe.cot_temperature)
    traj = sample_tokens(family, family.cot_image_prompts(cot, rows, cot_tokens, cot_mask), generators, recipe)
    traj.cot_tokens, traj.cot_mask, traj.cot_log_probs = cot_tokens, cot_mask, cot_lp
    traj.cot_behavior_log_probs = behavior
    return traj


@torch.no_grad()
def generate_tokens(family, prompts: list[str], generators: list[torch.Generator], recipe: TokenRecipe) -> TokenTrajectory:
    """Samples for free-standing prompts (evaluation, `pixrl generate`): with the chain of thought
    when the recipe asks for one."""
    if recipe.cot_tokens:
        row = {p: i for i, p in enumerate(sorted(set(prompts)))}
        cot = family.encode_cot_prompts(list(row), recipe.cot_template, recipe.cot_tokens)
        return sample_with_cot(family, cot, [row[p] for p in prompts], generators, recipe)
    return sample_tokens(family, family.encode_prompts(prompts), generators, recipe)


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
