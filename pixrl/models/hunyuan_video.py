"""HunyuanVideo (1.0, text-to-video): diffusers HunyuanVideoTransformer3DModel (a 13B DiT of 20
dual-stream and 40 single-stream blocks over 1×2×2 patches of 16-channel latents, its text states
refined by a token refiner), AutoencoderKLHunyuanVideo (causal 3-D, ×4 in time, ×8 in space), two
text towers — a Llama-3 (llava-llama-3-8b) whose hidden states two layers from the top are read
under the pipeline's video-description template, the template's first 95 tokens cropped, and
CLIP-L's pooled output — and a flow-matching Euler schedule (`linspace(1, 0, T+1)[:-1]` under the
scheduler's shift, 7 as the checkpoint ships it; DanceGRPO samples with 5: `model.shift`).

Guidance is HunyuanVideo's distilled guidance, as HunyuanVideoPipeline computes it: the scale ×
1000 enters the transformer as an embedding (`guidance_embeds`); no negative prompt is encoded.
The pipeline's optional true CFG (`true_cfg_scale` with a negative prompt, for the distilled model
an extra) is not offered. This is the model DanceGRPO trains as its video showcase (480², 53
frames, 16 steps, η 0.25, shift 5, guidance 6.0).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .pipelines import PipelineFamily, encodes_text
from .registry import register_family
from .taxonomy import Action, PolicySemantics, PolicyStep, Regime
from .wan import video_to_uint8

__all__ = ["HunyuanVideoConditioning", "HunyuanVideoFamily"]


@dataclass
class HunyuanVideoConditioning:
    """Both towers' outputs as the pipeline's `encode_prompt` returns them."""

    prompt_embeds: torch.Tensor  # [B, L, 4096] Llama states, template cropped
    mask: torch.Tensor  # [B, L]
    pooled: torch.Tensor  # [B, 768] CLIP-L pooled

    def select(self, idx) -> "HunyuanVideoConditioning":
        return HunyuanVideoConditioning(self.prompt_embeds[idx], self.mask[idx], self.pooled[idx])

    def expand(self, n: int) -> "HunyuanVideoConditioning":
        return HunyuanVideoConditioning(*(v.expand(n, *v.shape[1:]) for v in (self.prompt_embeds, self.mask,
                                                                               self.pooled)))


@register_family("hunyuan_video")
class HunyuanVideoFamily(PipelineFamily):
    name = "hunyuan_video"
    pipeline_class = "HunyuanVideoPipeline"
    semantics = PolicySemantics(regime=Regime.full_sequence, step=PolicyStep.denoise, action=Action.continuous)
    guidance = "embedded"  # the scale is a transformer input; no negative prompt is encoded
    video = True
    text_tokens = (1, 256)  # Llama tokens after the template (the pipeline's 256)
    # the attention projections of both streams and the refiner (diffusers' HunyuanVideo LoRA targets)
    lora_targets = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                    "attn.add_v_proj", "attn.to_add_out"]
    default_frames = 129  # the pipeline's num_frames
    decode_batch = 1  # clips per VAE decode: 129 frames at 720p hold gigabytes of activations
    options = {"shift": "the flow-matching shift of the sampling grid, in place of the checkpoint's"}

    def __init__(self, pipe, *args, shift: float | None = None, **kwargs):
        super().__init__(pipe, *args, **kwargs)
        if shift is not None:
            self.set_shift(shift)
        self.set_clip_frames()

    @staticmethod
    def default_resolution(pipe) -> tuple[int, int]:
        return 720, 1280  # the pipeline's default clip

    @staticmethod
    def resolution_multiple(pipe) -> int:
        return pipe.vae_scale_factor_spatial * pipe.transformer.config.patch_size

    def describe(self) -> dict:
        return {"resolution": [self.height, self.width], "frames": self.frames,
                "shift": self.scheduler.config.get("shift"), "guidance": self.guidance}

    # --- conditioning -------------------------------------------------------------------------
    @encodes_text
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> HunyuanVideoConditioning:
        return self.encode_text(prompts)

    def encode_text(self, prompts: list[str]) -> HunyuanVideoConditioning:
        """The pipeline's `encode_prompt`: Llama states under the template (cropped), mask, CLIP pooled."""
        embeds, pooled, mask = self.pipe.encode_prompt(list(prompts), device=self.device,
                                                       max_sequence_length=self.max_sequence_length)
        return HunyuanVideoConditioning(embeds, mask, pooled)

    # --- dynamics -----------------------------------------------------------------------------
    def latent_shape(self) -> tuple[int, int, int, int]:
        h, w = self.latent_grid(self.pipe.vae_scale_factor_spatial)
        frames = (self.frames - 1) // self.pipe.vae_scale_factor_temporal + 1
        return self.transformer.config.out_channels, frames, h, w

    def schedule(self, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(σ [T+1] ending at 0, timesteps [T]) as the pipeline sets them: linspace(1, 0, T+1)[:-1],
        shifted by the scheduler."""
        return shifted_linspace_grid(self.scheduler, steps, self.device)

    def velocity(self, x: torch.Tensor, timestep: torch.Tensor, cond: HunyuanVideoConditioning,
                 guidance_scale: float = 1.0, neg: HunyuanVideoConditioning | None = None) -> torch.Tensor:
        """v_θ(x, t | c) on video latents [B, C, F, H, W]; the guidance scale (× 1000) as the embedding."""
        return self._predict(x, timestep, cond, guidance_scale)

    def _predict(self, hidden: torch.Tensor, timestep: torch.Tensor, cond: HunyuanVideoConditioning,
                 embedded: float) -> torch.Tensor:
        """The transformer on `hidden` (the latents, or more channels beside them) with the embedded
        guidance `embedded`, as the pipelines call it."""
        b, dtype = hidden.shape[0], self.transformer.dtype
        t = timestep.reshape(-1).to(hidden.device)
        t = t.expand(b) if t.numel() == 1 else t
        guidance = torch.full((b,), float(embedded), device=hidden.device, dtype=dtype) * 1000.0
        return self.transformer(hidden_states=hidden.to(dtype), timestep=t.to(hidden.dtype),
                                encoder_hidden_states=cond.prompt_embeds.to(dtype),
                                encoder_attention_mask=cond.mask.to(dtype), pooled_projections=cond.pooled.to(dtype),
                                guidance=guidance, return_dict=False)[0]

    # --- pixels -------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Final latents [B, C, F', H', W'] → uint8 clips [B, F, H, W, 3]."""
        return decode_clips(self.vae, latents)

    # --- a tiny random checkpoint in the real layout --------------------------------------------
    @classmethod
    def write_tiny(cls, out_dir: Path, seed: int = 0) -> dict:
        """A random HunyuanVideo-shaped pipeline (`tiny_parts`) saved in the diffusers layout.
        Returns the overrides that run it (32 px — 4 × 4 latents — and 5 frames)."""
        import shutil

        from diffusers import HunyuanVideoPipeline

        build = out_dir.parent / (out_dir.name + "_build")
        HunyuanVideoPipeline(**tiny_parts(build, seed)).save_pretrained(str(out_dir), safe_serialization=True)
        shutil.rmtree(build, ignore_errors=True)
        return {"model.family": cls.name, "model.path": str(out_dir), "model.resolution": 32, "model.frames": 5,
                "model.max_sequence_length": 64}


def decode_clips(vae, latents: torch.Tensor) -> np.ndarray:
    """Final latents [B, C, F', H', W'] → uint8 clips [B, F, H, W, 3] as the HunyuanVideo pipelines
    decode them: unscaled, one clip at a time (the causal VAE's attention mask is built for a batch
    of one, and a clip's activations are gigabytes)."""
    z = latents.to(vae.dtype) / vae.config.scaling_factor
    return np.concatenate([video_to_uint8(vae.decode(c[None], return_dict=False)[0]) for c in z])


def shifted_linspace_grid(scheduler, steps: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(σ [T+1] ending at 0, timesteps [T]) of the HunyuanVideo pipelines: `linspace(1, 0, T+1)[:-1]`
    given to the scheduler as sigmas, which shifts them."""
    from copy import deepcopy

    sched = deepcopy(scheduler)
    sched.set_timesteps(sigmas=np.linspace(1.0, 0.0, steps + 1)[:-1], device=device)
    return sched.sigmas.float().clone(), sched.timesteps.float().clone()


def tiny_parts(build: Path, seed: int, **transformer) -> dict:
    """Seeded tiny HunyuanVideo components: a 3-layer Llama with the template tokenizer, a tiny
    CLIP text tower, the causal video VAE (×4 in time, ×8 in space here as there, 4 latent
    channels), a DiT of one dual- and one single-stream block with its token refiner and guidance
    embedder (`transformer`: further config), and the Euler scheduler (shift 7)."""
    from diffusers import AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, HunyuanVideoTransformer3DModel
    from transformers import LlamaConfig, LlamaModel

    from .tiny_parts import clip_text_model, clip_tokenizer

    torch.manual_seed(seed)
    tok = template_tokenizer(build / "tokenizer")
    text = LlamaModel(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                                  pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                                  eos_token_id=tok.eos_token_id))
    tok2 = clip_tokenizer(build / "tokenizer_2")
    clip = clip_text_model(tok2)
    vae = AutoencoderKLHunyuanVideo(latent_channels=4, block_out_channels=(8, 8, 16, 16), layers_per_block=1,
                                    norm_num_groups=4, spatial_compression_ratio=8, temporal_compression_ratio=4)
    dit = HunyuanVideoTransformer3DModel(**{
        **dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=1,
               num_single_layers=1, num_refiner_layers=1, text_embed_dim=32, pooled_projection_dim=32,
               rope_axes_dim=(4, 6, 6)), **transformer})
    return dict(text_encoder=text, tokenizer=tok, transformer=dit, vae=vae,
                scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), text_encoder_2=clip, tokenizer_2=tok2)


CROP = 95  # the pipeline's DEFAULT_PROMPT_TEMPLATE["crop_start"]
_HEADERS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]  # Llama-3's chat tokens


def template_tokenizer(out_dir: Path):
    """A tiny Llama tokenizer (LlamaTokenizerFast: "▁" BPE with byte fallback, BOS prepended, right
    padding) with Llama-3's header tokens, under which the pipeline's template before the prompt is
    95 tokens as with llava-llama-3's own tokenizer — BOS, each word one token, "\\n\\n" one — so
    the pipeline's fixed crop drops exactly the template and keeps the prompt."""
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE
    from transformers import LlamaTokenizerFast

    from .tiny_parts import tiny_vocabulary

    template = DEFAULT_PROMPT_TEMPLATE["template"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for c in "▁\n" + "".join(sorted(set(re.sub(r"\s", "", template)) | set("".join(tiny_vocabulary())))):
        vocab.setdefault(c, len(vocab))
    merges: list[tuple[str, str]] = []

    def whole(piece: str) -> None:  # merges building `piece` left to right: one token
        cur = piece[0]
        for sym in piece[1:]:
            if (cur, sym) not in merges:
                merges.append((cur, sym))
            cur += sym
            vocab.setdefault(cur, len(vocab))

    whole("\n\n")
    for w in sorted(set(re.findall(r"[A-Za-z]+", template)) | set(tiny_vocabulary())):
        whole("▁" + w)  # every "▁" merge ranks before the bare ones below: a spaced word always ends whole
    for w in ("system", "Describe", "user"):
        whole(w)
    tok = LlamaTokenizerFast(vocab=vocab, merges=merges, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                             pad_token="</s>", add_bos_token=True, padding_side="right", model_max_length=1024)
    tok.add_special_tokens({"additional_special_tokens": _HEADERS})
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out_dir))
    tok = LlamaTokenizerFast.from_pretrained(str(out_dir))
    crop = len(tok(template[: template.index("{}")]).input_ids)
    if crop != CROP or tok.padding_side != "right":
        raise AssertionError(f"the tiny template is {crop} tokens before the prompt ({tok.padding_side} padding); "
                             f"the pipeline crops {CROP} from the right-padded sequence")
    return tok
