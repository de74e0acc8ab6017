"""FLUX.2 [klein] family (4B / 9B, base and step-distilled): FLUX.2's transformer, VAE, latents
and empirical-μ schedule (the `flux2` family's), read by diffusers' Flux2KleinPipeline, with
what is its own:

- a Qwen3 text encoder: the hidden states of layers 9, 18 and 27 stacked per token, each prompt
  under the tokenizer's chat template with thinking off, padded to `max_sequence_length`;
- true classifier-free guidance: no guidance embedding; above scale 1 a second transformer pass
  on the empty prompt, v = v_neg + s·(v_pos − v_neg), as the pipeline combines them — except on
  a step-distilled checkpoint (`is_distilled` in its model_index.json), which the pipeline
  samples without guidance whatever the scale, and so does this family;
- edits: each prompt's source image is a reference read after the target's tokens (the
  `flux2` family's), and the unconditional pass keeps it, as the pipeline's does.

UniRL trains FLUX.2-klein-base-9B with the Dance SDE on three early steps (the presets).
"""

from __future__ import annotations

from pathlib import Path

import torch

from .flux2 import Flux2Conditioning, Flux2Family, tiny_flux2_parts
from .registry import register_family

__all__ = ["Flux2KleinFamily"]


@register_family("flux2_klein")
class Flux2KleinFamily(Flux2Family):
    name = "flux2_klein"
    pipeline_class = "Flux2KleinPipeline"
    guidance = "cfg"
    # UniRL's klein targets (the double blocks' every Linear, the single blocks' fused qkv+MLP), with
    # the single blocks' output projections by full name as the flux2 family adapts them
    _targets = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                "ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out", "to_qkv_mlp_proj"]

    @property
    def lora_targets(self) -> list[str]:
        n = self.transformer.config.num_single_layers
        return [*self._targets, *[f"single_transformer_blocks.{i}.attn.to_out" for i in range(n)]]

    @staticmethod
    def swap_components(path: Path) -> dict:
        return {}  # a Qwen2 tokenizer: nothing to swap

    @property
    def distilled(self) -> bool:
        """A step-distilled checkpoint: the pipeline ignores the guidance scale."""
        return bool(self.pipe.config.get("is_distilled", False))

    def describe(self) -> dict:
        return {**super().describe(), "guidance": "none (step-distilled)" if self.distilled else self.guidance}

    def velocity(self, x: torch.Tensor, timestep: torch.Tensor, cond: Flux2Conditioning,
                 guidance_scale: float = 1.0, neg: Flux2Conditioning | None = None) -> torch.Tensor:
        """v_θ(x, t | c) on patchified latents; with CFG above scale 1 (not on a distilled
        checkpoint) the empty prompt's pass, on the same latents and reference tokens."""
        pos = self._transformer(x, timestep, cond)
        if guidance_scale <= 1 or self.distilled:
            return pos
        if neg is None:
            raise ValueError("FLUX.2 [klein] guidance above 1 needs the empty prompt's conditioning (neg)")
        uncond = Flux2Conditioning(neg.prompt_embeds, neg.text_ids, cond.image_latents, cond.image_ids)
        v_neg = self._transformer(x, timestep, uncond)
        return v_neg + guidance_scale * (pos - v_neg)

    def _transformer(self, x: torch.Tensor, timestep: torch.Tensor, cond: Flux2Conditioning) -> torch.Tensor:
        return super().velocity(x, timestep, cond)  # no guidance embedding: the scale is not read

    # --- a tiny random checkpoint in the real layout --------------------------------------------
    @classmethod
    def write_tiny(cls, out_dir: Path, seed: int = 0, distilled: bool = False) -> dict:
        """A random FLUX.2-klein-shaped pipeline (Qwen3 causal LM of 27 layers, Qwen2 tokenizer with
        Qwen3's chat template, batch-normalised 2×2-patchified VAE latents, no guidance embedding)
        with tiny widths, saved with `save_pretrained`. Returns the overrides that run it (32 px)."""
        import shutil

        from diffusers import Flux2KleinPipeline
        from transformers import Qwen3Config, Qwen3ForCausalLM

        from .tiny_parts import qwen2_tokenizer
        from .z_image import QWEN3_CHAT_TEMPLATE

        torch.manual_seed(seed)
        build = out_dir.parent / (out_dir.name + "_build")
        tok = qwen2_tokenizer(build / "tokenizer")
        tok.chat_template = QWEN3_CHAT_TEMPLATE
        hidden = 16
        text_encoder = Qwen3ForCausalLM(Qwen3Config(
            vocab_size=len(tok), hidden_size=hidden, intermediate_size=32, num_hidden_layers=27, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, max_position_embeddings=1024, pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id))
        vae, transformer, sched = tiny_flux2_parts(text_hidden=hidden, guidance_embeds=False)
        Flux2KleinPipeline(scheduler=sched, vae=vae, text_encoder=text_encoder, tokenizer=tok, transformer=transformer,
                           is_distilled=distilled).save_pretrained(str(out_dir), safe_serialization=True)
        shutil.rmtree(build, ignore_errors=True)
        return {"model.family": cls.name, "model.path": str(out_dir), "model.resolution": 32,
                "model.max_sequence_length": 64}
