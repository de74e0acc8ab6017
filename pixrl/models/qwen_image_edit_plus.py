"""Qwen-Image-Edit-2509 and -2511: Qwen-Image-Edit as QwenImageEditPlusPipeline computes it. The
model reads its source twice, at two sizes:

- Qwen2.5-VL sees the source at 384·384 pixels (`CONDITION_IMAGE_SIZE`, the aspect kept on the
  32-pixel grid), announced in the user turn as "Picture 1: " before the instruction (the Plus
  template holds no image of its own; the system part, 64 tokens, is dropped as before);
- the VAE encodes it at 1024·1024 pixels (`VAE_IMAGE_SIZE`) into the tokens that follow the target's.

2511's transformer (`zero_cond_t` in its config) modulates those source tokens at timestep 0; the
transformer reads that from its config and `img_shapes`, so one family serves both checkpoints.
One source per prompt (the pipeline takes several, "Picture 1:", "Picture 2:" …; pixrl's editing
datasets carry one). Everything else — centre crop to a square, the M-RoPE grid with the
processor's image marks, true CFG with each row's negative read with its source — is
Qwen-Image-Edit's (models/qwen_image_edit.py).
"""

from __future__ import annotations

from .qwen_image_edit import QwenImageEditFamily
from .registry import register_family

__all__ = ["QwenImageEditPlusFamily"]


@register_family("qwen_image_edit_plus")
class QwenImageEditPlusFamily(QwenImageEditFamily):
    name = "qwen_image_edit_plus"
    pipeline_class = "QwenImageEditPlusPipeline"
    vl_area = 384 * 384  # pipeline_qwenimage_edit_plus.CONDITION_IMAGE_SIZE
    vae_area = 1024 * 1024  # VAE_IMAGE_SIZE
    image_prompt = "Picture 1: <|vision_start|><|image_pad|><|vision_end|>"

    @classmethod
    def write_tiny(cls, out_dir, seed: int = 0, zero_cond_t: bool = True) -> dict:
        """A random QwenImageEditPlusPipeline in the released layout (Qwen-Image-Edit's tiny parts);
        `zero_cond_t`: 2511's transformer (the default), else 2509's."""
        return super().write_tiny(out_dir, seed, zero_cond_t=zero_cond_t)
