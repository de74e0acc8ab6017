"""GLM-Image's autoregressive model as a token family: the 9B GlmImageForConditionalGeneration
writes an image as VQ tokens — a ~16×16 preview grid, then one token per 32×32 pixels — and
GLM-Image's frozen diffusion decoder renders the large grid. Training it with Token-GRPO is the
other half of GLM-Image's decoupled RL (the autoregressive model for composition and semantics,
the decoder — family `glm_image` — for detail and text rendering).

What is the family's own, as GlmImagePipeline's `generate_prior_tokens` runs the model:
- **prompts**: the processor's chat turn with the target grid and preview grid sizes appended and
  the image-start token, each prompt tokenized alone, then left-padded into a batch;
- **positions**: 3-D rotary positions — the prompt's text positions, then each grid's tokens at
  (its start, start + row, start + column) — from the model's own `get_rope_index`, passed
  explicitly in the incremental decode and in the teacher-forced pass alike;
- **actions**: every generated token (preview and large grid); the head's two image marks are
  masked out of the distribution (the pipeline's generation config must keep them out of the
  image span; here the sampled and the scored distribution are the same codebook softmax);
  sampling without guidance (the pipeline's `generate` has none), at the recipe's temperature
  and top-k;
- **decode**: the large grid upsampled ×2 as prior tokens for the decoder (GLM-Image's DiT),
  which samples the image with its ODE at `model.decoder_steps` and CFG `model.decoder_guidance`
  (the pipeline's 50 and 1.5) from noise seeded by `model.decoder_seed` and the prompt — so the
  image, and its reward, are a function of the tokens and the prompt — reading the prompt's
  glyph embeddings (its quoted text). Decoding runs the decoder's ODE: it costs what the
  pipeline's denoising costs.
LoRA targets: the language model's attention and MLP projections; full fine-tuning trains the
language model and its head (the vision tower and VQ codebook stay frozen).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .base import ModelLoadError
from .glm_image import GlmImageFamily, prompt_seed, quiet_processor
from .pipelines import PipelineFamily
from .registry import register_family
from .taxonomy import Action, PolicySemantics, PolicyStep, Regime

__all__ = ["GlmArPrompts", "GlmImageArFamily"]

_LORA_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj")


@dataclass
class GlmArPrompts:
    """Left-padded prompt ids, their mask, their 3-D positions and those of the tokens to come."""

    ids: torch.Tensor  # [B, L]
    mask: torch.Tensor  # [B, L] 1 = token, 0 = left padding
    positions: torch.Tensor  # [3, B, L]
    decode: torch.Tensor  # [B, 3, N + 1]: positions of the generated tokens (and the end mark)

    def select(self, idx) -> "GlmArPrompts":
        return GlmArPrompts(self.ids[idx], self.mask[idx], self.positions[:, idx], self.decode[idx])

    def expand(self, n: int) -> "GlmArPrompts":
        return GlmArPrompts(self.ids.expand(n, -1), self.mask.expand(n, -1), self.positions.expand(-1, n, -1),
                            self.decode.expand(n, -1, -1))


@dataclass
class ArState:
    """The KV cache of an incremental decode, its mask, and how many tokens it has been fed."""

    cache: object
    mask: torch.Tensor  # [B, L + k]
    decode: torch.Tensor  # [B, 3, N + 1]
    fed: int


@register_family("glm_image_ar")
class GlmImageArFamily(PipelineFamily):
    name = "glm_image_ar"
    pipeline_class = "GlmImagePipeline"
    semantics = PolicySemantics(regime=Regime.token_autoregressive, step=PolicyStep.token, action=Action.categorical)
    guidance = "none"  # the pipeline's generate samples the tokens without guidance
    denoiser = "vision_language_encoder"  # the trained component (held as `transformer`)
    separate_text_towers = False  # prompts are token ids the trained model reads
    conditioning_towers = ("text_encoder",)  # the decoder's glyph encoder
    decode_reads_prompts = True  # the decoder renders each prompt's quoted text
    text_tokens = (1, 2048)  # the decoder's glyph tokens per quoted text
    frozen_prefixes = ("model.visual.", "model.vqmodel.")
    options = {"decoder_steps": "the decoder's ODE steps in decode (the pipeline's 50)",
               "decoder_guidance": "the decoder's CFG scale in decode (the pipeline's 1.5)",
               "decoder_seed": "the seed from which each prompt's decoder noise is drawn (with the prompt's digest)"}

    def __init__(self, pipe, path, dtype, max_sequence_length=0, resolution=None, frames=None,
                 decoder_steps: int = 50, decoder_guidance: float = 1.5, decoder_seed: int = 0):
        super().__init__(pipe, path, dtype, max_sequence_length, resolution, frames)
        self.decoder = GlmImageFamily(pipe, path, dtype, max_sequence_length, (self.height, self.width))
        self.decoder_steps, self.decoder_guidance = int(decoder_steps), float(decoder_guidance)
        self.decoder_seed = int(decoder_seed)
        self.codebook = self.transformer.config.vq_config.num_embeddings
        token_h, token_w, prev_h, prev_w = pipe.processor._get_target_shape(self.height, self.width)
        self.grid, self.preview = (token_h, token_w), (prev_h, prev_w)

    resolution_multiple = staticmethod(GlmImageFamily.resolution_multiple)

    @classmethod
    def check_options(cls, path, options: dict, sampling) -> None:
        """Sampling the family does not do, refused before anything loads."""
        if getattr(sampling, "guidance_scale", 1.0) != 1.0:
            raise ModelLoadError(f"sampling.guidance_scale={sampling.guidance_scale}: GLM-Image's autoregressive model "
                                 "samples its tokens without guidance (the pipeline's generate); set "
                                 "sampling.guidance_scale=1 (the decoder's CFG is model.decoder_guidance)")
        if getattr(sampling, "cot_tokens", 0):
            raise ModelLoadError("sampling.cot_tokens: the glm_image_ar family has no chain of thought; set "
                                 "sampling.cot_tokens=0")

    @property
    def lora_targets(self) -> list[str]:
        """The language model's attention and MLP projections (named in full: the vision tower's are not)."""
        return [n for n, _ in self.transformer.named_modules()
                if n.startswith("model.language_model.") and n.endswith(_LORA_SUFFIXES)]

    def image_token_count(self) -> int:
        return self.preview[0] * self.preview[1] + self.grid[0] * self.grid[1]

    def latent_shape(self) -> tuple[int]:
        return (self.image_token_count(),)

    def identity(self) -> str:
        return f"{super().identity()}:ar"

    def describe(self) -> dict:
        return {"resolution": [self.height, self.width], "image_tokens": self.image_token_count(),
                "guidance": self.guidance, "preview_grid": list(self.preview), "decoder_steps": self.decoder_steps,
                "decoder_guidance": self.decoder_guidance, "decoder_seed": self.decoder_seed}

    # --- prompts ------------------------------------------------------------------------------
    def encode_prompts(self, prompts: list[str]) -> GlmArPrompts:
        """The pipeline's model inputs of each prompt alone, left-padded, with their positions."""
        rows, grid = zip(*(self._prompt_ids(p) for p in prompts))
        width, pad = max(len(r) for r in rows), self.pipe.processor.tokenizer.pad_token_id
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        model = self.transformer.model
        positions, _ = model.get_rope_index(ids, torch.cat(grid).to(self.device),
                                            torch.full((len(rows),), len(grid[0]), device=self.device), mask)
        return GlmArPrompts(ids, mask, positions, model._cached_decode_position_ids.clone())

    def _prompt_ids(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [L], grids [2, 3]) as `generate_prior_tokens` builds them for one prompt."""
        turn = [[{"role": "user", "content": [{"type": "text", "text": prompt}]}]]
        with quiet_processor():
            inputs = self.pipe.processor.apply_chat_template(turn, tokenize=True, target_h=self.height,
                                                             target_w=self.width, return_dict=True,
                                                             return_tensors="pt")
        return inputs["input_ids"][0], inputs["image_grid_thw"]

    # --- the token step -----------------------------------------------------------------------
    def _logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The head's logits with the image marks masked out: the codebook's softmax."""
        return logits.float().masked_fill(
            torch.arange(logits.shape[-1], device=logits.device) >= self.codebook, float("-inf"))

    @staticmethod
    def _refuse_guidance(guided: bool) -> None:
        if guided:
            raise ValueError("the glm_image_ar family samples without guidance; set sampling.guidance_scale=1")

    def first_logits(self, cond: GlmArPrompts, guided: bool) -> tuple[torch.Tensor, ArState]:
        from transformers import DynamicCache

        self._refuse_guidance(guided)
        out = self.transformer(input_ids=cond.ids, attention_mask=cond.mask, position_ids=cond.positions,
                               past_key_values=DynamicCache(config=self.transformer.config.text_config),
                               use_cache=True, logits_to_keep=1)
        return self._logits(out.logits[:, -1]), ArState(out.past_key_values, cond.mask, cond.decode, 0)

    def next_logits(self, state: ArState, tokens: torch.Tensor) -> tuple[torch.Tensor, ArState]:
        mask = torch.cat([state.mask, state.mask.new_ones((state.mask.shape[0], 1))], dim=1)
        positions = state.decode[:, :, state.fed:state.fed + 1].permute(1, 0, 2)
        out = self.transformer(input_ids=tokens.long()[:, None], attention_mask=mask, position_ids=positions,
                               past_key_values=state.cache, use_cache=True)
        return self._logits(out.logits[:, -1]), ArState(out.past_key_values, mask, state.decode, state.fed + 1)

    def sequence_logits(self, cond: GlmArPrompts, tokens: torch.Tensor, guided: bool) -> torch.Tensor:
        """Teacher-forced logits [B, N, V] of every token of `tokens` [B, N] in one pass."""
        self._refuse_guidance(guided)
        n = tokens.shape[1]
        ids = torch.cat([cond.ids, tokens[:, :-1].long()], dim=1)
        mask = torch.cat([cond.mask, cond.mask.new_ones((cond.mask.shape[0], n - 1))], dim=1)
        positions = torch.cat([cond.positions, cond.decode[:, :, :n - 1].permute(1, 0, 2)], dim=-1)
        out = self.transformer(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=n)
        return self._logits(out.logits)

    # --- decode -------------------------------------------------------------------------------
    def prior_of(self, tokens: torch.Tensor) -> torch.Tensor:
        """The decoder's prior tokens [B, (H/16)·(W/16)]: the large grid upsampled ×2 (nearest)."""
        (h, w), skip = self.grid, self.preview[0] * self.preview[1]
        large = tokens[:, skip:].long().view(-1, 1, h, w).float()
        return torch.nn.functional.interpolate(large, scale_factor=2, mode="nearest").long().flatten(1)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, prompts: list[str]) -> np.ndarray:
        """uint8 [B, H, W, 3]: the decoder's ODE given each row's prior tokens and its prompt's glyph
        embeddings, from noise seeded by `decoder_seed` and the prompt."""
        from ..algorithms.sampling import SamplerRecipe, generators, sample

        dec = self.decoder
        cond = dec.encode_glyphs(prompts)
        cond.prior = self.prior_of(tokens.to(self.device))
        guided = self.decoder_guidance > 1
        neg = dec.encode_negative("").expand(len(prompts)) if guided else None
        gens = generators([prompt_seed(self.decoder_seed, p) for p in prompts], self.device)
        recipe = SamplerRecipe(self.decoder_steps, 0.0, guidance_scale=self.decoder_guidance, train_steps=())
        return dec.decode(sample(dec, cond, neg, gens, recipe).final)

    @classmethod
    def write_tiny(cls, out_dir, seed: int = 0) -> dict:
        """GLM-Image's tiny checkpoint (`pixrl tiny glm_image`), run as its autoregressive model:
        64 px (a 16×16 preview and 2×2 large tokens), the decoder at 4 steps."""
        overrides = GlmImageFamily.write_tiny(out_dir, seed)
        return {**overrides, "model.family": cls.name, "model.decoder_steps": 4, "sampling.guidance_scale": 1.0}

