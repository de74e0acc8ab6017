"""EditReward (Wu et al., "EditReward: A Human-Aligned Reward Model for Instruction-Guided Image
Editing", TIGER-AI-Lab, 2025): a Qwen2.5-VL-7B-Instruct (or MiMo-VL-7B, the same architecture)
tuned on 200K human preference pairs of edits, which reads the source image, the edited image and
the instruction and scores the edit — the reward UniRL's service gives editing RL.

Computed as the released inferencer (`EditRewardInferencer`, transformers 4.57) computes it for its
multi-head models (`rm_head_type: ranknet_multi_head`):
- both images resized (PIL bicubic) to 256·28·28 pixels on the 28-pixel grid, as its
  `process_vision_info` does at min_pixels = max_pixels;
- each edit read twice, one user turn each: the source image, the edited image, then a rubric with
  the instruction (editreward_prompts.py: instruction following; visual quality) ending in
  "Please provide the overall ratings of this image: <|Reward|>", padded right;
- the language model over the embedded tokens, the image placeholders replaced by the vision
  tower's merged patches, at plain sequential positions (its forward calls the model with input
  embeddings and no position ids, where Qwen2.5-VL's image-aware rope index is not taken);
- each reading's head (`rm_heads.head_0`, `head_1`: hidden → 1024 → 16 → 2, float32) on the final
  hidden state of its `<|Reward|>` token; the two (μ, σ) fused by the checkpoint's
  `pooling_strategy` (the released configs: mean); the score is μ.
`editreward.following` and `editreward.quality` keep each head's μ.

`path`: the checkpoint (a `model.safetensors` or `model.pth` file, or the folder holding one: the
reward model's state dict in transformers 4.57's Qwen2.5-VL layout plus the heads); `base`: a local
copy of the model it was tuned from (Qwen/Qwen2.5-VL-7B-Instruct: its config, tokenizer and
preprocessor_config.json; its weights are not read). The source image comes with each sample
(metadata `source_image`, as editing datasets give it). Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .base import ScoringError, register_reward
from .editreward_prompts import FOLLOWING, QUALITY
from .hpsv3 import ASK, HPSv3, PIXELS, REWARD_TOKEN

RUBRICS = {"following": FOLLOWING, "quality": QUALITY}  # head_0, head_1, in the inferencer's order
POOLING = ("mean", "min", "sum")


@register_reward("editreward")
class EditReward(HPSv3):
    """HPSv3's reader (tokenizer with `<|Reward|>`, fixed-area images, setup) with EditReward's
    checkpoint, two images a row and two heads; `self.head` holds the heads by name."""

    value_range = (-np.inf, np.inf)  # μ of regression heads
    components = tuple(RUBRICS)  # following, quality: each head's μ
    checkout = "Qwen2.5-VL"
    tuned_from = "Qwen/Qwen2.5-VL-7B-Instruct"

    def __init__(self, path: str = "", base: str = "", batch_size: int = 4, dtype: str = "bfloat16",
                 pooling: str = "mean", pixels: int = PIXELS):
        self.path, self.batch_size, self.pixels = checkpoint_file(path), batch_size, pixels
        self.base, self.dtype = self.checked_base(base), self.checked_dtype(dtype)
        if pooling not in POOLING:
            raise ValueError(f"reward editreward: pooling {pooling!r} is not one of {', '.join(POOLING)} (the "
                             "checkpoint config's pooling_strategy; the released ones use mean)")
        self.pooling = pooling
        self.model = None

    def load(self, vocab: int, dtype: torch.dtype):
        from .editreward_weights import load_editreward

        return load_editreward(self.path, self.base, vocab, dtype)

    def inputs(self, sources: list[np.ndarray], edits: np.ndarray, prompts: list[str],
               rubric: str) -> dict[str, torch.Tensor]:
        """One reading of each edit: [source, edited] then the rubric with its instruction."""
        from .qwen_vl_inputs import chat_inputs

        texts = [RUBRICS[rubric].format(text_prompt=p) + ASK for p in prompts]
        pairs = [[self.resized(s), self.resized(e)] for s, e in zip(sources, edits)]
        return chat_inputs(self.tokenizer, self.images, self.image_token, pairs, texts, device=self.model.device,
                           dtype=self.model.dtype)

    @torch.no_grad()
    def head_output(self, inputs: dict[str, torch.Tensor], head: int) -> torch.Tensor:
        """[B, 2] (μ, σ) of head `head` on the `<|Reward|>` token's final hidden state."""
        ids, model = inputs["input_ids"], self.model
        embeds = model.get_input_embeddings()(ids)
        patches = torch.cat(model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output)
        slots = (ids == model.config.image_token_id).unsqueeze(-1).expand_as(embeds)
        embeds = embeds.masked_scatter(slots, patches.to(embeds.dtype))
        hidden = model.language_model(inputs_embeds=embeds, attention_mask=inputs["attention_mask"]).last_hidden_state
        at = ids == self.reward_id
        if not bool((at.sum(-1) == 1).all()):
            raise ScoringError(f"reward editreward: each row must hold one {REWARD_TOKEN} token (found "
                               f"{at.sum(-1).tolist()}); the instruction must not contain it")
        return self.head[f"head_{head}"](hidden[at].float())

    def fused(self, per_head: list[torch.Tensor]) -> torch.Tensor:
        """The heads' (μ, σ) fused as the model's `pooling_strategy` fuses them."""
        stacked = torch.stack(per_head)  # [heads, B, 2]
        if self.pooling == "mean":
            return stacked.mean(0)
        if self.pooling == "min":
            return stacked.min(0).values
        sigma = stacked[..., 1].exp().pow(2).sum(0).sqrt()  # "sum": means add, σ² add (σ stored as its log)
        return torch.stack([stacked[..., 0].sum(0), sigma.log()], dim=-1)

    def check_prompts(self, prompts: list[str], metadata: list[dict]) -> None:
        from .image_similarity import check_sources

        check_sources(metadata, self.name)

    def score(self, images, prompts, metadata):
        from .image_similarity import source_arrays

        sources = source_arrays(metadata, self.name)
        out: dict[str, list] = {self.name: [], **{f"{self.name}.{r}": [] for r in RUBRICS}}
        for s in range(0, len(images), self.batch_size):
            rows = slice(s, s + self.batch_size)
            per_head = [self.head_output(self.inputs(sources[rows], images[rows], list(prompts[rows]), r), k)
                        for k, r in enumerate(RUBRICS)]
            out[self.name].append(self.fused(per_head)[:, 0])
            for r, h in zip(RUBRICS, per_head):
                out[f"{self.name}.{r}"].append(h[:, 0])
        return {k: torch.cat(v).cpu().numpy().astype(np.float32) for k, v in out.items()}


def checkpoint_file(path: str) -> str:
    """The checkpoint file: `path` itself, or the `model.safetensors` / `model.pth` in it (the
    inferencer's order: model.pth first)."""
    p = Path(path) if path else None
    if p is not None and p.is_dir():
        found = [p / n for n in ("model.pth", "model.safetensors") if (p / n).is_file()]
        p = found[0] if found else None
    if p is None or not p.is_file():
        raise ValueError(f"reward editreward: {path!r} holds no checkpoint; set reward.options.editreward.path to the "
                         "EditReward checkpoint (its model.safetensors or model.pth, or the folder holding it)")
    return str(p)
