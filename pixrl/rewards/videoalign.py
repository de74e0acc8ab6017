"""VideoAlign's VideoReward (Liu et al., "Improving Video Generation with Human Feedback", 2025;
KwaiVGI/VideoAlign): a Qwen2-VL-2B-Instruct tuned with LoRA on 182k human video preferences, read
out by a linear head at three special tokens — visual quality (VQ), motion quality (MQ) and text
alignment (TA). DanceGRPO trains HunyuanVideo on its VQ and MQ; UniRL and visual-rl build it in.

Scored as the released inferencer scores a video file, on the clip's frames directly:
- frames read uniformly at `data_config.fps` (2) a second of the clip's rate (a sample's `fps`
  metadata, as `pixrl score` gives an MP4's, else the `clip_fps` option), each resized
  within [128·28², `max_frame_pixels`] pixels on the 28 grid (models/qwen_vl_video.py);
- one user turn — the video, then the checkpoint's prompt template (`detailed_special`: three
  rubrics, each closed by its reward token) — under the base checkout's chat template, padded right;
- the language model over the embedded tokens, the video placeholders replaced by the vision
  tower's merged patches, at plain sequential positions (its forward calls the language model
  without Qwen2-VL's rope index);
- the head on each reward token's final hidden state, z-normalised by the checkpoint's
  `inference_config` (`normalize`, on by default as in DanceGRPO; without one the raw outputs).
The score is the sum of `dimensions` (all three: the release's "Overall"); each is also reported.

Unlike DanceGRPO, which writes each clip to an MP4 and reads it back, the frames are not
re-encoded. `path`: the VideoAlign folder (model_config.json, checkpoint-<step>/); `base`: a local
Qwen/Qwen2-VL-2B-Instruct with its weights (the LoRA sits on them). Nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .base import Reward, ScoringError, register_reward
from .videoalign_prompts import DIMENSIONS, SPECIAL_TOKENS, build_prompt


def _dimensions(dims) -> tuple[str, ...]:
    picked = tuple(str(d).upper() for d in ([dims] if isinstance(dims, str) else dims))
    if not picked or any(d not in DIMENSIONS for d in picked) or len(set(picked)) != len(picked):
        raise ValueError(f"reward videoalign: dimensions {list(dims)!r} must be distinct ones of {list(DIMENSIONS)}")
    return picked


@register_reward("videoalign")
class VideoAlign(Reward):
    value_range = (-np.inf, np.inf)
    components = tuple(d.lower() for d in DIMENSIONS)  # vq, mq, ta: each head, normalised
    takes = "clip"

    def __init__(self, path: str = "", base: str = "", dimensions=DIMENSIONS, normalize: bool = True,
                 clip_fps: float = 16.0, fps: float | None = None, num_frames: int | None = None,
                 min_pixels: int | None = None, max_pixels: int | None = None, step: int = -1,
                 batch_size: int = 2, dtype: str = "bfloat16"):
        if not path or not (Path(path) / "model_config.json").is_file():
            raise ValueError(f"reward videoalign: {path!r} is not a VideoAlign checkpoint folder (model_config.json "
                             f"and checkpoint-<step>/); set reward.options.videoalign.path to KlingTeam/VideoReward")
        b = Path(base) if base else None
        if b is None or not all((b / f).is_file() for f in ("config.json", "preprocessor_config.json")) or \
                not any(b.glob("model*.safetensors*")):
            raise ValueError(f"reward videoalign: {base!r} is not a Qwen2-VL checkout with weights (config.json, "
                             f"preprocessor_config.json, model*.safetensors, tokenizer); set "
                             f"reward.options.videoalign.base to a local copy of Qwen/Qwen2-VL-2B-Instruct")
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"reward videoalign: dtype {dtype!r} is not one of float32, bfloat16, float16")
        if clip_fps <= 0:
            raise ValueError(f"reward videoalign: clip_fps must be positive (got {clip_fps})")
        from .videoalign_weights import checkpoint_folder, read_config

        self.config = read_config(Path(path))  # its sections, and the checkpoint step, before any work
        checkpoint_folder(Path(path), int(step))
        self.path, self.base, self.dims, self.normalize = Path(path), str(b), _dimensions(dimensions), normalize
        self.clip_fps, self.fps, self.num_frames, self.step = float(clip_fps), fps, num_frames, int(step)
        self.min_pixels, self.max_pixels, self.batch_size, self.dtype = min_pixels, max_pixels, batch_size, dtype
        self.model = None

    def setup(self, device: str = "cpu") -> None:
        from transformers import AutoTokenizer, Qwen2VLImageProcessorPil  # the PIL one: no torchvision

        from ..models.qwen_vl_video import VIDEO_MIN_PIXELS
        from .videoalign_weights import load_videoalign

        super().setup(device)
        cfg = self.config
        data, mc = cfg["data_config"], cfg["model_config"]
        self.special = bool(mc.get("use_special_tokens", False))
        self.pooling = "special" if self.special else mc.get("reward_token", "last")
        self.out_dim = int(mc.get("output_dim", 1))
        if (self.special and self.out_dim not in (1, 3)) or (not self.special and self.out_dim < 3):
            raise ScoringError(f"reward videoalign: a head of {self.out_dim} outputs with {self.pooling!r} pooling "
                               f"gives no VQ/MQ/TA triple")
        self.template, self.eval_dim = data.get("prompt_template_type", "none"), data.get("eval_dim", "VQ")
        if self.num_frames is None and self.fps is None:
            self.num_frames, self.fps = data.get("num_frames"), data.get("fps", 2.0)
        if self.num_frames is not None:
            self.fps = None
        self.min_pixels = self.min_pixels or VIDEO_MIN_PIXELS
        self.max_pixels = self.max_pixels or int(data.get("max_frame_pixels", 240 * 320))
        self.norm = cfg.get("inference_config") if self.normalize else None
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.base, padding_side="right")
            if self.special:
                self.tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
            self.images = Qwen2VLImageProcessorPil.from_pretrained(self.base)
            self.model, self.folder = load_videoalign(self.path, cfg, self.base, self.step, len(self.tokenizer),
                                                      self.special, getattr(torch, self.dtype))
        except ScoringError:
            raise
        except Exception as exc:  # transformers, peft and shape mismatches raise many types
            raise ScoringError(f"reward videoalign: could not load {str(self.path)!r} on the Qwen2-VL checkout "
                               f"{self.base!r}: {type(exc).__name__}: {exc}") from exc
        self.model.to(device).eval().requires_grad_(False)
        self.special_ids = self.tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))
        self.video_token = self.tokenizer.convert_ids_to_tokens(self.model.config.video_token_id)

    def check_prompts(self, prompts: list[str], metadata: list[dict]) -> None:
        bad = next((p for p in prompts if any(t in p for t in SPECIAL_TOKENS)), None)
        if bad is not None:
            raise ValueError(f"reward videoalign: the prompt {bad!r} holds one of its reward tokens {SPECIAL_TOKENS}")

    def video(self, clip: np.ndarray, clip_fps: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(patches, grid) of one uint8 clip [F, H, W, 3] as the inferencer reads its video; the clip
        plays at `clip_fps` (a file's own rate), else the `clip_fps` option."""
        from ..models.qwen_vl_video import frame_indices, resized_frames, smart_nframes, video_patches

        n = smart_nframes(len(clip), clip_fps or self.clip_fps, fps=self.fps, nframes=self.num_frames)
        frames = resized_frames(clip[frame_indices(len(clip), n)], self.min_pixels, self.max_pixels)
        ip = self.images
        return video_patches(frames, ip.image_mean, ip.image_std, ip.patch_size, ip.merge_size, ip.temporal_patch_size)

    def inputs(self, clips: np.ndarray, prompts: list[str], rates=None) -> dict[str, torch.Tensor]:
        videos = [self.video(c, r) for c, r in zip(clips, rates or [None] * len(clips))]
        merge = self.images.merge_size ** 2
        texts = []
        for (_, grid), prompt in zip(videos, prompts):
            turn = [{"role": "user", "content": [{"type": "video"},
                                                 {"type": "text", "text": build_prompt(prompt, self.eval_dim,
                                                                                       self.template)}]}]
            text = self.tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)
            texts.append(text.replace(self.video_token, self.video_token * (int(grid.prod()) // merge), 1))
        enc = self.tokenizer(texts, return_tensors="pt", padding=True)
        dev = self.model.device
        return {"input_ids": enc["input_ids"].to(dev), "attention_mask": enc["attention_mask"].to(dev),
                "pixel_values_videos": torch.cat([p for p, _ in videos]).to(dev, self.model.dtype),
                "video_grid_thw": torch.stack([g for _, g in videos]).to(dev)}

    @torch.no_grad()
    def heads(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """[B, 3] raw (VQ, MQ, TA): the head at the reward tokens (or pooled, for other checkpoints)."""
        vl, ids = self.model.model, inputs["input_ids"]
        embeds = vl.get_input_embeddings()(ids)
        feats = vl.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"]).pooler_output
        slots = (ids == self.model.config.video_token_id).unsqueeze(-1).expand_as(embeds)
        embeds = embeds.masked_scatter(slots, torch.cat(list(feats)).to(embeds.dtype))
        hidden = vl.language_model(inputs_embeds=embeds, attention_mask=inputs["attention_mask"]).last_hidden_state
        logits = self.model.rm_head(hidden)
        b = ids.shape[0]
        if self.pooling == "special":
            at = torch.isin(ids, torch.tensor(self.special_ids, device=ids.device))
            if not bool((at.sum(-1) == 3).all()):
                raise ScoringError(f"reward videoalign: each row must hold the three reward tokens once (found "
                                   f"{at.sum(-1).tolist()}); the prompt text must not contain {SPECIAL_TOKENS}")
            picked = logits[at].view(b, 3, -1)
            return (picked.diagonal(dim1=1, dim2=2) if self.out_dim == 3 else picked.reshape(b, -1)).float()
        last = (torch.eq(ids, self.tokenizer.pad_token_id).int().argmax(-1) - 1) % ids.shape[-1]
        if self.pooling == "last":
            return logits[torch.arange(b), last][:, :3].float()
        return torch.stack([logits[i, :max(int(last[i]), 0)].mean(0) for i in range(b)])[:, :3].float()

    def score(self, images, prompts, metadata):
        if images.ndim != 5:
            raise ScoringError(f"reward videoalign scores clips [B, F, H, W, 3]; got {images.shape} — use it with a "
                               f"video family")
        rates = [(m or {}).get("fps") for m in metadata] if metadata else [None] * len(images)
        b = self.batch_size
        raw = torch.cat([self.heads(self.inputs(images[s:s + b], list(prompts[s:s + b]), rates[s:s + b]))
                         for s in range(0, len(images), b)]).cpu().numpy().astype(np.float64)
        out = {}
        for k, d in enumerate(DIMENSIONS):
            v = raw[:, k]
            if self.norm is not None:
                v = (v - float(self.norm[f"{d}_mean"])) / float(self.norm[f"{d}_std"])
            out[f"{self.name}.{d.lower()}"] = v.astype(np.float32)
        out[self.name] = sum(out[f"{self.name}.{d.lower()}"].astype(np.float64) for d in self.dims).astype(np.float32)
        return out
