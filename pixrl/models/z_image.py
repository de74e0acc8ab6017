"""Z-Image (Turbo and base, Tongyi-MAI): a single-stream 6B DiT (diffusers ZImageTransformer2DModel)
reading the image's 2×2 patches and the prompt's tokens in one sequence, a Qwen3 text encoder
(the penultimate hidden states of the prompt under the tokenizer's chat template, thinking on,
only the prompt's real tokens: captions have their own lengths), the FLUX.1 VAE, and a
flow-matching Euler schedule with FLUX's resolution-dependent shift.

What is the family's own, as ZImagePipeline computes it:
- the transformer's time is t_z = 1 − σ (it reads (1000 − t)/1000) and its output is −v: the
  velocity is the negated output;
- CFG is `pos + w·(pos − neg)` over [pos; neg] in one call; pixrl's `sampling.guidance_scale`
  s is the usual one (v = neg + s·(pos − neg)), so the pipeline's `guidance_scale` w is s − 1
  (Z-Image-Turbo samples without CFG: s = 1, the pipeline's 0); the pipeline's optional CFG
  renormalisation and truncation are not applied (their defaults are off);
- σ grid: `linspace(1, 1/T, T)` shifted as the scheduler's config says (the Turbo checkpoint: a
  static shift of 3).
Latents stay [C, H/8, W/8] (the transformer patchifies them itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .pipelines import SIGMAS_OPTION, PipelineFamily, dynamic_shift_mu, encodes_text, packed_grid
from .registry import register_family
from .taxonomy import Action, PolicySemantics, PolicyStep, Regime

__all__ = ["ZImageConditioning", "ZImageFamily"]


@dataclass
class ZImageConditioning:
    """The prompts' Qwen3 states, zero-padded to the longest, and each prompt's token count."""

    prompt_embeds: torch.Tensor  # [B, L, D]
    lengths: torch.Tensor  # [B] int64: the real tokens of each row

    def select(self, idx) -> "ZImageConditioning":
        return ZImageConditioning(self.prompt_embeds[idx], self.lengths[idx])

    def expand(self, n: int) -> "ZImageConditioning":
        return ZImageConditioning(self.prompt_embeds.expand(n, -1, -1), self.lengths.expand(n))

    def captions(self) -> list[torch.Tensor]:
        """The transformer's input: each row's own tokens."""
        return [e[: int(n)] for e, n in zip(self.prompt_embeds, self.lengths)]


@register_family("z_image")
class ZImageFamily(PipelineFamily):
    name = "z_image"
    options = SIGMAS_OPTION
    pipeline_class = "ZImagePipeline"
    semantics = PolicySemantics(regime=Regime.full_sequence, step=PolicyStep.denoise, action=Action.continuous)
    guidance = "cfg"
    cfg_truncation_by = "time"  # sampling.cfg_truncation as ZImagePipeline's: no CFG once 1 − t/1000 exceeds it
    text_tokens = (1, 1024)  # the pipeline's 512 by default
    # the single-stream blocks' attention projections and SwiGLU (to_q/k/v, to_out.0; w1, w2, w3)
    lora_targets = ["attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0",
                    "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"]

    @staticmethod
    def default_resolution(pipe) -> int:
        return 1024  # the pipeline's default height and width

    # --- conditioning -------------------------------------------------------------------------
    @encodes_text
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> ZImageConditioning:
        """The pipeline's `_encode_prompt` (chat template with thinking on, hidden_states[-2], the
        prompt's real tokens), padded into one tensor with the lengths beside it."""
        rows = self.pipe._encode_prompt(list(prompts), device=self.device, max_sequence_length=self.max_sequence_length)
        lengths = torch.tensor([len(r) for r in rows], device=self.device)
        embeds = rows[0].new_zeros(len(rows), int(lengths.max()), rows[0].shape[-1])
        for i, r in enumerate(rows):
            embeds[i, : len(r)] = r
        return ZImageConditioning(embeds, lengths)

    # --- dynamics -----------------------------------------------------------------------------
    def latent_shape(self) -> tuple[int, int, int]:
        h, w = packed_grid(self.height, self.width, self.pipe.vae_scale_factor)
        return self.transformer.config.in_channels, h, w

    def schedule(self, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(σ [T+1] ending at 0, timesteps [T]) as ZImagePipeline sets them: its default sigmas and
        the dynamic-shift μ of the image's 2×2-patch sequence."""
        from copy import deepcopy

        from diffusers.pipelines.z_image.pipeline_z_image import get_default_z_image_sigmas

        sched = deepcopy(self.scheduler)
        sigmas = self.grid_sigmas(steps, get_default_z_image_sigmas(steps))
        sched.set_timesteps(sigmas=sigmas, device=self.device, mu=self._mu())
        return sched.sigmas.float().clone(), sched.timesteps.float().clone()

    def _mu(self) -> float:
        """μ of the image's 2×2-patch sequence (used when the scheduler shifts dynamically)."""
        _, h, w = self.latent_shape()
        return dynamic_shift_mu(self.scheduler, (h // 2) * (w // 2))

    def velocity(self, x: torch.Tensor, timestep: torch.Tensor, cond: ZImageConditioning,
                 guidance_scale: float = 1.0, neg: ZImageConditioning | None = None) -> torch.Tensor:
        """v_θ(x, t | c) on latents [B, C, H, W]: the negated transformer output at t_z = 1 − t/1000;
        guidance_scale s > 1: the pipeline's CFG with w = s − 1, [pos; neg] in one call."""
        b = x.shape[0]
        t = timestep.reshape(-1).to(x.device)
        t = (1000 - (t.expand(b) if t.numel() == 1 else t)) / 1000
        frames = list(x.to(self.transformer.dtype).unsqueeze(2).unbind(0))  # [C, 1, H, W] each
        captions = cond.captions()
        if guidance_scale > 1.0:
            if neg is None:
                raise ValueError("guidance_scale > 1 needs the negative-prompt conditioning")
            frames, captions, t = frames + frames, captions + neg.captions(), t.repeat(2)
        out = torch.stack([o.float() for o in self.transformer(frames, t, [c.to(self.transformer.dtype)
                                                                              for c in captions],
                                                               return_dict=False)[0]])
        if guidance_scale > 1.0:
            pos, neg_out = out[:b], out[b:]
            out = pos + (guidance_scale - 1.0) * (pos - neg_out)
        return -out.squeeze(2)

    # --- a tiny random checkpoint in the real layout --------------------------------------------
    @classmethod
    def write_tiny(cls, out_dir: Path, seed: int = 0) -> dict:
        """A random Z-Image-shaped pipeline: a tiny Qwen3 with a Qwen2 BPE tokenizer and a
        ChatML template that honours `enable_thinking`, a 2-block single-stream DiT with its
        refiners (3-axis RoPE), a 4-channel FLUX-style VAE (scale and shift), the Turbo scheduler
        (static shift 3). Returns the overrides that run it (32 px)."""
        import shutil

        from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel

        from .tiny_parts import image_vae

        torch.manual_seed(seed)
        build = out_dir.parent / (out_dir.name + "_build")
        tok, text = qwen3_text_tower(build / "tokenizer", hidden=32, ffn=64, layers=3, heads=2, kv_heads=1, head_dim=16)
        transformer = ZImageTransformer2DModel(in_channels=4, dim=32, n_layers=2, n_refiner_layers=1, n_heads=2,
                                               n_kv_heads=2, cap_feat_dim=32, axes_dims=[4, 6, 6],
                                               axes_lens=[256, 64, 64])
        vae = image_vae(latent_channels=4, scaling_factor=0.3611, shift_factor=0.1159)
        sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
        ZImagePipeline(scheduler=sched, vae=vae, text_encoder=text, tokenizer=tok,
                       transformer=transformer).save_pretrained(str(out_dir), safe_serialization=True)
        shutil.rmtree(build, ignore_errors=True)
        return {"model.family": cls.name, "model.path": str(out_dir), "model.resolution": 32,
                "model.max_sequence_length": 64}


def qwen3_text_tower(tokenizer_dir: Path, hidden: int, ffn: int, layers: int, heads: int, kv_heads: int,
                     head_dim: int):
    """(a tiny Qwen2 BPE tokenizer with Qwen3's chat template, a random Qwen3Model of these shapes)."""
    from transformers import Qwen3Config, Qwen3Model

    from .tiny_parts import qwen2_tokenizer

    tok = qwen2_tokenizer(tokenizer_dir)
    tok.chat_template = QWEN3_CHAT_TEMPLATE
    model = Qwen3Model(Qwen3Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=ffn,
                                   num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                   head_dim=head_dim, max_position_embeddings=4096, pad_token_id=tok.pad_token_id,
                                   eos_token_id=tok.eos_token_id))
    return tok, model


# Qwen3's ChatML turns; with the generation prompt, an empty thinking block when thinking is off
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}")
