"""ImageReward's released checkpoint (ImageReward.pt: the state dict of its `ImageReward` module —
`blip.visual_encoder.*` a timm-style BLIP ViT, `blip.text_encoder.*` BLIP's med BERT with
cross-attention, `mlp.layers.*` the score head) mapped onto transformers' BLIP classes, so the
reward needs neither the image-reward package (which imports timm, fairscale and torchvision)
nor a download. The ViT's shape (width, depth, patch, image size) is read off the tensors; the
text encoder's from the release's med_config.json."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import nn

VISION, TEXT, HEAD = "blip.visual_encoder.", "blip.text_encoder.", "mlp."

#: the release's timm-style vision names (prefixes; {n} a block's index) ↔ transformers' BlipVisionModel's
_VISION_NAMES = [
    ("cls_token", "embeddings.class_embedding"),
    ("pos_embed", "embeddings.position_embedding"),
    ("patch_embed.proj.", "embeddings.patch_embedding."),
    ("blocks.{n}.norm1.", "encoder.layers.{n}.layer_norm1."),
    ("blocks.{n}.norm2.", "encoder.layers.{n}.layer_norm2."),
    ("blocks.{n}.attn.qkv.", "encoder.layers.{n}.self_attn.qkv."),
    ("blocks.{n}.attn.proj.", "encoder.layers.{n}.self_attn.projection."),
    ("blocks.{n}.mlp.", "encoder.layers.{n}.mlp."),
    ("norm.", "post_layernorm."),
]


def vision_name(key: str, to_release: bool = False) -> str | None:
    """A vision tensor's transformers name from its release name (or, `to_release`, the other way:
    the tiny writer's); None for a name the table does not know."""
    for release, ours in _VISION_NAMES:
        src, dst = (ours, release) if to_release else (release, ours)
        new, n = re.subn("^" + re.escape(src).replace(r"\{n\}", r"(\d+)"), dst.replace("{n}", r"\1"), key)
        if n:
            return new
    return None


def read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """The release's state dict (a plain dict of tensors; `{"state_dict": …}` or `{"model": …}`
    wrappers are unwrapped). weights_only: a checkpoint cannot run code while it loads."""
    sd = torch.load(path, map_location="cpu", weights_only=True)
    for key in ("state_dict", "model"):
        if isinstance(sd, dict) and key in sd and isinstance(sd[key], dict):
            sd = sd[key]
    if not any(k.startswith(VISION) for k in sd) or not any(k.startswith(HEAD) for k in sd):
        raise ValueError(f"{path} is not an ImageReward checkpoint: no {VISION}* or {HEAD}* tensors "
                         f"(found e.g. {sorted(sd)[:3]})")
    return sd


def _part(sd: dict, prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}


def vision_state(sd: dict) -> dict[str, torch.Tensor]:
    """`blip.visual_encoder.*` under BlipVisionModel's names."""
    out = {}
    for key, value in _part(sd, VISION).items():
        new = vision_name(key)
        if new is None:
            raise ValueError(f"ImageReward checkpoint: unexpected vision tensor {VISION}{key}")
        out[new] = value
    return out


def text_state(sd: dict) -> dict[str, torch.Tensor]:
    """`blip.text_encoder.*`: BLIP's med BERT and transformers' BlipTextModel share their names;
    the position-id buffer is derived, not a weight."""
    return {k: v for k, v in _part(sd, TEXT).items() if k != "embeddings.position_ids"}


def vision_config(sd: dict, heads: int, layer_norm_eps: float = 1e-6):
    """BlipVisionConfig from the tensors: BLIP's ViT (timm) uses LayerNorm eps 1e-6 and exact GELU."""
    from transformers import BlipVisionConfig

    v = _part(sd, VISION)
    width = v["cls_token"].shape[-1]
    patch = v["patch_embed.proj.weight"].shape[-1]
    grid = round((v["pos_embed"].shape[1] - 1) ** 0.5)
    depth = 1 + max(int(k.split(".")[1]) for k in v if k.startswith("blocks."))
    heads = heads or width // 64  # BLIP's base (768/12) and large (1024/16) both use 64-wide heads
    if not heads or width % heads:
        raise ValueError(f"ImageReward checkpoint: vision width {width} is not divisible by {heads} heads; "
                         f"set reward.options.imagereward.vision_heads")
    return BlipVisionConfig(hidden_size=width, intermediate_size=v["blocks.0.mlp.fc1.weight"].shape[0],
                            num_hidden_layers=depth, num_attention_heads=heads, image_size=grid * patch,
                            patch_size=patch, layer_norm_eps=layer_norm_eps, hidden_act="gelu")


def text_config(med_config: str, encoder_width: int):
    """BlipTextConfig from the release's med_config.json (BLIP sets encoder_width to the ViT's
    width whatever the file says). is_decoder=True is how transformers builds the cross-attention
    layers; the reward calls the encoder bidirectionally, as ImageReward does."""
    from transformers import BlipTextConfig

    med = json.loads(Path(med_config).read_text())
    return BlipTextConfig(vocab_size=med["vocab_size"], hidden_size=med["hidden_size"],
                          encoder_hidden_size=encoder_width, intermediate_size=med["intermediate_size"],
                          num_hidden_layers=med["num_hidden_layers"], num_attention_heads=med["num_attention_heads"],
                          max_position_embeddings=med["max_position_embeddings"],
                          layer_norm_eps=med.get("layer_norm_eps", 1e-12), hidden_act=med.get("hidden_act", "gelu"),
                          pad_token_id=med.get("pad_token_id", 0), is_decoder=True)


def score_head(sd: dict) -> nn.Sequential:
    """ImageReward's MLP: Linear(768,1024), Dropout, Linear(1024,128), Dropout, Linear(128,64),
    Dropout, Linear(64,16), Linear(16,1) — no activations (they are commented out upstream); the
    dropouts keep the indices of the released keys (mlp.layers.0/2/4/6/7)."""
    h = _part(sd, HEAD + "layers.")
    sizes = [h[f"{i}.weight"].shape for i in (0, 2, 4, 6, 7)]
    lin = [nn.Linear(s[1], s[0]) for s in sizes]
    head = nn.Sequential(lin[0], nn.Dropout(0.2), lin[1], nn.Dropout(0.2), lin[2], nn.Dropout(0.1), lin[3], lin[4])
    head.load_state_dict(h, strict=True)
    return head
