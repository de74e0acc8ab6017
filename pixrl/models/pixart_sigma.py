"""PixArt-Σ (diffusers PixArtSigmaPipeline): a DiT (PixArtTransformer2DModel: adaLN-single, cross-
attention to T5-XXL states under their attention mask) predicting ε and a learned variance (8
output channels, the first 4 the ε the pipeline steps with) on the SDXL VAE's latents, over a
linear-β DDPM schedule. visual-rl trains it.

Everything about the variance-preserving process is the sd15 family's (`SD15Family`): the DDIM
grid as flow noise levels, the flow velocity of the model's ε, DDPO's DDIM-η step, the DDPM
timesteps and ε error of DPO. What is PixArt's own: prompts encoded as the pipeline does (T5 with
`max_sequence_length` tokens, 300 by default, and their mask; no caption cleaning), the
transformer's call (mask, no resolution micro-conditions — Σ's `use_additional_conditions` is off),
and the learned-variance half of its output dropped, as the pipeline drops it.

The solver: the checkpoint ships DPM-Solver++ on a `linspace` grid, which DDIM does not step
consistently (diffusers' DDIMScheduler moves every linspace timestep to t − 1000/T, off its own
grid). Rollouts step the DDIM grid with `trailing` spacing instead — like linspace it starts at
t = 999 and ends near 0 — and the ODE equals PixArtSigmaPipeline given that DDIMScheduler.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .pipelines import encodes_text
from .registry import register_family
from .sd15 import SD15Family

__all__ = ["PixArtConditioning", "PixArtSigmaFamily"]


@dataclass
class PixArtConditioning:
    """T5's per-token states [B, L, 4096] and their attention mask [B, L]."""

    prompt_embeds: torch.Tensor
    mask: torch.Tensor

    def select(self, idx) -> "PixArtConditioning":
        return PixArtConditioning(self.prompt_embeds[idx], self.mask[idx])

    def expand(self, n: int) -> "PixArtConditioning":
        return PixArtConditioning(self.prompt_embeds.expand(n, -1, -1), self.mask.expand(n, -1))


@register_family("pixart_sigma")
class PixArtSigmaFamily(SD15Family):
    name = "pixart_sigma"
    pipeline_class = "PixArtSigmaPipeline"
    denoiser = "transformer"
    text_tokens = (1, 300)  # T5 tokens (the pipeline's max_sequence_length)
    # the attention projections of self- and cross-attention (diffusers' PixArt LoRA targets)
    lora_targets = ["to_k", "to_q", "to_v", "to_out.0"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.ddim.config.timestep_spacing == "linspace":  # see the module docstring
            from diffusers import DDIMScheduler

            self.ddim = DDIMScheduler.from_config(self.ddim.config, timestep_spacing="trailing")
        c = self.transformer.config
        self.learned_sigma = c.out_channels == 2 * c.in_channels

    @classmethod
    def load(cls, path: str | Path, dtype: str = "float32", device: str = "cpu", max_sequence_length: int = 300,
             resolution: int | tuple | None = None, frames: int | None = None, trainable_device: str | None = None,
             text_towers: bool = True) -> "PixArtSigmaFamily":
        return super().load(path, dtype, device, max_sequence_length, resolution, frames, trainable_device,
                            text_towers)

    @staticmethod
    def resolution_multiple(pipe) -> int:
        return pipe.vae_scale_factor * pipe.transformer.config.patch_size

    # --- conditioning -------------------------------------------------------------------------
    @encodes_text
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> PixArtConditioning:
        embeds, mask, _, _ = self.pipe.encode_prompt(list(prompts), do_classifier_free_guidance=False,
                                                     device=self.device, clean_caption=False,
                                                     max_sequence_length=self.max_sequence_length)
        return PixArtConditioning(embeds, mask)

    # --- the transformer's ε --------------------------------------------------------------------
    def unet_output(self, x_t: torch.Tensor, t: torch.Tensor, *conds: PixArtConditioning) -> torch.Tensor:
        """The transformer's ε (fp32) for x_t, the rows of `conds` stacked in order; the learned
        variance's channels dropped."""
        dtype = self.transformer.dtype
        embeds = torch.cat([c.prompt_embeds for c in conds]).to(dtype)
        mask = torch.cat([c.mask for c in conds])
        out = self.transformer(x_t.to(dtype), encoder_hidden_states=embeds, encoder_attention_mask=mask, timestep=t,
                               added_cond_kwargs={"resolution": None, "aspect_ratio": None}, return_dict=False)[0]
        return (out.chunk(2, dim=1)[0] if self.learned_sigma else out).float()

    # --- a tiny random checkpoint in the real layout --------------------------------------------
    @classmethod
    def write_tiny(cls, out_dir: Path, seed: int = 0) -> dict:
        """A random PixArt-Σ-shaped pipeline: a one-block DiT with learned variance (4 → 8
        channels, adaLN-single, T5 cross-attention), a tiny T5 encoder and tokenizer, a VAE with
        the SDXL VAE's scaling, and the checkpoint's DPM-Solver++ scheduler config (linear β,
        linspace spacing). Returns the overrides that run it (32 px)."""
        import shutil

        from diffusers import DPMSolverMultistepScheduler, PixArtSigmaPipeline, PixArtTransformer2DModel

        from .tiny_parts import image_vae, t5_encoder, t5_tokenizer

        torch.manual_seed(seed)
        build = out_dir.parent / (out_dir.name + "_build")
        tok = t5_tokenizer(build / "tokenizer", 300)
        text = t5_encoder(tok)
        dit = PixArtTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8,
                                       num_layers=1, cross_attention_dim=16, sample_size=8, patch_size=2,
                                       caption_channels=32, norm_num_groups=8, use_additional_conditions=False)
        vae = image_vae(latent_channels=4, scaling_factor=0.13025)
        sched = DPMSolverMultistepScheduler(beta_start=0.0001, beta_end=0.02, beta_schedule="linear",
                                            algorithm_type="dpmsolver++", solver_order=2, timestep_spacing="linspace",
                                            prediction_type="epsilon", lower_order_final=True)
        PixArtSigmaPipeline(tokenizer=tok, text_encoder=text, vae=vae, transformer=dit, scheduler=sched).save_pretrained(
            str(out_dir), safe_serialization=True)
        shutil.rmtree(build, ignore_errors=True)
        return {"model.family": cls.name, "model.path": str(out_dir), "model.resolution": 32,
                "model.max_sequence_length": 64}
