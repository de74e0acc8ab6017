"""GLM-Image (zai-org): a hybrid of a 9B autoregressive model and a 7B diffusion decoder. The
autoregressive model (GlmImageForConditionalGeneration, from GLM-4-9B with visual tokens) writes
a prompt's image as VQ tokens — a ~16×16 preview, then one token per 32×32 pixels — and the
decoder (GlmImageTransformer2DModel, a single-stream DiT) denoises the image's latents given
those "prior" tokens (upsampled ×2, one per 2×2 latent patch, added to the patch embeddings) and
the ByT5 "glyph" embeddings of the text the prompt quotes. This family trains the decoder: the
decoupled decoder RL of GLM-Image's post-training (fine detail and text rendering given the
autoregressive model's plan), with the autoregressive model a frozen conditioning tower.

What is the family's own, as GlmImagePipeline computes it:
- **prior tokens**: the pipeline's `generate_prior_tokens` for each prompt alone (a batch would
  left-pad prompts and change their positions), seeded per prompt: the seed is a digest of
  `model.prior_seed` and the prompt, so a prompt's plan is the same in every rollout, replay and
  process (it is part of the prompt's encoding and cached with it). Group members share the plan
  and differ in the decoder's noise, as decoupled decoder RL compares them. A token outside the
  codebook inside the image span (the sampler emitted an image mark there) is refused.
- **glyph embeddings**: the pipeline's `_get_glyph_embeds` of each prompt alone (the quoted text
  in '…', "…", “…” or 「…」, else the empty string), each row at its own length: the pipeline
  left-pads a batch with zeros that the transformer attends (it takes no text mask), so a
  prompt's encoding would depend on its batch; rows are denoised in groups of one length.
- **CFG**: the unconditional pass reads the negative glyph embeddings (the pipeline's is always
  the empty string) and drops the prior tokens (`prior_token_drop`); v = u + s·(c − u), the
  pipeline's `guidance_scale` (1.5 by default) is pixrl's s.
- **σ grid**: the integer timesteps `linspace(1000, 1, T + 1)[:-1]` and σ = t/1000 under the
  scheduler's shift with μ = 0.75·√(L/256) + 0.25 (L the 2×2-patch count); the transformer reads
  the *unshifted* timestep minus one, so off-grid σ map back through the inverse shift
  (`timesteps_at`).
- latents are normalised with the VAE's `latents_mean`/`latents_std`; sides a multiple of 32.
Text-to-image only (the pipeline's image-to-image conditioning through key/value caches is not
wired). LoRA targets: the DiT blocks' attention and MLP.
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .base import ModelLoadError
from .pipelines import PipelineFamily, encodes_text, to_uint8
from .registry import register_family
from .taxonomy import Action, PolicySemantics, PolicyStep, Regime

__all__ = ["GlmImageConditioning", "GlmImageFamily", "prompt_seed", "quiet_processor"]


@dataclass
class GlmImageConditioning:
    """Glyph embeddings (zero-padded to the longest row, each row's length beside them) and the
    prior tokens of each row (None in an unconditional encoding: CFG drops them)."""

    glyph: torch.Tensor  # [B, L, D]
    lengths: torch.Tensor  # [B] int64
    prior: torch.Tensor | None = None  # [B, (H/16)·(W/16)] int64

    def select(self, idx) -> "GlmImageConditioning":
        return GlmImageConditioning(self.glyph[idx], self.lengths[idx],
                                    None if self.prior is None else self.prior[idx])

    def expand(self, n: int) -> "GlmImageConditioning":
        return GlmImageConditioning(self.glyph.expand(n, -1, -1), self.lengths.expand(n),
                                    None if self.prior is None else self.prior.expand(n, -1))


def prompt_seed(seed: int, prompt: str) -> int:
    """A seed of its own for each prompt: a digest of `seed` (`model.prior_seed` for the prior tokens,
    `model.decoder_seed` for glm_image_ar's decoder noise) and the prompt."""
    return int.from_bytes(hashlib.sha256(f"{int(seed)}\x1f{prompt}".encode()).digest()[:8], "big") >> 1


@contextmanager
def quiet_processor():
    """transformers' warning about the pipeline's processor keywords (`target_h`/`target_w`, which
    the processor still reads) silenced while it formats a prompt: one line per prompt otherwise."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


@register_family("glm_image")
class GlmImageFamily(PipelineFamily):
    name = "glm_image"
    pipeline_class = "GlmImagePipeline"
    semantics = PolicySemantics(regime=Regime.full_sequence, step=PolicyStep.denoise, action=Action.continuous)
    guidance = "cfg"
    text_tokens = (1, 2048)  # the glyph encoder's tokens per quoted text (the pipeline's 2048)
    conditioning_towers = ("text_encoder", "vision_language_encoder")
    options = {"prior_seed": "the seed from which each prompt's prior tokens are sampled (with the prompt's digest)"}
    lora_targets = ["attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "ff.net.0.proj", "ff.net.2"]

    def __init__(self, pipe, *args, prior_seed: int = 0, **kwargs):
        super().__init__(pipe, *args, **kwargs)
        self.prior_seed = int(prior_seed)

    @staticmethod
    def resolution_multiple(pipe) -> int:
        return 32  # the autoregressive model's tokens are 32×32 pixels each

    def identity(self) -> str:
        return f"{super().identity()}:prior{self.prior_seed}"

    def describe(self) -> dict:
        return {**super().describe(), "prior_seed": self.prior_seed}

    # --- conditioning -------------------------------------------------------------------------
    @encodes_text
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> GlmImageConditioning:
        """Each prompt's glyph embeddings and prior tokens, computed alone (the pipeline's own)."""
        cond = self._glyphs(prompts)
        cond.prior = torch.cat([self.prior_tokens(p) for p in prompts]).to(self.device)
        return cond

    def encode_negative(self, text: str) -> GlmImageConditioning:
        """The unconditional pass's glyph embeddings of `text` (the pipeline's: ""), no prior tokens."""
        return self.encode_glyphs([text])

    @encodes_text
    @torch.no_grad()
    def encode_glyphs(self, prompts: list[str]) -> GlmImageConditioning:
        """Each prompt's glyph embeddings, computed alone (its own length), without prior tokens."""
        return self._glyphs(prompts)

    def _glyphs(self, prompts: list[str]) -> GlmImageConditioning:
        rows = [self.pipe._get_glyph_embeds([p], self.max_sequence_length, self.device)[0] for p in prompts]
        lengths = torch.tensor([len(r) for r in rows], device=self.device)
        glyph = rows[0].new_zeros(len(rows), int(lengths.max()), rows[0].shape[-1])
        for i, r in enumerate(rows):
            glyph[i, : len(r)] = r
        return GlmImageConditioning(glyph, lengths)

    def prior_tokens(self, prompt: str) -> torch.Tensor:
        """[1, (H/16)·(W/16)] prior tokens of `prompt`, as `generate_prior_tokens` samples them with
        a generator of the prompt's seed; the global RNG it reseeds is restored afterwards."""
        ar = self.pipe.vision_language_encoder
        seed = prompt_seed(self.prior_seed, prompt)
        with torch.random.fork_rng(devices=[ar.device] if ar.device.type == "cuda" else []), quiet_processor():
            ids, _, _ = self.pipe.generate_prior_tokens(prompt=[prompt], height=self.height, width=self.width,
                                                        device=ar.device,
                                                        generator=torch.Generator().manual_seed(seed))
        codebook = self.transformer.config.prior_vq_quantizer_codebook_size
        if int(ids.max()) >= codebook or int(ids.min()) < 0:
            raise ValueError(f"the GLM-Image autoregressive model of {self.path!r} sampled a token outside its "
                             f"{codebook}-entry codebook inside the image of {prompt!r}: its generation config must "
                             "keep the image marks out of the image span (check vision_language_encoder/"
                             "generation_config.json)")
        return ids

    # --- dynamics -----------------------------------------------------------------------------
    def latent_shape(self) -> tuple[int, int, int]:
        f = self.pipe.vae_scale_factor
        return self.transformer.config.in_channels, self.height // f, self.width // f

    def _mu(self) -> float:
        from diffusers.pipelines.glm_image.pipeline_glm_image import calculate_shift

        _, h, w = self.latent_shape()
        p, c = self.transformer.config.patch_size, self.scheduler.config
        return calculate_shift((h // p) * (w // p), c.get("base_image_seq_len", 256), c.get("base_shift", 0.25),
                               c.get("max_shift", 0.75))

    def schedule(self, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(σ [T+1] ending at 0, timesteps [T]) as GlmImagePipeline sets them: integer timesteps,
        their σ shifted with the image's μ, the timesteps themselves unshifted."""
        from copy import deepcopy

        n = self.scheduler.config.num_train_timesteps
        timesteps = np.linspace(n, 1.0, steps + 1)[:-1].astype(np.int64).astype(np.float32)
        sched = deepcopy(self.scheduler)
        sched.set_timesteps(sigmas=timesteps / n, timesteps=timesteps, device=self.device, mu=self._mu())
        return sched.sigmas.float().clone(), sched.timesteps.float().clone()

    def timesteps_at(self, sigma: torch.Tensor) -> torch.Tensor:
        """The timestep the transformer reads at a (shifted) σ off the grid: the shift undone, ×1000."""
        c, s = self.scheduler.config, torch.as_tensor(sigma, dtype=torch.float32)
        if c.get("use_dynamic_shifting", False):
            k = self._mu() if c.get("time_shift_type", "exponential") == "linear" else float(np.exp(self._mu()))
        else:
            k = float(c.get("shift", 1.0))  # σ' = kσ / (1 + (k − 1)σ): the same map with k for e^μ
        safe = s.clamp_min(1e-12)
        raw = torch.where(s > 0, 1.0 / (1.0 + k * (1.0 / safe - 1.0)), torch.zeros_like(s))
        return raw * float(c.num_train_timesteps)

    def velocity(self, x: torch.Tensor, timestep: torch.Tensor, cond: GlmImageConditioning,
                 guidance_scale: float = 1.0, neg: GlmImageConditioning | None = None) -> torch.Tensor:
        """v_θ(x, t | c) on latents [B, C, H, W]; s > 1: the pipeline's CFG against `neg` with the
        prior tokens dropped."""
        b = x.shape[0]
        t = timestep.reshape(-1).to(x.device).float()
        t = (t.expand(b) if t.numel() == 1 else t) - 1
        out = self._denoise(x, t, cond, cond.prior, drop=False)
        if guidance_scale > 1.0:
            if neg is None:
                raise ValueError("guidance_scale > 1 needs the negative-prompt conditioning")
            uncond = self._denoise(x, t, neg, cond.prior, drop=True)
            out = uncond + guidance_scale * (out - uncond)
        return out

    def _denoise(self, x, t, glyphs: GlmImageConditioning, prior: torch.Tensor, drop: bool) -> torch.Tensor:
        """The transformer's output [B, C, H, W] (float32), rows of one glyph length per call."""
        dt = self.transformer.dtype
        size = torch.tensor([[self.height, self.width]], dtype=dt, device=x.device).expand(x.shape[0], 2)
        crop = torch.zeros_like(size)
        out = x.new_empty(x.shape, dtype=torch.float32)
        lengths = glyphs.lengths.to(x.device)
        for n in lengths.unique().tolist():
            rows = (lengths == n).nonzero().squeeze(1)
            ids = prior[rows].to(x.device)
            out[rows] = self.transformer(
                hidden_states=x[rows].to(dt), encoder_hidden_states=glyphs.glyph[rows, :n].to(dt),
                prior_token_id=ids, prior_token_drop=torch.full_like(ids, drop, dtype=torch.bool), timestep=t[rows],
                target_size=size[rows], crop_coords=crop[rows], return_dict=False)[0].float()
        return out

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Final latents → uint8 [B, H, W, 3]: un-normalised with the VAE's mean and std, decoded."""
        c, z = self.vae.config, latents.to(self.vae.dtype)
        mean = torch.tensor(c.latents_mean, device=z.device, dtype=z.dtype).view(1, -1, 1, 1)
        std = torch.tensor(c.latents_std, device=z.device, dtype=z.dtype).view(1, -1, 1, 1)
        return to_uint8(self.vae.decode(z * std + mean, return_dict=False)[0])

    def check_size(self) -> None:
        super().check_size()
        if self.transformer.config.patch_size * self.pipe.vae_scale_factor != 16:
            raise ModelLoadError(f"the {self.name} checkpoint at {self.path!r} has a VAE factor × patch size of "
                                 f"{self.transformer.config.patch_size * self.pipe.vae_scale_factor}; GLM-Image's "
                                 "prior tokens (one per 16 px) need 16")

    # --- a tiny random checkpoint in the real layout --------------------------------------------
    @classmethod
    def write_tiny(cls, out_dir: Path, seed: int = 0) -> dict:
        """A random GLM-Image-shaped pipeline: a GLM autoregressive model over a 64-entry codebook
        with its processor, a ByT5 glyph encoder, a 2-block DiT, an 8× VAE with latent mean/std and
        CogView4's linear dynamic shift. Returns the overrides that run it (64 px)."""
        import shutil

        from diffusers import FlowMatchEulerDiscreteScheduler, GlmImagePipeline

        from .tiny_glm_image import glm_image_ar, glm_image_decoder, glm_image_processor, glyph_tower

        torch.manual_seed(seed)
        build = out_dir.parent / (out_dir.name + "_build")
        codebook = 64
        proc = glm_image_processor(build / "processor", codebook)
        tok, text = glyph_tower()
        transformer, vae = glm_image_decoder(text.config.d_model, codebook)
        sched = FlowMatchEulerDiscreteScheduler(base_shift=0.25, max_shift=0.75, base_image_seq_len=256,
                                                use_dynamic_shifting=True, time_shift_type="linear")
        GlmImagePipeline(tokenizer=tok, processor=proc, text_encoder=text, vision_language_encoder=glm_image_ar(
            proc.tokenizer, codebook), vae=vae, transformer=transformer, scheduler=sched).save_pretrained(
            str(out_dir), safe_serialization=True)
        shutil.rmtree(build, ignore_errors=True)
        return {"model.family": cls.name, "model.path": str(out_dir), "model.resolution": 64,
                "model.max_sequence_length": 64}
