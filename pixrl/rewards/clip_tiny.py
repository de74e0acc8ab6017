"""A tiny CLIP in the transformers layout, for tests and for trying the CLIP-based rewards
(`clip_score`, `pickscore`, and `srpo`'s reward gradient) without weights: a random `CLIPModel`
at small widths saved with its `CLIPProcessor` — a real CLIP BPE tokenizer over the tiny
vocabulary and the image processor at the tower's side (shortest edge, centre crop)."""

from __future__ import annotations

from pathlib import Path


#: CLIP ViT-H/14's shapes (laion/CLIP-ViT-H-14-laion2B-s32B-b79K: what HPSv2 and PickScore tune)
CLIP_H = dict(image_size=224, patch_size=14, vision=(1280, 5120, 32, 16), text=(1024, 4096, 24, 16), projection=1024)


def write_tiny_clip(out_dir: Path, seed: int = 0, image_size: int = 32) -> Path:
    """A random CLIPModel + CLIPProcessor saved to `out_dir` (returned)."""
    return write_random_clip(out_dir, seed, image_size=image_size, patch_size=8, vision=(32, 64, 2, 2),
                             text=(32, 64, 2, 2), projection=24)


def write_random_clip(out_dir: Path, seed: int, image_size: int, patch_size: int, vision: tuple, text: tuple,
                      projection: int) -> Path:
    """A random CLIPModel of these shapes — `vision` and `text` as (width, MLP width, layers,
    heads) — with its processor at `image_size` (CLIP_H: the real ViT-H/14's)."""
    import tempfile

    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from ..models.tiny_parts import clip_tokenizer

    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory() as d:  # (the processor saves it beside the model)
        tok = clip_tokenizer(Path(d))
    torch.manual_seed(seed)
    (vw, vm, vl, vh), (tw, tm, tl, th) = vision, text
    cfg = CLIPConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=tw, intermediate_size=tm, num_hidden_layers=tl,
                         num_attention_heads=th, max_position_embeddings=77, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id),
        vision_config=dict(hidden_size=vw, intermediate_size=vm, num_hidden_layers=vl, num_attention_heads=vh,
                           image_size=image_size, patch_size=patch_size),
        projection_dim=projection)
    CLIPModel(cfg).save_pretrained(str(out_dir))
    image_processor = CLIPImageProcessor(size={"shortest_edge": image_size},
                                         crop_size={"height": image_size, "width": image_size})
    CLIPProcessor(image_processor=image_processor, tokenizer=tok).save_pretrained(str(out_dir))
    return out_dir
