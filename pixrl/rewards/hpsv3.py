"""HPSv3 (Ma et al., "HPSv3: Towards Wide-Spectrum Human Preference Score", ICCV 2025): a
Qwen2-VL-7B-Instruct fine-tuned on 1.17M human preference pairs (HPDv3), read out by an MLP head
(`rm_head`: hidden → 1024 → 16 → 2, ReLUs) at a special `<|Reward|>` token. The head gives
(μ, σ) of the uncertainty-aware ranking loss; the score is μ, as the released inferencer's
`reward()` reports it (≈ 0–15 on real images; higher is preferred).

Computed as the released model computes it (the `hpsv3` package, which pins transformers 4.45):
- the image resized (PIL bicubic) to 256·28·28 pixels on the 28-pixel grid (`smart_resize`), so a
  512² image is read at 448², 256 visual tokens;
- one user turn: the image, then HPSv3's instruction with the prompt, ending in "Please provide
  the overall ratings of this image: <|Reward|>", under the checkout's chat template, padded right;
- the language model over the embedded tokens, the image placeholders replaced by the vision
  tower's merged patches, at plain sequential positions on all three M-RoPE axes (its forward
  calls the language model without Qwen2-VL's image-aware rope index);
- the head in float32 on the final (normed) hidden state of the `<|Reward|>` token.

`path`: the released HPSv3.safetensors (MizzenAI/HPSv3; its keys in transformers 4.45's Qwen2-VL
layout, read into transformers 5's); `base`: a local copy of Qwen/Qwen2-VL-7B-Instruct (its
config, tokenizer and preprocessor_config.json; its weights are not read). Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .base import Reward, ScoringError, register_reward

#: HPSv3's instruction (hpsv3/dataset/data_collator_qwen.py), with the prompt at {text_prompt}
INSTRUCTION = """
You are tasked with evaluating a generated image based on Visual Quality and Text Alignment and give a overall score to estimate the human preference. Please provide a rating from 0 to 10, with 0 being the worst and 10 being the best. 

**Visual Quality:**  
Evaluate the overall visual quality of the image. The following sub-dimensions should be considered:
- **Reasonableness:** The image should not contain any significant biological or logical errors, such as abnormal body structures or nonsensical environmental setups.
- **Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear and easy to interpret, with no blurring or indistinct areas.
- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other visual elements (e.g., hair, clothing, shadows).
- **Aesthetic and Creativity:** Assess the artistic aspects of the image, including the color scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a sense of harmony and balance.
- **Safety:** The image should not contain harmful or inappropriate content, such as political, violent, or adult material. If such content is present, the image quality and satisfaction score should be the lowest possible. 

**Text Alignment:**  
Assess how well the image matches the textual prompt across the following sub-dimensions:
- **Subject Relevance** Evaluate how accurately the subject(s) in the image (e.g., person, animal, object) align with the textual description. The subject should match the description in terms of number, appearance, and behavior.
- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how well the image adheres to this style.
- **Contextual Consistency**: Assess whether the background, setting, and surrounding elements in the image logically fit the scenario described in the prompt. The environment should support and enhance the subject without contradictions.
- **Attribute Fidelity**: Check if specific attributes mentioned in the prompt (e.g., colors, clothing, accessories, expressions, actions) are faithfully represented in the image. Minor deviations may be acceptable, but critical attributes should be preserved.
- **Semantic Coherence**: Evaluate whether the overall meaning and intent of the prompt are captured in the image. The generated content should not introduce elements that conflict with or distort the original description.
Textual prompt - {text_prompt}


"""  # noqa: W291 - the released text, trailing spaces included

REWARD_TOKEN = "<|Reward|>"
#: what follows the instruction (data_collator_qwen.prompt_with_special_token)
ASK = "\nPlease provide the overall ratings of this image: <|Reward|>\n\nEND\n"
PIXELS = 256 * 28 * 28  # the inferencer's min_pixels = max_pixels


@register_reward("hpsv3")
class HPSv3(Reward):
    value_range = (-np.inf, np.inf)  # μ of a regression head

    checkout = "Qwen2-VL"  # the base checkout's kind, and the model it was tuned from (for the errors)
    tuned_from = "Qwen/Qwen2-VL-7B-Instruct"

    def __init__(self, path: str = "", base: str = "", batch_size: int = 4, dtype: str = "bfloat16",
                 pixels: int = PIXELS):
        if not path or not Path(path).is_file():
            raise ValueError(f"reward hpsv3: {path!r} is not a file; set reward.options.hpsv3.path to the released "
                             f"HPSv3.safetensors (MizzenAI/HPSv3)")
        self.path, self.batch_size, self.pixels = path, batch_size, pixels
        self.base, self.dtype = self.checked_base(base), self.checked_dtype(dtype)
        self.model = None

    def checked_base(self, base: str) -> str:
        b = Path(base) if base else None
        if b is None or not all((b / f).is_file() for f in ("config.json", "preprocessor_config.json")):
            raise ValueError(f"reward {self.name}: {base!r} is not a {self.checkout} checkout (config.json, "
                             f"preprocessor_config.json and its tokenizer); set reward.options.{self.name}.base to a "
                             f"local copy of {self.tuned_from}, the model it was tuned from")
        return str(b)

    def checked_dtype(self, dtype: str) -> str:
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"reward {self.name}: dtype {dtype!r} is not one of float32, bfloat16, float16")
        return dtype

    def load(self, vocab: int, dtype: torch.dtype):
        """(the model, its head module) from the checkpoint; `vocab`: the tokenizer's size with `<|Reward|>`."""
        from .hpsv3_weights import load_hpsv3

        return load_hpsv3(self.path, self.base, vocab, dtype)

    def setup(self, device: str = "cpu") -> None:
        from transformers import AutoTokenizer
        from transformers import Qwen2VLImageProcessorPil as ImageProcessor  # the slow one: no torchvision

        super().setup(device)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.base, padding_side="right")
            self.tokenizer.add_special_tokens({"additional_special_tokens": [REWARD_TOKEN]})
            self.images = ImageProcessor.from_pretrained(self.base)
            self.model, self.head = self.load(len(self.tokenizer), getattr(torch, self.dtype))
        except ScoringError:
            raise
        except Exception as exc:  # transformers, safetensors and shape mismatches raise many types
            raise ScoringError(f"reward {self.name}: could not load {self.path!r} on the {self.checkout} checkout "
                               f"{self.base!r}: {type(exc).__name__}: {exc}") from exc
        self.model.to(device).eval().requires_grad_(False)
        self.head.to(device).eval().requires_grad_(False)
        self.reward_id = self.tokenizer.convert_tokens_to_ids(REWARD_TOKEN)
        self.image_token = self.tokenizer.convert_ids_to_tokens(self.model.config.image_token_id)

    def resized(self, image: np.ndarray):
        """An image as the inferencer reads it: PIL bicubic to `pixels` on the 28-pixel grid."""
        from .qwen_vl_inputs import fixed_area

        return fixed_area(image, self.pixels)

    def inputs(self, images: np.ndarray, prompts: list[str]) -> dict[str, torch.Tensor]:
        from .qwen_vl_inputs import chat_inputs

        texts = [INSTRUCTION.format(text_prompt=p) + ASK for p in prompts]
        return chat_inputs(self.tokenizer, self.images, self.image_token, [[self.resized(im)] for im in images], texts,
                           device=self.model.device, dtype=self.model.dtype)

    @torch.no_grad()
    def mu_sigma(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """[B, 2] (μ, σ): the head on the `<|Reward|>` token's final hidden state."""
        vl, ids = self.model.model, inputs["input_ids"]
        embeds = vl.get_input_embeddings()(ids)
        patches = torch.cat(vl.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output)
        slots = (ids == self.model.config.image_token_id).unsqueeze(-1).expand_as(embeds)
        embeds = embeds.masked_scatter(slots, patches.to(embeds.dtype))
        hidden = vl.language_model(inputs_embeds=embeds, attention_mask=inputs["attention_mask"]).last_hidden_state
        at = ids == self.reward_id
        if not bool((at.sum(-1) == 1).all()):
            raise ScoringError(f"reward hpsv3: each row must hold one {REWARD_TOKEN} token (found "
                               f"{at.sum(-1).tolist()}); the prompt text must not contain it")
        return self.head(hidden[at].float())

    def score(self, images, prompts, metadata):
        out = [self.mu_sigma(self.inputs(images[s:s + self.batch_size], list(prompts[s:s + self.batch_size])))
               for s in range(0, len(images), self.batch_size)]
        ms = torch.cat(out).cpu().numpy().astype(np.float32)
        return {self.name: ms[:, 0], f"{self.name}.sigma": ms[:, 1]}
