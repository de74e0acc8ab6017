"""FLUX.2 family (dev): diffusers Flux2Transformer2DModel + AutoencoderKLFlux2 (32 channels,
2×2 patchified and batch-normalised latents) + FlowMatchEulerDiscreteScheduler with FLUX.2's
empirical shift μ(sequence length, steps) + a Mistral-Small-3 text encoder (hidden states of
layers 10, 20 and 30 stacked, under the pipeline's system message).

Loads any directory in the diffusers Flux2Pipeline layout and reuses the pipeline's own
`encode_prompt`, latent ids and (de)normalisation, so conditioning, velocity and decode are what
the pipeline computes. Latents are the pipeline's patchified latents [4·C, H/2, W/2] — the
shape it draws noise in — and `velocity` flattens them into the token sequence the transformer
reads (packing is a reshape; the 4-D position ids place each token).

Guidance is FLUX.2-dev's distilled guidance: the scale is a transformer input
(`guidance_embeds`), no negative prompt is encoded.

FLUX.2 also edits: given a prompt set whose prompts carry source images (docs/editing.md), each
prompt's image is its reference — VAE-encoded at its mode, patchified and batch-normalised, its
tokens read after the target's with position ids at time offset 10, as Flux2Pipeline does with one
`image`. The reference is resized (aspect kept, centre-cropped) to the family's size;
the pipeline keeps a source's own size (up to 1 MP), so the two agree for sources of that size. A
prompt set is all edits or all text-to-image; one reference per prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .pipelines import SIGMAS_OPTION, PipelineFamily, encodes_text, pixels_to_uint8, unit_range
from .registry import register_family
from .taxonomy import Action, PolicySemantics, PolicyStep, Regime

__all__ = ["Flux2Conditioning", "Flux2Family"]


@dataclass
class Flux2Conditioning:
    """Mistral-3 hidden states (three layers, concatenated per token) and the text position ids;
    for an edit, the reference image's tokens and their position ids."""

    prompt_embeds: torch.Tensor  # [B, L, 3·D]
    text_ids: torch.Tensor  # [B, L, 4]
    image_latents: torch.Tensor | None = None  # [B, L_ref, C]
    image_ids: torch.Tensor | None = None  # [B, L_ref, 4]

    def select(self, idx) -> "Flux2Conditioning":
        pick = lambda t: None if t is None else t[idx]  # noqa: E731
        return Flux2Conditioning(self.prompt_embeds[idx], self.text_ids[idx], pick(self.image_latents),
                                 pick(self.image_ids))

    def expand(self, n: int) -> "Flux2Conditioning":
        grow = lambda t: None if t is None else t.expand(n, -1, -1)  # noqa: E731
        return Flux2Conditioning(grow(self.prompt_embeds), grow(self.text_ids), grow(self.image_latents),
                                 grow(self.image_ids))


@register_family("flux2")
class Flux2Family(PipelineFamily):
    name = "flux2"
    options = SIGMAS_OPTION
    pipeline_class = "Flux2Pipeline"
    semantics = PolicySemantics(regime=Regime.full_sequence, step=PolicyStep.denoise, action=Action.continuous)
    guidance = "embedded"  # the scale is a transformer input; no negative prompt is encoded
    text_tokens = (1, 512)
    takes_images = True  # a prompt may carry a source image: its reference (an edit)

    @property
    def lora_targets(self) -> list[str]:
        """diffusers' FLUX.2 LoRA training targets: the double blocks' attention projections, the
        single blocks' fused qkv+MLP input and, by full name (its suffix would also name the
        double blocks' `to_out` container), each single block's output projection."""
        n = self.transformer.config.num_single_layers
        return ["to_k", "to_q", "to_v", "to_out.0", "to_qkv_mlp_proj",
                *[f"single_transformer_blocks.{i}.attn.to_out" for i in range(n)]]

    @staticmethod
    def swap_components(path: Path) -> dict:
        """FLUX.2-dev declares its tokenizer as a PixtralProcessor, which transformers will not build
        without torchvision; the pipeline only renders text prompts through its chat template, so
        then the folder's tokenizer (same files, same template) is loaded on its own."""
        import importlib.util
        import json

        declared = json.loads((path / "model_index.json").read_text()).get("tokenizer", [None, None])[1] or ""
        if declared.endswith("Processor") and importlib.util.find_spec("torchvision") is None:
            from transformers import AutoTokenizer

            return {"tokenizer": lambda: AutoTokenizer.from_pretrained(str(path / "tokenizer"))}
        return {}

    def describe(self) -> dict:
        _, h, w = self.latent_shape()
        return {"resolution": [self.height, self.width], "guidance": self.guidance,
                "shift": "flux2 empirical μ", "image_seq_len": h * w}

    # --- conditioning -------------------------------------------------------------------------
    @encodes_text
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], images: list[bytes | None] | None = None) -> Flux2Conditioning:
        embeds, text_ids = self.pipe.encode_prompt(prompt=prompts, device=self.device,
                                                   max_sequence_length=self.max_sequence_length)
        if images is None or all(im is None for im in images):
            return Flux2Conditioning(embeds, text_ids)
        if any(im is None for im in images):
            from .source_images import SourceImageError

            raise SourceImageError("these prompts mix edits (with a source image) and text-to-image prompts; a "
                                   "FLUX.2 prompt set is all one or the other")
        refs = [self._reference(im) for im in images]
        return Flux2Conditioning(embeds, text_ids, torch.cat([r for r, _ in refs]), torch.cat([i for _, i in refs]))

    def _reference(self, image: bytes) -> tuple[torch.Tensor, torch.Tensor]:
        """([1, L, C] tokens, [1, L, 4] ids) of one source image, as Flux2Pipeline's
        `prepare_image_latents` makes them for a single `image` at the family's resolution."""
        from .source_images import decode_rgb

        pixels = self.pipe.image_processor.preprocess(decode_rgb(image), height=self.height, width=self.width,
                                                      resize_mode="crop")
        return self.pipe.prepare_image_latents([pixels], 1, None, self.device, self.vae.dtype)

    # --- dynamics -----------------------------------------------------------------------------
    def latent_shape(self) -> tuple[int, int, int]:
        return self.transformer.config.in_channels, *self.latent_grid(self.pipe.vae_scale_factor * 2)

    def schedule(self, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(σ [T+1] ending at 0, timesteps [T]) as Flux2Pipeline sets them: linspace(1, 1/T) with
        the empirical μ of its image sequence length and step count."""
        from copy import deepcopy

        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        _, h, w = self.latent_shape()
        sched = deepcopy(self.scheduler)
        sigmas = None if sched.config.get("use_flow_sigmas") else self.grid_sigmas(steps, np.linspace(1.0, 1 / steps, steps))
        sched.set_timesteps(steps, device=self.device, sigmas=sigmas, mu=compute_empirical_mu(h * w, steps))
        return sched.sigmas.float().clone(), sched.timesteps.float().clone()

    def velocity(self, x: torch.Tensor, timestep: torch.Tensor, cond: Flux2Conditioning,
                 guidance_scale: float = 1.0, neg: Flux2Conditioning | None = None) -> torch.Tensor:
        """v_θ(x, t | c) on patchified latents [B, C, H, W]; the scale as FLUX.2-dev's guidance embedding."""
        b, c, h, w = x.shape
        t = timestep.reshape(-1).to(x.device, x.dtype)
        t = t.expand(b) if t.numel() == 1 else t
        guidance = (torch.full((b,), float(guidance_scale), device=x.device, dtype=torch.float32)
                    if self.transformer.config.guidance_embeds else None)
        tokens = self.pipe._pack_latents(x).to(self.transformer.dtype)
        ids = self.pipe._prepare_latent_ids(x).to(x.device)
        if cond.image_latents is not None:  # an edit: the reference's tokens after the target's
            tokens = torch.cat([tokens, cond.image_latents.to(tokens.dtype)], dim=1)
            ids = torch.cat([ids, cond.image_ids.to(ids.device)], dim=1)
        out = self.transformer(hidden_states=tokens, timestep=t / 1000, guidance=guidance,
                               encoder_hidden_states=cond.prompt_embeds, txt_ids=cond.text_ids, img_ids=ids,
                               return_dict=False)[0][:, : h * w]
        return out.permute(0, 2, 1).reshape(b, c, h, w)

    # --- pixels -------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Final latents → uint8 [B, H, W, 3]: `decode_pixels`, quantised."""
        return pixels_to_uint8(self.decode_pixels(latents))

    def decode_pixels(self, latents: torch.Tensor) -> torch.Tensor:
        """Final latents → images [B, 3, H, W] in [0, 1], differentiable: the VAE's batch-norm
        statistics undone, unpatchify, decode."""
        vae = self.vae
        z = latents.to(vae.dtype)
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(z.device, z.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(z.device, z.dtype)
        z = self.pipe._unpatchify_latents(z * std + mean)
        return unit_range(vae.decode(z, return_dict=False)[0])

    # --- a tiny random checkpoint in the real layout --------------------------------------------
    @classmethod
    def write_tiny(cls, out_dir: Path, seed: int = 0) -> dict:
        """A random FLUX.2-dev-shaped pipeline (Mistral-3 encoder with 30 layers and a Pixtral
        processor, batch-normalised 2×2-patchified VAE latents, guidance embedding, 4-axis RoPE)
        with tiny widths, saved with `save_pretrained`. Returns the overrides that run it (32 px)."""
        import re
        import shutil

        from diffusers import Flux2Pipeline
        from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

        from .tiny_parts import as_pixtral_processor, mistral3_text_encoder, mistral3_tokenizer

        torch.manual_seed(seed)
        build = out_dir.parent / (out_dir.name + "_build")
        tok = mistral3_tokenizer(build / "tokenizer", re.findall(r"[A-Za-z]+", SYSTEM_MESSAGE))
        text_encoder = mistral3_text_encoder(tok)
        vae, transformer, sched = tiny_flux2_parts(text_hidden=16, guidance_embeds=True)
        Flux2Pipeline(scheduler=sched, vae=vae, text_encoder=text_encoder, tokenizer=tok,
                      transformer=transformer).save_pretrained(str(out_dir), safe_serialization=True)
        as_pixtral_processor(out_dir)
        shutil.rmtree(build, ignore_errors=True)
        return {"model.family": cls.name, "model.path": str(out_dir), "model.resolution": 32,
                "model.max_sequence_length": 96}


def tiny_flux2_parts(text_hidden: int, guidance_embeds: bool):
    """(VAE, transformer, scheduler) of a tiny FLUX.2-shaped pipeline: a 2×2-patchified 4-channel
    VAE with non-trivial batch-norm statistics (so decode exercises the de-normalisation), one
    double and two single blocks reading three stacked text layers of width `text_hidden`."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    z = 4
    vae = AutoencoderKLFlux2(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                             up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, latent_channels=z,
                             norm_num_groups=8, mid_block_add_attention=False)
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.randn(4 * z) * 0.3)
        vae.bn.running_var.copy_(torch.rand(4 * z) + 0.5)
    transformer = Flux2Transformer2DModel(in_channels=4 * z, num_layers=1, num_single_layers=2, attention_head_dim=16,
                                          num_attention_heads=2, joint_attention_dim=3 * text_hidden,
                                          timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4),
                                          guidance_embeds=guidance_embeds)
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                            base_image_seq_len=256, max_image_seq_len=4096)
    return vae, transformer, sched
