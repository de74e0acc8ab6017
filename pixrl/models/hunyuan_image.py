"""HunyuanImage-2.1 text-to-image (Tencent, 2K): diffusers HunyuanImageTransformer2DModel (a 17B
DiT of 20 double- and 40 single-stream blocks over 1×1 patches of 64-channel latents),
AutoencoderKLHunyuanImage (×32 in space), Qwen2.5-VL's language model under the pipeline's
description template (hidden states two layers from the top, the template's first 34 tokens
dropped) and ByT5 for quoted text (glyphs; zeros when the prompt quotes nothing), on a
flow-matching Euler schedule (`linspace(1, 0, T+1)[:-1]` under the scheduler's shift).

What is the family's own, as HunyuanImagePipeline computes it — its guidance. The checkpoint's
`guider` (and `ocr_guider` for prompts that quote text) is AdaptiveProjectedMixGuidance: plain CFG
u + s·(c − u) for the first steps, then adaptive projected guidance (APG) — the momentum buffer
m_k = (c − u) + μ·m_{k−1} (updated from the first step), scaled down to the norm threshold, split
into its parts parallel and orthogonal to c, and u + s_apg·(orthogonal + η·parallel). The buffer
makes step k depend on every earlier step, so the family keeps it as a `GuidanceMemory`
(algorithms/guidance_memory.py): rollouts store m_{k−1} beside each stored transition and replay
reads it back — ODE sampling is the pipeline's, and the log-probs recompute exactly.
`sampling.guidance_scale` is the guiders' CFG scale s (1 turns guidance off, as it turns the
guider off); the APG scale, momentum, threshold, η and start step are the guider configs' own.
Each row takes the OCR guider when its prompt quotes text (the pipeline takes it for a whole batch
when any prompt does: the same for a batch of one).

Not supported (refused by name): the distilled checkpoints (guidance embedding, MeanFlow's second
timestep) and guiders restricted to part of the schedule or in the original CFG formulation.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..algorithms.guidance_memory import GuidanceMemory
from .base import ModelLoadError
from .hunyuan_video import shifted_linspace_grid
from .hunyuan_video15 import HunyuanVideo15Conditioning as HunyuanImageConditioning
from .pipelines import PipelineFamily, encodes_text
from .registry import register_family
from .taxonomy import Action, PolicySemantics, PolicyStep, Regime

__all__ = ["HunyuanImageConditioning", "HunyuanImageFamily", "apg_guided", "guider_settings"]

_GUIDERS = ("guider", "ocr_guider")


@register_family("hunyuan_image")
class HunyuanImageFamily(PipelineFamily):
    name = "hunyuan_image"
    pipeline_class = "HunyuanImagePipeline"
    semantics = PolicySemantics(regime=Regime.full_sequence, step=PolicyStep.denoise, action=Action.continuous)
    guidance = "cfg"
    text_tokens = (1, 1000)  # Qwen2.5-VL tokens after the template (the pipeline's 1000)
    # the attention projections of both streams (as for the HunyuanVideo DiTs)
    lora_targets = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                    "attn.add_v_proj", "attn.to_add_out"]

    def __init__(self, pipe, *args, **kwargs):
        super().__init__(pipe, *args, **kwargs)
        cfg = self.transformer.config
        if cfg.get("use_meanflow", False) or cfg.get("guidance_embeds", False):
            raise ModelLoadError(f"{self.path!r} is a distilled HunyuanImage-2.1 (guidance embedding / MeanFlow's "
                                 "second timestep), which the family does not step; use the base checkpoint")
        self.guiders = {name: guider_settings(self.path, name, getattr(pipe, name, None)) for name in _GUIDERS}
        pipe.tokenizer_max_length = self.max_sequence_length  # the pipeline then encodes as the family does

    @property
    def guidance_memory(self) -> bool:
        """Whether CFG sampling keeps APG's momentum buffer across steps (a guider with a momentum)."""
        return any(g is not None and g["adaptive_projected_guidance_momentum"] is not None
                   for g in self.guiders.values())

    def describe(self) -> dict:
        return {"resolution": [self.height, self.width], "shift": self.scheduler.config.get("shift"),
                "guidance": self.guidance, "guiders": self.guiders}

    # --- conditioning -------------------------------------------------------------------------
    @encodes_text
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> HunyuanImageConditioning:
        """The pipeline's `encode_prompt`: both towers' states and masks."""
        embeds, mask, glyphs, glyph_mask = self.pipe.encode_prompt(list(prompts), device=self.device,
                                                                   batch_size=len(prompts))
        return HunyuanImageConditioning(embeds, mask, glyphs, glyph_mask)

    # --- dynamics -----------------------------------------------------------------------------
    def latent_shape(self) -> tuple[int, int, int]:
        h, w = self.latent_grid(self.pipe.vae_scale_factor)
        return self.transformer.config.in_channels, h, w

    def schedule(self, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(σ [T+1] ending at 0, timesteps [T]): linspace(1, 0, T+1)[:-1], shifted by the scheduler."""
        return shifted_linspace_grid(self.scheduler, steps, self.device)

    def velocity(self, x: torch.Tensor, timestep: torch.Tensor, cond: HunyuanImageConditioning,
                 guidance_scale: float = 1.0, neg: HunyuanImageConditioning | None = None,
                 memory: GuidanceMemory | None = None, step: int = 0) -> torch.Tensor:
        """v_θ(x, t | c); guidance_scale > 1: each row's guider at step `step` of the grid (the
        sampler gives it; a bare call is the grid's first step), reading APG's momentum from
        `memory` (m_{k−1}; none: the buffer's initial 0) and leaving m_k there."""
        t = timestep.reshape(-1).to(x.device)
        t = t.expand(x.shape[0]) if t.numel() == 1 else t
        v = self._predict(x, t, cond)
        if guidance_scale <= 1.0:
            return v
        if neg is None:
            raise ValueError("guidance_scale > 1 needs the negative-prompt conditioning")
        u = self._predict(x, t, neg)
        ocr = cond.glyph_mask.bool().any(dim=1)
        out, m_new = torch.empty_like(v), torch.empty_like(v)
        plain = self.guiders["guider"]
        for g, rows in ((self.guiders["ocr_guider"] or plain, ocr), (plain, ~ocr)):
            if not bool(rows.any()):
                continue
            if g is None:
                raise ValueError(f"{self.path!r} has no guider: its pipeline samples without guidance; "
                                 "set sampling.guidance_scale=1")
            prev = None if memory is None or memory.value is None else memory.value[rows].to(v.dtype)
            out[rows], m = apg_guided(v[rows], u[rows], guidance_scale, g, step, prev)
            m_new[rows] = m if m is not None else 0.0
        if memory is not None:
            memory.value = m_new
        return out

    def _predict(self, x: torch.Tensor, t: torch.Tensor, cond: HunyuanImageConditioning) -> torch.Tensor:
        dtype = self.transformer.dtype
        return self.transformer(hidden_states=x.to(dtype), timestep=t.to(dtype),
                                encoder_hidden_states=cond.prompt_embeds.to(dtype), encoder_attention_mask=cond.mask,
                                encoder_hidden_states_2=cond.glyph_embeds.to(dtype),
                                encoder_attention_mask_2=cond.glyph_mask, return_dict=False)[0]

    # --- a tiny random checkpoint in the real layout --------------------------------------------
    @classmethod
    def write_tiny(cls, out_dir: Path, seed: int = 0) -> dict:
        """A random HunyuanImage-2.1-shaped pipeline (`tiny_hunyuan_image_parts`) saved in the
        diffusers layout. Returns the overrides that run it (32 px: 4 × 4 latents)."""
        import shutil

        from diffusers import HunyuanImagePipeline

        build = out_dir.parent / (out_dir.name + "_build")
        HunyuanImagePipeline(**tiny_hunyuan_image_parts(build, seed)).save_pretrained(str(out_dir),
                                                                                     safe_serialization=True)
        shutil.rmtree(build, ignore_errors=True)
        return {"model.family": cls.name, "model.path": str(out_dir), "model.resolution": 32,
                "model.max_sequence_length": 64}


def apg_guided(c: torch.Tensor, u: torch.Tensor, scale: float, g: dict, step: int,
               prev: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(guided velocity, the momentum after this step or None without one) of AdaptiveProjectedMixGuidance
    with config `g` at grid step `step`, the CFG scale `scale`, and the momentum before it `prev`
    (None: the buffer's initial 0). Per row: norms and projections over each sample's elements."""
    mu = g["adaptive_projected_guidance_momentum"]
    diff = c - u
    m = None if mu is None else diff + mu * (prev if prev is not None else 0.0)
    apg_scale = g["adaptive_projected_guidance_scale"]
    if step <= g["adaptive_projected_guidance_start_step"] or abs(apg_scale - 1.0) <= 1e-9:
        pred = u + scale * diff  # CFG (the buffer still moves)
    else:
        d = m if m is not None else diff
        dims = [-i for i in range(1, d.ndim)]
        threshold = g["adaptive_projected_guidance_rescale"]
        if threshold > 0:
            d = d * torch.minimum(torch.ones_like(d), threshold / d.norm(p=2, dim=dims, keepdim=True))
        unit = torch.nn.functional.normalize(c.double(), dim=dims)
        parallel = (d.double() * unit).sum(dim=dims, keepdim=True) * unit
        update = (d.double() - parallel).type_as(d) + g["eta"] * parallel.type_as(d)
        pred = u + apg_scale * update
    if g["guidance_rescale"] > 0.0:
        from diffusers.guiders.guider_utils import rescale_noise_cfg

        pred = rescale_noise_cfg(pred, c, g["guidance_rescale"])
    return pred, m


def guider_settings(path: str, name: str, guider) -> dict | None:
    """A guider's settings the family reads, after refusing what it does not model."""
    if guider is None:
        return None
    cfg = dict(guider.config)
    if type(guider).__name__ != "AdaptiveProjectedMixGuidance":
        raise ModelLoadError(f"{path!r}: its {name} is a {type(guider).__name__}; the hunyuan_image family steps "
                             "HunyuanImage-2.1's AdaptiveProjectedMixGuidance")
    if cfg.get("start", 0.0) != 0.0 or cfg.get("stop", 1.0) != 1.0 or not cfg.get("enabled", True):
        raise ModelLoadError(f"{path!r}: its {name} applies guidance only from {cfg.get('start')} to {cfg.get('stop')} "
                             f"of the schedule (enabled: {cfg.get('enabled')}), which the family does not model; set "
                             f"start 0, stop 1 and enabled true in {name}/guider_config.json")
    if cfg.get("use_original_formulation", False):
        raise ModelLoadError(f"{path!r}: its {name} uses the original CFG formulation, which the family does not "
                             f"model; set use_original_formulation false in {name}/guider_config.json")
    keys = ("adaptive_projected_guidance_momentum", "adaptive_projected_guidance_scale",
            "adaptive_projected_guidance_rescale", "adaptive_projected_guidance_start_step", "eta",
            "guidance_rescale")
    return {k: cfg[k] for k in keys}


def tiny_hunyuan_image_parts(build: Path, seed: int, **transformer) -> dict:
    """Seeded tiny HunyuanImage-2.1 components: a 3-layer Qwen2.5-VL with the template tokenizer
    (its system part 34 tokens, as the pipeline drops), a tiny ByT5, the ×8 image VAE (4 latent
    channels), a DiT of one double- and one single-stream block with its token refiner and ByT5
    projection (`transformer`: further config), the Euler scheduler (shift 5) and both guiders —
    APG from step 2 (OCR: step 1, momentum −0.3), so a few steps exercise the buffer."""
    from diffusers import (AdaptiveProjectedMixGuidance, AutoencoderKLHunyuanImage, FlowMatchEulerDiscreteScheduler,
                           HunyuanImageTransformer2DModel)

    from .tiny_parts import byt5_glyph_encoder, qwen2_tokenizer, qwen25_vl_text_encoder

    torch.manual_seed(seed)
    tok = qwen2_tokenizer(build / "tokenizer")
    text = qwen25_vl_text_encoder(tok, layers=3)
    tok2, glyph = byt5_glyph_encoder()
    vae = AutoencoderKLHunyuanImage(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(32, 32, 32, 32),
                                    layers_per_block=1, spatial_compression_ratio=8, sample_size=32,
                                    scaling_factor=0.75289)
    dit = HunyuanImageTransformer2DModel(**{
        **dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=1,
               num_single_layers=1, num_refiner_layers=1, text_embed_dim=32, text_embed_2_dim=16,
               rope_axes_dim=(8, 8)), **transformer})
    return dict(text_encoder=text, tokenizer=tok, transformer=dit, vae=vae,
                scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0), text_encoder_2=glyph, tokenizer_2=tok2,
                guider=AdaptiveProjectedMixGuidance(guidance_scale=3.5, adaptive_projected_guidance_start_step=2),
                ocr_guider=AdaptiveProjectedMixGuidance(guidance_scale=3.5, adaptive_projected_guidance_start_step=1,
                                                        adaptive_projected_guidance_momentum=-0.3))
