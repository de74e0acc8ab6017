"""A tiny CLIP in the transformers layout, for tests and for trying the CLIP-based rewards
(`clip_score`, `pickscore`, and `srpo`'s reward gradient) without weights: a random `CLIPModel`
at small widths saved with its `CLIPProcessor` — a real CLIP BPE tokenizer over the tiny
vocabulary and the image processor at the tower's side (shortest edge, centre crop)."""

from __future__ import annotations

from pathlib import Path


def write_tiny_clip(out_dir: Path, seed: int = 0, image_size: int = 32) -> Path:
    """A random CLIPModel + CLIPProcessor saved to `out_dir` (returned)."""
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from ..models.tiny_parts import clip_tokenizer

    import tempfile

    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory() as d:  # (the processor saves it beside the model)
        tok = clip_tokenizer(Path(d))
    torch.manual_seed(seed)
    cfg = CLIPConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=77, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=image_size, patch_size=8),
        projection_dim=24)
    CLIPModel(cfg).save_pretrained(str(out_dir))
    image_processor = CLIPImageProcessor(size={"shortest_edge": image_size},
                                         crop_size={"height": image_size, "width": image_size})
    CLIPProcessor(image_processor=image_processor, tokenizer=tok).save_pretrained(str(out_dir))
    return out_dir
