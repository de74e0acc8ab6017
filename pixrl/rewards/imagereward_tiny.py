"""A tiny ImageReward in the released layout, for tests and for trying `imagereward` (and ReFL,
whose reward it is) without weights: a random BLIP ViT, a med BERT with cross-attention and the
score head at small widths, saved as ImageReward.pt (the upstream module's state dict names:
`blip.visual_encoder.*` timm-style, `blip.text_encoder.*`, `mlp.layers.*`) beside its
med_config.json, with a bert-base-uncased-style WordPiece tokenizer over the tiny vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

def write_tiny_imagereward(out_dir: Path, seed: int = 0, width: int = 32, text_width: int = 24,
                           image_size: int = 32, max_length: int = 35) -> tuple[Path, Path]:
    """(ImageReward.pt with med_config.json beside it, the tokenizer directory) under `out_dir`."""
    import torch
    from transformers import BertTokenizer, BlipTextConfig, BlipVisionConfig, BlipVisionModel
    from transformers.models.blip.modeling_blip_text import BlipTextModel

    from ..models.tiny_parts import tiny_vocabulary
    from .imagereward_convert import HEAD, TEXT, VISION, vision_name

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])}
    for w in tiny_vocabulary():
        vocab.setdefault(w.lower(), len(vocab))
    tok_dir = out_dir / "bert-base-uncased"
    BertTokenizer(vocab=vocab).save_pretrained(str(tok_dir))
    n_vocab = len(vocab) + 2  # BLIP adds [DEC] and [ENC]
    med = {"architectures": ["BertModel"], "attention_probs_dropout_prob": 0.1, "hidden_act": "gelu",
           "hidden_dropout_prob": 0.1, "hidden_size": text_width, "initializer_range": 0.02,
           "intermediate_size": 2 * text_width, "layer_norm_eps": 1e-12, "max_position_embeddings": max_length + 5,
           "model_type": "bert", "num_attention_heads": 2, "num_hidden_layers": 2, "pad_token_id": 0,
           "type_vocab_size": 2, "vocab_size": n_vocab, "encoder_width": width, "add_cross_attention": True}
    (out_dir / "med_config.json").write_text(json.dumps(med, indent=1))
    torch.manual_seed(seed)
    vision = BlipVisionModel(BlipVisionConfig(hidden_size=width, intermediate_size=4 * width, num_hidden_layers=2,
                                              num_attention_heads=2, image_size=image_size, patch_size=8,
                                              layer_norm_eps=1e-6, hidden_act="gelu"))
    text = BlipTextModel(BlipTextConfig(vocab_size=n_vocab, hidden_size=text_width, encoder_hidden_size=width,
                                        intermediate_size=2 * text_width, num_hidden_layers=2, num_attention_heads=2,
                                        max_position_embeddings=max_length + 5, is_decoder=True),
                         add_pooling_layer=False)
    head = [torch.nn.Linear(a, b) for a, b in ((text_width, 64), (64, 16), (16, 8), (8, 4), (4, 1))]
    with torch.no_grad():  # a head that tells images apart at these widths
        for lin in head:
            lin.weight.normal_(0, 0.5)
    state = {VISION + vision_name(k, to_release=True): v for k, v in vision.state_dict().items()}
    state.update({TEXT + k: v for k, v in text.state_dict().items() if k != "embeddings.position_ids"})
    for index, lin in zip((0, 2, 4, 6, 7), head):  # the release's indices (dropouts between)
        state.update({f"{HEAD}layers.{index}.{k}": v for k, v in lin.state_dict().items()})
    path = out_dir / "ImageReward.pt"
    torch.save({k: v.contiguous() for k, v in state.items()}, str(path))
    return path, tok_dir
