"""An open_clip CLIP state dict (the layout of HPSv2's released checkpoints) mapped onto
transformers' CLIPModel, which has the same architecture: a pre-LN ViT with a class token, GELU
MLPs and a causal text tower pooled at the end-of-text token. open_clip itself needs
torchvision, which cannot be installed beside the CPU torch this project pins, so its weights are
read with torch and renamed. The dimensions come from the tensors' shapes; the head counts are
not in the tensors and are given (ViT-H-14: 16 and 16)."""

from __future__ import annotations

import re

import torch

_BLOCK = {"ln_1": "layer_norm1", "ln_2": "layer_norm2", "attn.out_proj": "self_attn.out_proj",
          "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}


def _layers(sd: dict, prefix: str) -> int:
    found = {int(m.group(1)) for k in sd if (m := re.match(rf"{re.escape(prefix)}resblocks\.(\d+)\.", k))}
    return max(found) + 1 if found else 0


def clip_config(sd: dict, vision_heads: int, text_heads: int, tokenizer=None):
    """A CLIPConfig for the open_clip state dict `sd` (shapes read from it)."""
    from transformers import CLIPConfig

    conv = sd["visual.conv1.weight"]
    v_width, patch = conv.shape[0], conv.shape[-1]
    grid = int(round((sd["visual.positional_embedding"].shape[0] - 1) ** 0.5))
    vocab, t_width = sd["token_embedding.weight"].shape
    ids = {} if tokenizer is None else {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                                        "pad_token_id": tokenizer.pad_token_id}
    return CLIPConfig(
        text_config=dict(vocab_size=vocab, hidden_size=t_width, num_attention_heads=text_heads,
                         intermediate_size=sd["transformer.resblocks.0.mlp.c_fc.weight"].shape[0],
                         num_hidden_layers=_layers(sd, "transformer."),
                         max_position_embeddings=sd["positional_embedding"].shape[0], hidden_act="gelu",
                         layer_norm_eps=1e-5, **ids),
        vision_config=dict(hidden_size=v_width, num_attention_heads=vision_heads, patch_size=patch,
                           image_size=grid * patch, num_hidden_layers=_layers(sd, "visual.transformer."),
                           intermediate_size=sd["visual.transformer.resblocks.0.mlp.c_fc.weight"].shape[0],
                           hidden_act="gelu", layer_norm_eps=1e-5),
        projection_dim=sd["visual.proj"].shape[1])


def _blocks(sd: dict, src: str, dst: str, n: int, out: dict) -> None:
    for i in range(n):
        s, d = f"{src}resblocks.{i}.", f"{dst}encoder.layers.{i}."
        for a, b in _BLOCK.items():
            for p in ("weight", "bias"):
                out[f"{d}{b}.{p}"] = sd[f"{s}{a}.{p}"]
        for p in ("weight", "bias"):  # one packed q|k|v projection → three
            q, k, v = sd[f"{s}attn.in_proj_{p}"].chunk(3, dim=0)
            out[f"{d}self_attn.q_proj.{p}"], out[f"{d}self_attn.k_proj.{p}"], out[f"{d}self_attn.v_proj.{p}"] = q, k, v


def to_transformers(sd: dict) -> dict:
    """The CLIPModel state dict holding `sd`'s weights."""
    out = {
        "vision_model.embeddings.patch_embedding.weight": sd["visual.conv1.weight"],
        "vision_model.embeddings.class_embedding": sd["visual.class_embedding"],
        "vision_model.embeddings.position_embedding.weight": sd["visual.positional_embedding"],
        "vision_model.pre_layrnorm.weight": sd["visual.ln_pre.weight"],
        "vision_model.pre_layrnorm.bias": sd["visual.ln_pre.bias"],
        "vision_model.post_layernorm.weight": sd["visual.ln_post.weight"],
        "vision_model.post_layernorm.bias": sd["visual.ln_post.bias"],
        "visual_projection.weight": sd["visual.proj"].t().contiguous(),
        "text_model.embeddings.token_embedding.weight": sd["token_embedding.weight"],
        "text_model.embeddings.position_embedding.weight": sd["positional_embedding"],
        "text_model.final_layer_norm.weight": sd["ln_final.weight"],
        "text_model.final_layer_norm.bias": sd["ln_final.bias"],
        "text_projection.weight": sd["text_projection"].t().contiguous(),
        "logit_scale": sd["logit_scale"].reshape(()),
    }
    _blocks(sd, "visual.transformer.", "vision_model.", _layers(sd, "visual.transformer."), out)
    _blocks(sd, "transformer.", "text_model.", _layers(sd, "transformer."), out)
    return out


def read_open_clip(path: str) -> dict:
    """The state dict of a released open_clip checkpoint (a bare state dict, or {"state_dict": …}
    as HPSv2 saves it; a DDP "module." prefix is dropped). Tensors only: nothing is unpickled
    beyond them."""
    obj = torch.load(path, map_location="cpu", weights_only=True)
    sd = obj.get("state_dict", obj) if isinstance(obj, dict) else None
    if not isinstance(sd, dict):
        raise ValueError(f"{path} holds no state dict")
    sd = {k.removeprefix("module."): v for k, v in sd.items()}
    need = ("visual.conv1.weight", "visual.proj", "token_embedding.weight", "text_projection", "logit_scale")
    missing = [k for k in need if k not in sd]
    if missing:
        raise ValueError(f"{path} is not an open_clip CLIP checkpoint: no {', '.join(missing)}")
    return sd
