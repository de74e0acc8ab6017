"""The parts of a tiny GLM-Image checkpoint that no other family shares: the autoregressive
model's processor (a GLM-4-style byte-level BPE tokenizer whose first ids are the visual tokens,
as GLM-Image's expanded vocabulary has them, with the grid and image tokens GlmImageProcessor
reads) and the random GlmImageForConditionalGeneration itself.

Id layout, as the real checkpoint's: ids [0, C) are the VQ codebook's image tokens, C opens an
image (`bos_token`, the model's `image_start_token_id`) and C + 1 closes one (its EOS); the
language model's head predicts only these C + 2 "vision vocabulary" ids; text tokens follow.
"""

from __future__ import annotations

from pathlib import Path

from .tiny_parts import tiny_vocabulary, whole_word_merges

IMAGE_START, IMAGE_END = "<|image_start|>", "<|image_end|>"
NAMED_TOKENS = {"image_token": "<|image|>", "grid_bos_token": "<sop>", "grid_eos_token": "<eop>"}
ROLE_TOKENS = ["[gMASK]", "<|system|>", "<|user|>", "<|assistant|>", "<|begin_of_image|>", "<|end_of_image|>"]
PAD = "<|endoftext|>"

# GLM-4's turns ("[gMASK]<sop>", then `<|role|>` and the content); an image part is the processor's
# placeholder between image marks; the generation prompt opens the assistant's turn
GLM_IMAGE_CHAT_TEMPLATE = (
    "[gMASK]<sop>{%- for message in messages -%}{{ '<|' + message['role'] + '|>\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}{%- else -%}"
    "{%- for part in message['content'] -%}{%- if part['type'] == 'image' -%}"
    "{{ '<|begin_of_image|><|image|><|end_of_image|>' }}{%- elif part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\n' }}{%- endif -%}")


def glm_image_tokenizer(out_dir: Path, codebook: int):
    """The autoregressive model's tokenizer: `codebook` image-token ids, the image start/end ids,
    GLM's role and grid tokens, then byte-level BPE text (each tiny-vocabulary word one token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<|vq_{i}|>": i for i in range(codebook)}
    for t in [IMAGE_START, IMAGE_END, *NAMED_TOKENS.values(), *ROLE_TOKENS, PAD]:
        vocab[t] = len(vocab)
    for c in sorted(ByteLevel.alphabet()):
        vocab.setdefault(c, len(vocab))
    merges = whole_word_merges(vocab, [p for w in tiny_vocabulary() for p in (w, "Ġ" + w)])  # "Ġ": a space
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=IMAGE_START, eos_token=IMAGE_END, pad_token=PAD,
                                   extra_special_tokens=NAMED_TOKENS, padding_side="left", model_max_length=8192)
    fast.add_tokens(ROLE_TOKENS, special_tokens=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return PreTrainedTokenizerFast.from_pretrained(str(out_dir))


def glm_image_processor(out_dir: Path, codebook: int):
    """GlmImageProcessor (its image processor at 16 px patches, the tokenizer, GLM's chat template)."""
    from transformers import GlmImageProcessor
    from transformers.models.glm_image.image_processing_pil_glm_image import GlmImageImageProcessorPil

    tok = glm_image_tokenizer(out_dir.parent / (out_dir.name + "_tokenizer"), codebook)
    proc = GlmImageProcessor(image_processor=GlmImageImageProcessorPil(patch_size=16, merge_size=1, temporal_patch_size=1),
                             tokenizer=tok, chat_template=GLM_IMAGE_CHAT_TEMPLATE)
    proc.save_pretrained(str(out_dir))
    return GlmImageProcessor.from_pretrained(str(out_dir))


def glm_image_ar(tok, codebook: int, text: dict | None = None, vision: dict | None = None, vq: dict | None = None):
    """A random GlmImageForConditionalGeneration over `tok`: GLM text layers with 3-D rotary
    positions, a head over the C + 2 vision ids, a vision tower and VQ codebook (tiny unless
    `text`/`vision`/`vq` give other shapes); its generation config samples (the pipeline calls
    `generate(do_sample=True)`) and keeps the image marks out of the C image tokens it must produce."""
    from transformers import GenerationConfig, GlmImageConfig, GlmImageForConditionalGeneration

    start, end = tok.convert_tokens_to_ids([IMAGE_START, IMAGE_END])
    text = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                          "mrope_section": [4, 2, 2], "partial_rotary_factor": 1.0},
            **(text or {})}
    vision = {"depth": 1, "hidden_size": 32, "num_heads": 2, "image_size": 64, "patch_size": 16,
              "intermediate_size": 64, **(vision or {})}
    vq = {"embed_dim": 32, "latent_channels": 32, **(vq or {}), "num_embeddings": codebook}
    cfg = GlmImageConfig(
        text_config={"vocab_size": len(tok), "max_position_embeddings": 8192, "vision_vocab_size": codebook + 2,
                     "pad_token_id": tok.pad_token_id, "eos_token_id": end, **text},
        vision_config=vision, vq_config=vq, image_token_id=tok.convert_tokens_to_ids(NAMED_TOKENS["image_token"]),
        image_start_token_id=start, image_end_token_id=end)
    model = GlmImageForConditionalGeneration(cfg)
    model.generation_config = GenerationConfig(do_sample=True, temperature=1.0, top_k=codebook, eos_token_id=end,
                                               pad_token_id=tok.pad_token_id, bos_token_id=start,
                                               suppress_tokens=[start, end])
    return model


def glyph_tower(**shape):
    """(ByT5's byte tokenizer — it needs no files — and a T5 encoder over its 384 ids: tiny unless
    `shape` gives T5Config's sizes, e.g. ByT5-small's)."""
    from transformers import ByT5Tokenizer, T5Config, T5EncoderModel

    tok = ByT5Tokenizer()
    shape = {"d_model": 32, "d_kv": 16, "d_ff": 64, "num_layers": 2, "num_heads": 2,
             "relative_attention_num_buckets": 8, "relative_attention_max_distance": 32, **shape}
    cfg = T5Config(vocab_size=len(tok), feed_forward_proj="gated-gelu", is_encoder_decoder=False,
                   pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, decoder_start_token_id=0, **shape)
    return tok, T5EncoderModel(cfg)


def glm_image_decoder(glyph_dim: int, codebook: int):
    """(a 2-block GlmImageTransformer2DModel over 4 latent channels reading `codebook` prior
    tokens, an 8× AutoencoderKL with per-channel latent mean and std as GLM-Image's VAE has)."""
    from diffusers import AutoencoderKL, GlmImageTransformer2DModel

    transformer = GlmImageTransformer2DModel(patch_size=2, in_channels=4, out_channels=4, num_layers=2,
                                             attention_head_dim=8, num_attention_heads=2, text_embed_dim=glyph_dim,
                                             time_embed_dim=16, condition_dim=8,
                                             prior_vq_quantizer_codebook_size=codebook)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 16, 16),
                        layers_per_block=1, latent_channels=4, norm_num_groups=8,
                        latents_mean=[0.1, -0.2, 0.0, 0.3], latents_std=[1.5, 0.8, 1.2, 1.0])
    return transformer, vae
