"""Janus-Pro (token-autoregressive, categorical actions): transformers' JanusForConditionalGeneration
in image-generation mode — a Llama decoder over [prompt ; image tokens], the generation
embeddings/aligner feeding each sampled VQ token back, the generation head giving its logits,
and the VQ-VAE decoding the token grid.

Prompts are formatted as the checkpoint's chat template renders a user turn with the generation
prompt, plus `<begin_of_image>` (what JanusProcessor does with generation_mode="image"); the
unconditional rows of classifier-free guidance are the same ids with every token but BOS and
`<begin_of_image>` replaced by the pad token (as JanusForConditionalGeneration.generate and
DeepSeek's own sampler build them), attending the same positions. The family gives logits per
row — conditional rows first, then unconditional — and the shared token sampler
(algorithms/token_sampling.py) applies guidance, temperature and top-k identically in rollout
and replay.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .base import ModelLoadError, size_setting, torch_dtype, weight_names
from .janus_cot import CotPrompts, cot_length, cot_parts, cot_tail, user_turn
from .registry import register_family
from .taxonomy import Action, PolicySemantics, PolicyStep, Regime

#: the tensors image generation needs beyond a Janus language model
GENERATION_WEIGHTS = ("model.generation_embeddings.weight", "model.generation_head.vision_head.weight",
                      "model.generation_aligner.fc1.weight", "model.vqmodel.quantize.embedding.weight")
_LORA_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class JanusPrompts:
    """Left-padded prompt ids for a batch, their attention mask, and the unconditional ids."""

    ids: torch.Tensor  # [B, L]
    mask: torch.Tensor  # [B, L] 1 = token, 0 = left padding
    uncond_ids: torch.Tensor  # [B, L]

    def select(self, idx) -> "JanusPrompts":
        return JanusPrompts(self.ids[idx], self.mask[idx], self.uncond_ids[idx])

    def expand(self, n: int) -> "JanusPrompts":
        return JanusPrompts(self.ids.expand(n, -1), self.mask.expand(n, -1), self.uncond_ids.expand(n, -1))


@dataclass
class DecodeState:
    """The KV cache of an incremental image-token decode and where the next token goes."""

    cache: object
    mask: torch.Tensor  # [R, L + k]
    next_pos: torch.Tensor  # [R] position id of the next input token


@register_family("janus_pro")
class JanusProFamily:
    name = "janus_pro"
    pipeline_class = "JanusForConditionalGeneration"
    semantics = PolicySemantics(regime=Regime.token_autoregressive, step=PolicyStep.token, action=Action.categorical)
    guidance = "logits"  # CFG combines conditional and unconditional logits; no negative-prompt batch
    video = False
    square_only = "its VQ tokens fill a fixed square grid"  # model.height/width must agree (preflight)
    #: full fine-tuning trains the decoder and the generation path; the understanding encoder,
    #: its aligner and the frozen VQ-VAE stay fixed (as in T2I-R1 and ReasonGen-R1)
    frozen_prefixes = ("model.vqmodel.", "model.vision_model.", "model.aligner.")

    def __init__(self, model, tokenizer, path: str, dtype: torch.dtype, max_sequence_length: int):
        self.transformer, self.tokenizer, self.path, self.dtype = model, tokenizer, path, dtype
        cfg = model.config
        self.grid = cfg.vq_config.num_patches
        self.resolution = self.grid * 2 ** (len(cfg.vq_config.channel_multiplier) - 1)
        self.height = self.width = self.resolution
        self.context = cfg.text_config.max_position_embeddings
        self.max_sequence_length = max_sequence_length or self.context - self.image_token_count()
        self.boi_id = tokenizer.convert_tokens_to_ids(tokenizer.boi_token)
        self.pad_id = tokenizer.pad_token_id
        self.bos_id = tokenizer.bos_token_id

    # --- loading ------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path, dtype: str = "float32", device: str = "cpu", max_sequence_length: int = 0,
             resolution: int | tuple[int | None, int | None] | None = None, frames: int | None = None,
             trainable_device: str | None = None) -> "JanusProFamily":
        """`trainable_device` keeps the model (all of it is the trainable module) off `device`:
        "cpu", or "meta" (built from its config, no weights read: a sharded trainer rank)."""
        from transformers import AutoConfig, AutoTokenizer, JanusForConditionalGeneration
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()  # the loader's bars would garble the CLI's own progress
        if frames is not None:
            raise ModelLoadError(f"model.frames={frames}: the {cls.name} family makes images; unset model.frames")
        p = cls.check_checkpoint(path)
        try:
            if trainable_device == "meta":
                from accelerate import init_empty_weights

                with init_empty_weights(include_buffers=False):  # rotary tables stay real
                    model = JanusForConditionalGeneration(AutoConfig.from_pretrained(str(p))).to(torch_dtype(dtype))
                model.tie_weights()  # the empty-weights context re-creates each parameter it registers
            else:
                model = JanusForConditionalGeneration.from_pretrained(str(p), dtype=torch_dtype(dtype))
            tokenizer = AutoTokenizer.from_pretrained(str(p))
        except Exception as exc:  # transformers raises many types; name the path and the cause
            raise ModelLoadError(f"could not load the Janus-Pro checkpoint {str(p)!r}: {exc}") from exc
        if getattr(tokenizer, "boi_token", None) is None:
            raise ModelLoadError(f"the tokenizer of {str(p)!r} declares no boi_token (<begin_of_image>); image "
                                 f"generation needs it (extra_special_tokens in tokenizer_config.json)")
        model.to(trainable_device or device).eval()
        model.requires_grad_(False)
        fam = cls(model, tokenizer, str(p), torch_dtype(dtype), max_sequence_length)
        h, w = resolution if isinstance(resolution, tuple) else (resolution, resolution)
        if (h or fam.resolution, w or fam.resolution) != (fam.resolution, fam.resolution):
            raise ModelLoadError(f"{size_setting(h or fam.resolution, w or fam.resolution)}: this Janus-Pro checkpoint "
                                 f"generates {fam.resolution}px square images ({fam.grid}×{fam.grid} VQ tokens); unset "
                                 "model.resolution/height/width")
        if fam.max_sequence_length + fam.image_token_count() > fam.context:
            raise ModelLoadError(f"model.max_sequence_length={max_sequence_length} plus {fam.image_token_count()} image "
                                 f"tokens exceeds the model's context of {fam.context} positions; set at most "
                                 f"{fam.context - fam.image_token_count()}")
        return fam

    @classmethod
    def check_checkpoint(cls, path: str | Path) -> Path:
        """A Janus checkpoint directory with the image-generation path, or a ModelLoadError saying
        what to set (preflight runs this without loading any weights)."""
        p = Path(path)
        cfg_file = p / "config.json"
        if not cfg_file.is_file():
            raise ModelLoadError(f"model path {str(p)!r} is not a Janus-Pro checkpoint (no config.json there); set "
                                 f"model.path to a local checkout in the transformers layout, or write a tiny one "
                                 f"with `pixrl tiny {cls.name} --out DIR`")
        model_type = json.loads(cfg_file.read_text()).get("model_type")
        if model_type != "janus":
            raise ModelLoadError(f"{str(p)!r} holds a {model_type!r} model, not a Janus ('janus'); set model.family to "
                                 f"its family, or model.path to a Janus-Pro checkout")
        lacking = [w for w in GENERATION_WEIGHTS if w not in weight_names(p)]
        if lacking:
            raise ModelLoadError(f"{str(p)!r} has no image-generation head ({', '.join(lacking)} missing): it cannot "
                                 f"generate images; use a Janus-Pro checkpoint with its generation path (e.g. "
                                 f"deepseek-community/Janus-Pro-1B converted to the transformers layout)")
        return p

    @classmethod
    def check_prompts(cls, path: str | Path, prompts: list[str], max_sequence_length: int = 0,
                      cot_tokens: int = 0, cot_template: str = "") -> None:
        """Every prompt fits the context with the image tokens — and with a chain of thought of
        `cot_tokens`, its reasoning prompt and its image prompt too (tokenizer and config only)."""
        from transformers import AutoConfig, AutoTokenizer

        cfg = AutoConfig.from_pretrained(str(path))
        tok = AutoTokenizer.from_pretrained(str(path))
        context = cfg.text_config.max_position_embeddings
        n_image = cfg.vq_config.num_patches ** 2
        limit = max_sequence_length or context - n_image
        tail = cot_tail(tok)
        for prompt in prompts:
            n = len(tok(cls.image_prompt(prompt) + tok.boi_token).input_ids)
            if cot_tokens:  # as encode_cot_prompts measures it
                n = max(n, cot_length(*cot_parts(tok, prompt, cot_template), tail, cot_tokens))
            if n > limit:
                raise PromptTooLong.of(prompt, n, limit, context, n_image, cot_tokens)

    @property
    def model(self):
        """The JanusForConditionalGeneration in use (`transformer`: the slot the trainer's
        reference view swaps for the frozen reference weights)."""
        return self.transformer

    @property
    def device(self) -> torch.device:
        return self.model.device

    def identity(self) -> str:
        return f"{self.name}:{self.path}:{self.dtype}:{self.max_sequence_length}"

    def trainable_module(self) -> torch.nn.Module:
        return self.model

    @staticmethod
    def fsdp_units(module: torch.nn.Module) -> list[torch.nn.Module]:
        """What FSDP shards (engines/fsdp.py): the parts this family calls directly — the text
        and image-token embeddings, the image aligner, both heads — and each decoder layer; the
        root's forward is never called, so it is not wrapped."""
        m = module.model
        return [*m.language_model.layers, m.language_model.embed_tokens, m.generation_embeddings,
                m.generation_aligner, m.generation_head, module.lm_head]

    @property
    def lora_targets(self) -> list[str]:
        """The language model's attention and MLP projections (named in full: the vision tower has
        `q_proj`-like names too)."""
        return [n for n, _ in self.model.named_modules()
                if n.startswith("model.language_model.") and n.endswith(_LORA_SUFFIXES)]

    def image_token_count(self) -> int:
        return self.grid * self.grid

    def latent_shape(self) -> tuple[int, ...]:
        """The token grid (rows of the stored `tokens` field are its flattening)."""
        return (self.grid, self.grid)

    def describe(self) -> dict:
        return {"resolution": [self.resolution, self.resolution], "image_tokens": self.image_token_count(),
                "guidance": self.guidance}

    # --- prompts ------------------------------------------------------------------------------
    @staticmethod
    def image_prompt(prompt: str) -> str:
        """A user turn with the generation prompt, as Janus-Pro's chat template renders it, and the
        image-start token JanusProcessor appends in image mode."""
        return user_turn(prompt)

    def encode_prompts(self, prompts: list[str]) -> JanusPrompts:
        texts = [self.image_prompt(p) + self.tokenizer.boi_token for p in prompts]
        enc = [self.tokenizer(t).input_ids for t in texts]
        for p, e in zip(prompts, enc):
            if len(e) > self.max_sequence_length:
                raise PromptTooLong.of(p, len(e), self.max_sequence_length, self.context, self.image_token_count())
        return self._image_prompts(enc, max(len(e) for e in enc))

    def _image_prompts(self, enc: list[list[int]], width: int) -> JanusPrompts:
        """Image prompts left-padded to `width`, with their unconditional rows: every token but BOS
        and <begin_of_image> replaced by the pad token (as Janus's generate builds them)."""
        ids, mask = self._left_pad(enc, width)
        keep = (ids == self.bos_id) | (ids == self.boi_id)
        uncond = torch.where(keep | (mask == 0), ids, torch.full_like(ids, self.pad_id))
        dev = self.device
        return JanusPrompts(ids.to(dev), mask.to(dev), uncond.to(dev))

    # --- the token step -----------------------------------------------------------------------
    def _rows(self, cond: JanusPrompts, guided: bool) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.cat([cond.ids, cond.uncond_ids]) if guided else cond.ids
        mask = torch.cat([cond.mask, cond.mask]) if guided else cond.mask
        return ids, mask

    def _lm(self, embeds, mask, positions, cache=None):
        out = self.model.model.language_model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions,
                                              past_key_values=cache, use_cache=cache is not None)
        return out.last_hidden_state, out.past_key_values

    def first_logits(self, cond: JanusPrompts, guided: bool, text: bool = False) -> tuple[torch.Tensor, DecodeState]:
        """Logits [R, V] of the first image token (R = B, or 2B with guidance: conditional rows
        first) and the decode state after the prompt; `text`: of the first text token (the
        language-model head: a chain of thought)."""
        from transformers import DynamicCache

        ids, mask = self._rows(cond, guided)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        embeds = self.model.get_input_embeddings()(ids)
        hidden, cache = self._lm(embeds, mask, positions, DynamicCache(config=self.model.config.text_config))
        return self._head(text)(hidden[:, -1]), DecodeState(cache, mask, positions[:, -1] + 1)

    def _head(self, text: bool):
        """The language-model head (text tokens) or the image-generation head."""
        return self.model.lm_head if text else self.model.model.generation_head

    def next_logits(self, state: DecodeState, tokens: torch.Tensor, text: bool = False) -> tuple[torch.Tensor, DecodeState]:
        """Feed the sampled image tokens [B] (to both halves with guidance; `text`: text tokens
        through the word embeddings); logits of the next."""
        rows = state.mask.shape[0]
        tok = tokens.repeat(rows // tokens.shape[0])
        if text:
            embeds = self.model.get_input_embeddings()(tok[:, None])
        else:
            embeds = self.model.prepare_embeddings_for_image_generation(tok[:, None])
        mask = torch.cat([state.mask, state.mask.new_ones((rows, 1))], dim=1)
        hidden, cache = self._lm(embeds, mask, state.next_pos[:, None], state.cache)
        return self._head(text)(hidden[:, -1]), DecodeState(cache, mask, state.next_pos + 1)

    def text_sequence_logits(self, cond: JanusPrompts, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced language-model logits [B, C, V] of every text token of `tokens` [B, C]
        after the prompts (positions after a row's end-of-sentence are computed and masked by the
        caller: causal attention keeps them out of the valid ones)."""
        n = tokens.shape[1]
        embeds = self.model.get_input_embeddings()(torch.cat([cond.ids, tokens[:, :-1].long()], dim=1))
        full = torch.cat([cond.mask, cond.mask.new_ones((cond.mask.shape[0], n - 1))], dim=1)
        positions = (full.cumsum(-1) - 1).clamp(min=0)
        hidden, _ = self._lm(embeds, full, positions)
        return self.model.lm_head(hidden[:, cond.ids.shape[1] - 1:])

    # --- the semantic chain of thought (T2I-R1) -----------------------------------------------
    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_token_id

    def _left_pad(self, enc: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.full((len(enc), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(enc), width), dtype=torch.long)
        for i, e in enumerate(enc):
            ids[i, width - len(e):] = torch.tensor(e, dtype=torch.long)
            mask[i, width - len(e):] = 1
        return ids, mask

    def encode_cot_prompts(self, prompts: list[str], template: str, max_tokens: int) -> CotPrompts:
        """The reasoning prompts (`template` with {prompt}, as a user turn with the generation
        prompt) and the image prompts' fixed parts, for a prompt set."""
        parts = [cot_parts(self.tokenizer, p, template) for p in prompts]
        enc, heads = [e for e, _ in parts], [h for _, h in parts]
        tail = cot_tail(self.tokenizer)
        for p, (e, h) in zip(prompts, parts):
            n = cot_length(e, h, tail, max_tokens)
            if n > self.max_sequence_length:
                raise PromptTooLong.of(p, n, self.max_sequence_length, self.context, self.image_token_count(), max_tokens)
        ids, mask = self._left_pad(enc, max(len(e) for e in enc))
        dev = self.device
        text = JanusPrompts(ids.to(dev), mask.to(dev), ids.to(dev))
        return CotPrompts(text, heads, tail, max(len(h) for h in heads) + len(tail) + max_tokens)

    def cot_image_prompts(self, cot: CotPrompts, rows: list[int], cot_tokens: torch.Tensor,
                          cot_mask: torch.Tensor) -> JanusPrompts:
        """The image prompts of set rows `rows` after their sampled CoT [B, C] (mask 1 = sampled):
        the text ids as sampled, special tokens dropped (T2I-R1 decodes them with
        skip_special_tokens), never re-tokenized — replay sees exactly the rollout's ids."""
        special = set(self.tokenizer.all_special_ids)
        enc = []
        for r, toks, m in zip(rows, cot_tokens.tolist(), cot_mask.tolist()):
            words = [t for t, keep in zip(toks, m) if keep and t not in special]
            enc.append(cot.heads[r] + words + cot.tail)
        return self._image_prompts(enc, cot.width)

    def sequence_logits(self, cond: JanusPrompts, tokens: torch.Tensor, guided: bool) -> torch.Tensor:
        """Teacher-forced logits [R, N, V] of every image token of `tokens` [B, N] in one pass
        (what replay differentiates; the rollout's stored log-probs are computed with it too)."""
        ids, mask = self._rows(cond, guided)
        rows, n = ids.shape[0], tokens.shape[1]
        tok = tokens.repeat(rows // tokens.shape[0], 1)
        embeds = torch.cat([self.model.get_input_embeddings()(ids),
                            self.model.prepare_embeddings_for_image_generation(tok[:, :-1])], dim=1)
        full = torch.cat([mask, mask.new_ones((rows, n - 1))], dim=1)
        positions = (full.cumsum(-1) - 1).clamp(min=0)
        hidden, _ = self._lm(embeds, full, positions)
        return self.model.model.generation_head(hidden[:, ids.shape[1] - 1:])

    # --- decode -------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, tokens: torch.Tensor) -> np.ndarray:
        """Image tokens [B, N] → uint8 [B, H, W, 3]: the VQ-VAE decode and JanusImageProcessor's
        postprocess (unnormalise with mean = std = 0.5, ×255, clip, truncate to uint8)."""
        img = self.model.decode_image_tokens(tokens.long().to(self.device)).float()  # [B, H, W, 3] in [-1, 1]
        return ((img * 0.5 + 0.5) * 255).clamp(0, 255).cpu().numpy().astype(np.uint8)

    # --- tiny checkpoints ---------------------------------------------------------------------
    @classmethod
    def write_tiny(cls, out_dir: Path, seed: int = 0, grid: int = 4, codebook: int = 64, hidden: int = 32) -> dict:
        """A random JanusForConditionalGeneration (2-layer Llama of width `hidden` (2 heads), one-layer vision
        tower, a VQ-VAE with the smallest GroupNorm-32 widths: `grid`² tokens → 4·grid px) with
        the DeepSeek tokenizer layout, image processor, chat template and generation config, saved
        as the transformers converter writes Janus-Pro. Returns its overrides."""
        from transformers import (JanusConfig, JanusForConditionalGeneration, JanusVisionConfig, JanusVQVAEConfig,
                                  LlamaConfig)

        from .tiny_parts import janus_generation_config, janus_tokenizer, save_janus_processor

        torch.manual_seed(seed)
        out_dir = Path(out_dir)
        tok = janus_tokenizer(out_dir)
        text = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                           pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
        vision = JanusVisionConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=4 * grid,
                                   patch_size=4, projection_dim=hidden, num_image_tokens=grid * grid)
        vq = JanusVQVAEConfig(embed_dim=8, num_embeddings=codebook, latent_channels=32, base_channels=32,
                              channel_multiplier=[1, 1, 2], num_res_blocks=1, projection_dim=hidden,
                              image_token_embed_dim=hidden)
        config = JanusConfig(text_config=text, vision_config=vision, vq_config=vq,
                             image_token_id=tok.convert_tokens_to_ids(tok.image_token))
        model = JanusForConditionalGeneration(config)
        model.generation_config = janus_generation_config(tok, guidance_scale=5.0)
        model.save_pretrained(str(out_dir))
        save_janus_processor(out_dir, tok, side=4 * grid, num_image_tokens=grid * grid)
        return {"model.family": cls.name, "model.path": str(out_dir), "model.max_sequence_length": 0,
                "sampling.guidance_scale": 5.0}


class PromptTooLong(ModelLoadError):
    """A prompt that does not fit the token family's context with its image tokens."""

    @classmethod
    def of(cls, prompt: str, n: int, limit: int, context: int, n_image: int, cot: int = 0) -> "PromptTooLong":
        what = (f"with the chain of thought's reasoning template and its budget of {cot} tokens (sampling.cot_tokens, "
                f"sampling.cot_template)") if cot else "with its chat template"
        return cls(f"prompt {prompt[:60]!r} is {n} tokens {what}; this Janus-Pro run allows {limit} "
                   f"(the context of {context} positions minus {n_image} image tokens, or model.max_sequence_length) "
                   f"— shorten the prompt" + (", the template or the budget" if cot else "") + " or remove it from the set")
