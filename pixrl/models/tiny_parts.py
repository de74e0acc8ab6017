"""Parts for tiny random checkpoints in each family's real on-disk layout (`pixrl tiny FAMILY`).

Nothing may be downloaded, so the tokenizers are written here in the formats the real
checkpoints ship (a CLIP BPE tokenizer, a T5 SentencePiece-Unigram `tokenizer.json`) over a
small closed vocabulary — every single character too, so any text still tokenizes. The models
are the real transformers/diffusers classes with small configs; a checkpoint built from these
loads through exactly the path a real checkout does.
"""

from __future__ import annotations

from pathlib import Path

from .mini.build import shapes_vocabulary
from .mini.tokenizer import write_word_tokenizer

_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,'\"-!?:;()"
_GENERAL = ["photo", "picture", "image", "of", "with", "on", "in", "at", "cat", "dog", "sign", "says", "text",
            "person", "man", "woman", "car", "tree", "house", "sky", "city", "street", "hello", "world"]


def tiny_vocabulary() -> list[str]:
    """The words a tiny tokenizer keeps whole: the shapes world's plus a few general ones."""
    return sorted(set(shapes_vocabulary()) | set(_GENERAL))


def clip_tokenizer(out_dir: Path, max_length: int = 77):
    """A real CLIP BPE tokenizer (transformers layout) over the tiny vocabulary."""
    return write_word_tokenizer(tiny_vocabulary(), out_dir, max_length)


def t5_tokenizer(out_dir: Path, max_length: int = 512):
    """A T5TokenizerFast (SentencePiece-Unigram `tokenizer.json`, `</s>` appended, `<pad>` = 0)
    over the tiny vocabulary, as T5 and UMT5 checkpoints ship it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import T5TokenizerFast

    pieces: dict[str, float] = {"<pad>": 0.0, "</s>": 0.0, "<unk>": 0.0, "▁": -2.0}
    for w in tiny_vocabulary():
        pieces.setdefault("▁" + w, -1.0)
    for c in _CHARS:
        pieces.setdefault("▁" + c, -4.0)
        pieces.setdefault(c, -5.0)
    tok = Tokenizer(models.Unigram(list(pieces.items()), unk_id=2))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                       special_tokens=[("</s>", 1)])
    fast = T5TokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
                           extra_ids=0, model_max_length=max_length)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return T5TokenizerFast.from_pretrained(str(out_dir))


def clip_text_model(tokenizer, hidden: int = 32, layers: int = 2, with_projection: bool = False):
    """A tiny CLIP text tower whose special-token ids match `tokenizer` (pooling reads the EOS)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    cfg = CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=2, projection_dim=hidden,
                         max_position_embeddings=tokenizer.model_max_length, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return (CLIPTextModelWithProjection if with_projection else CLIPTextModel)(cfg)


def t5_encoder(tokenizer, d_model: int = 32, layers: int = 2):
    """A tiny T5 encoder (the FLUX.1 / SD3 text_encoder_3 class)."""
    from transformers import T5Config, T5EncoderModel

    cfg = T5Config(vocab_size=len(tokenizer), d_model=d_model, d_kv=d_model // 2, d_ff=2 * d_model,
                   num_layers=layers, num_heads=2, relative_attention_num_buckets=8,
                   relative_attention_max_distance=32, feed_forward_proj="gated-gelu", is_encoder_decoder=False,
                   pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=0)
    return T5EncoderModel(cfg)


def image_vae(latent_channels: int, channels: tuple[int, ...] = (8, 16), scaling_factor: float = 1.0,
              shift_factor: float = 0.0):
    """A tiny AutoencoderKL (×2^(len(channels)−1) downsampling), without quant convs as in FLUX/SD3."""
    from diffusers import AutoencoderKL

    n = len(channels)
    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * n,
                         up_block_types=("UpDecoderBlock2D",) * n, block_out_channels=channels, layers_per_block=1,
                         latent_channels=latent_channels, norm_num_groups=8, scaling_factor=scaling_factor,
                         shift_factor=shift_factor, use_quant_conv=False, use_post_quant_conv=False,
                         mid_block_add_attention=False)


def whole_word_merges(vocab: dict[str, int], pieces: list[str]) -> list[tuple[str, str]]:
    """BPE merges that build each piece left to right, so it becomes one token; its symbols and
    every prefix are added to `vocab` (in place) where missing."""
    merges: dict[tuple[str, str], None] = {}
    for piece in pieces:
        cur, *rest = piece
        for sym in rest:
            vocab.setdefault(sym, len(vocab))
            merges[(cur, sym)] = None
            cur += sym
            vocab.setdefault(cur, len(vocab))
    return list(merges)


# the words of Qwen-Image's prompt template: whole tokens, so that its system part is 34 tokens as
# with the real tokenizer (the pipeline drops exactly 34: with a character-level split it would
# drop part of the system text and keep the rest as if it were the prompt)
_QWEN_TEMPLATE_WORDS = ["the", "image", "by", "detailing", "color", "shape", "size", "texture", "quantity", "text",
                        "spatial", "relationships", "objects", "background"]


def qwen2_tokenizer(out_dir: Path, extra_pieces: list[str] = (), extra_pairs: list[tuple[str, str]] = ()):
    """A Qwen2 byte-level BPE tokenizer (`Qwen2Tokenizer`, the 256 byte symbols plus merges that
    make each tiny-vocabulary word with its leading space one token) with Qwen's chat tokens
    (`<|im_start|>`, `<|im_end|>`, `<|endoftext|>` as pad/eos), as Qwen2.5-VL checkpoints ship it.
    `extra_pieces` (whole tokens, "Ġ" for a space) and `extra_pairs` (merges of two symbols) come
    after the others, so the tokenizers without them keep their ids."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Tokenizer

    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    merges = whole_word_merges(vocab, ["Ġ" + w for w in tiny_vocabulary() + _QWEN_TEMPLATE_WORDS]  # "Ġ": a space
                               + ["system", "Describe", "user", "assistant"])
    merges += [m for m in whole_word_merges(vocab, list(extra_pieces)) if m not in merges]
    for a, b in extra_pairs:
        vocab.setdefault(a + b, len(vocab))
        merges.append((a, b))
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges)
    tok.add_special_tokens({"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
                            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out_dir))
    return Qwen2Tokenizer.from_pretrained(str(out_dir))


def qwen25_vl_text_encoder(tokenizer, hidden: int = 32, layers: int = 1, **token_ids):
    """A tiny Qwen2.5-VL (the Qwen-Image text encoder class: language model + a one-block vision
    tower, multimodal RoPE sections summing to half the head width); `token_ids`: its image tokens'."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    special = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id,
               "bos_token_id": tokenizer.eos_token_id}
    heads = max(2, hidden // 128)  # the 7B's 28 heads of 128 at its width 3584
    half = hidden // heads // 2  # temporal, height, width RoPE sections in the 7B's 2:3:3 proportion
    sections = [half * 2 // 8, half * 3 // 8, half - half * 2 // 8 - half * 3 // 8]
    cfg = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 7),
                         max_position_embeddings=2048, **special,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": sections}),
        vision_config=dict(depth=1, hidden_size=hidden, intermediate_size=2 * hidden, num_heads=2,
                           out_hidden_size=hidden, fullatt_block_indexes=[0]),
        **special, **token_ids)
    return Qwen2_5_VLForConditionalGeneration(cfg)


def byt5_glyph_encoder(d_model: int = 16):
    """(ByT5Tokenizer, a one-layer T5 encoder): the glyph tower of the HunyuanVideo-1.5 and
    HunyuanImage-2.1 pipelines (the real one: ByT5-small's encoder, width 1472)."""
    from transformers import ByT5Tokenizer, T5Config, T5EncoderModel

    tok = ByT5Tokenizer()
    return tok, T5EncoderModel(T5Config(vocab_size=len(tok), d_model=d_model, d_kv=8, d_ff=2 * d_model, num_layers=1,
                                        num_heads=2, relative_attention_num_buckets=8,
                                        relative_attention_max_distance=32, is_encoder_decoder=False,
                                        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                        decoder_start_token_id=0))


def gemma_tokenizer(out_dir: Path, extra_words: list[str] = ()):
    """A Gemma BPE tokenizer (`GemmaTokenizer`: spaces as "▁", byte fallback, `<bos>` prepended,
    `<pad>` = 0) whose merges make each tiny-vocabulary word — and `extra_words`, e.g. a prompt
    template's — one token, with and without its leading "▁", as Gemma/Gemma-2 checkpoints ship it."""
    from transformers import GemmaTokenizer

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"])}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for c in "▁" + _CHARS:
        vocab.setdefault(c, len(vocab))
    words = sorted(set(tiny_vocabulary()) | set(extra_words))
    merges = whole_word_merges(vocab, [piece for w in words for piece in (w, "▁" + w)])
    tok = GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True, add_eos_token=False)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out_dir))
    return GemmaTokenizer.from_pretrained(str(out_dir))


def gemma2_text_encoder(tokenizer, hidden: int = 32, layers: int = 2):
    """A tiny Gemma-2 decoder (`Gemma2Model`, the SANA text encoder class: grouped-query attention,
    logit soft-capping, alternating sliding-window layers) whose special ids match `tokenizer`."""
    from transformers import Gemma2Config, Gemma2Model

    cfg = Gemma2Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                       num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2,
                       query_pre_attn_scalar=hidden // 2, sliding_window=64, max_position_embeddings=4096,
                       pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id)
    return Gemma2Model(cfg)


# a Mistral-Small-3-style chat template (system prompt block, [INST] turns; text parts of list
# contents; an image part as [IMG]) — the structure the FLUX.2 pipeline's prompt encoding expects
_MISTRAL3_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set text = message['content'] %}"
    "{%- else %}{%- set text = namespace(v='') %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{%- set text.v = text.v + part['text'] %}"
    "{%- elif part['type'] in ['image', 'image_url'] %}{%- set text.v = text.v + '[IMG]' %}{%- endif %}"
    "{%- endfor %}{%- set text = text.v %}{%- endif %}"
    "{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST]' + text + '[/INST]' }}"
    "{%- else %}{{- text + eos_token }}{%- endif %}"
    "{%- endfor %}")


def mistral3_tokenizer(out_dir: Path, extra_words: list[str] = ()):
    """The FLUX.2-dev `tokenizer` folder's tokenizer: byte-level BPE with Mistral's control tokens
    (`<s>`, `</s>`, `<pad>`, `[INST]`, `[SYSTEM_PROMPT]`, `[IMG]`, …) whose merges keep the tiny
    vocabulary and `extra_words` (the pipeline's system message) whole, with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]",
                "[IMG_BREAK]", "[IMG_END]", "<pad>"]
    vocab = {t: i for i, t in enumerate(specials)}
    for c in sorted(ByteLevel.alphabet()):
        vocab[c] = len(vocab)
    words = sorted(set(tiny_vocabulary()) | set(extra_words))
    merges = whole_word_merges(vocab, [piece for w in words for piece in (w, "Ġ" + w)])  # "Ġ": a space
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", additional_special_tokens=specials[3:10],
                                   chat_template=_MISTRAL3_CHAT_TEMPLATE)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return PreTrainedTokenizerFast.from_pretrained(str(out_dir))


def as_pixtral_processor(pipeline_dir: Path, component: str = "tokenizer") -> None:
    """Turn a saved tokenizer component into the PixtralProcessor layout FLUX.2-dev ships (its
    processor and image-processor configs beside the tokenizer files, declared as a
    PixtralProcessor in model_index.json). Written as files: instantiating PixtralProcessor needs
    torchvision, which this project does not install."""
    import json

    folder = pipeline_dir / component
    (folder / "processor_config.json").write_text(json.dumps(
        {"processor_class": "PixtralProcessor", "patch_size": 8, "spatial_merge_size": 2, "image_token": "[IMG]",
         "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}, indent=2))
    (folder / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "PixtralImageProcessor", "processor_class": "PixtralProcessor", "patch_size": 8,
         "size": {"longest_edge": 64}, "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
         "do_normalize": True, "image_mean": [0.4815, 0.4578, 0.4082], "image_std": [0.2686, 0.2613, 0.2758],
         "do_convert_rgb": True}, indent=2))
    index = json.loads((pipeline_dir / "model_index.json").read_text())
    index[component] = ["transformers", "PixtralProcessor"]
    (pipeline_dir / "model_index.json").write_text(json.dumps(index, indent=2))


def mistral3_text_encoder(tok, hidden: int = 16, layers: int = 30):
    """A tiny Mistral-3 (`Mistral3ForConditionalGeneration`, the FLUX.2-dev text encoder class:
    Mistral decoder + a one-layer Pixtral vision tower). 30 layers: the pipeline reads hidden
    states 10, 20 and 30, as of the real 40-layer model."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    cfg = Mistral3Config(
        text_config=dict(model_type="mistral", vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2,
                         max_position_embeddings=4096, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id),
        vision_config=dict(model_type="pixtral", hidden_size=hidden, intermediate_size=2 * hidden,
                           num_hidden_layers=1, num_attention_heads=2, head_dim=hidden // 2, image_size=64,
                           patch_size=8),
        image_token_index=tok.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2)
    return Mistral3ForConditionalGeneration(cfg)


# DeepSeek's special tokens as the Janus-Pro tokenizer names them (full-width bars, "▁" spaces)
JANUS_BOS, JANUS_EOS, JANUS_PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
JANUS_IMAGE_TOKENS = {"image_token": "<image_placeholder>", "boi_token": "<begin_of_image>",
                      "eoi_token": "<end_of_image>"}


def janus_tokenizer(out_dir: Path):
    """The Janus-Pro tokenizer: DeepSeek's byte-level BPE with BOS prepended, its pad token, the
    image tokens as `extra_special_tokens` (`image_token`, `boi_token`, `eoi_token`, which
    JanusProcessor reads), over the tiny vocabulary. The chat roles (`<|User|>`) are plain text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    specials = [JANUS_BOS, JANUS_EOS, JANUS_PAD, *JANUS_IMAGE_TOKENS.values()]
    vocab = {t: i for i, t in enumerate(specials)}
    for c in sorted(ByteLevel.alphabet()):
        vocab[c] = len(vocab)
    words = tiny_vocabulary() + ["User", "Assistant"]
    merges = whole_word_merges(vocab, [piece for w in words for piece in (w, "Ġ" + w)])  # "Ġ": a space
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single=f"{JANUS_BOS} $A", pair=f"{JANUS_BOS} $A $B",
                                                       special_tokens=[(JANUS_BOS, 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=JANUS_BOS, eos_token=JANUS_EOS, pad_token=JANUS_PAD,
                                   extra_special_tokens=JANUS_IMAGE_TOKENS,
                                   padding_side="left", model_max_length=16384)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return PreTrainedTokenizerFast.from_pretrained(str(out_dir))


def janus_chat_template() -> str:
    """DeepSeek's chat format as Janus-Pro's processor renders it: `<|User|>: text` turns separated
    by a blank line, `<|Assistant|>:` answers closed by the end-of-sentence token, images as
    `<image_placeholder>`, and `<|Assistant|>:` as the generation prompt."""
    return ("{%- for message in messages -%}"
            "{%- set parts = message['content'] if message['content'] is not string "
            "else [{'type': 'text', 'text': message['content']}] -%}"
            "{%- set ns = namespace(text='') -%}"
            "{%- for part in parts -%}"
            "{%- if part['type'] == 'image' -%}{%- set ns.text = ns.text + '<image_placeholder>' -%}"
            "{%- elif part['type'] == 'text' -%}"
            "{%- set ns.text = ns.text + (' ' if ns.text and not ns.text.endswith('>') else '') + part['text'].strip() -%}"
            "{%- endif -%}{%- endfor -%}"
            "{%- if message['role'] | lower == 'user' -%}{{- '<|User|>: ' + ns.text + '\n\n' -}}"
            "{%- elif message['role'] | lower == 'assistant' -%}"
            "{{- '<|Assistant|>: ' + ns.text + '" + JANUS_EOS + "' -}}"
            "{%- else -%}{{- message['role'] | capitalize + ': ' + ns.text + '\n\n' -}}{%- endif -%}"
            "{%- endfor -%}"
            "{%- if add_generation_prompt -%}{{- '<|Assistant|>:' -}}{%- endif -%}")


def janus_generation_config(tok, guidance_scale: float):
    """The generation config the Janus-Pro converter writes: temperature 1, the CFG weight, the
    pad token, and `boi_token_id` (which image generation reads from `generation_kwargs`)."""
    from transformers import GenerationConfig

    return GenerationConfig(temperature=1.0, guidance_scale=guidance_scale, bos_token_id=tok.bos_token_id,
                            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                            generation_kwargs={"boi_token_id": tok.convert_tokens_to_ids(tok.boi_token)})


def save_janus_processor(out_dir: Path, tok, side: int, num_image_tokens: int) -> None:
    """JanusProcessor's files beside a checkpoint: the image processor (mean = std = 0.5, the
    postprocess decode relies on), the tokenizer and the chat template."""
    from transformers import JanusProcessor
    from transformers.models.janus.image_processing_pil_janus import JanusImageProcessorPil

    image = JanusImageProcessorPil(size={"height": side, "width": side}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    JanusProcessor(image_processor=image, tokenizer=tok, chat_template=janus_chat_template(),
                   use_default_system_prompt=True, num_image_tokens=num_image_tokens).save_pretrained(str(out_dir))


#: Qwen2.5-VL's chat format for one user turn of images and text, then the assistant's turn
QWEN_VL_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
