"""A random Qwen-Image-Edit (and -2511) and Qwen-Image-2.1 of their real shapes for `gpu_smoke.py` (beside real_shapes.py): nothing
is downloaded; the text encoder is shortened as Qwen-Image's is there, and the docstring says so."""

from __future__ import annotations

from pathlib import Path


class EditPipelineParts:
    """A QwenImageEditPipeline's components, saved in the released layout (its processor's files in
    `processor/`, which `save_pretrained` of the pipeline cannot write without torchvision)."""

    def __init__(self, parts: dict, pipeline: str = "QwenImageEditPipeline"):
        self.parts, self.pipeline = parts, pipeline

    def save_pretrained(self, out_dir: str, safe_serialization: bool = True) -> None:
        from pixrl.models.qwen_image_parts import save_edit_pipeline

        save_edit_pipeline(self.parts, Path(out_dir), self.pipeline)


def qwen_image_edit_plus_pipeline(layers: int | None, device: str, workdir: Path):
    """Qwen-Image-Edit-2511 as below, in a QwenImageEditPlusPipeline, its transformer's `zero_cond_t` on."""
    parts = qwen_image_edit_pipeline(layers, device, workdir, zero_cond_t=True).parts
    return EditPipelineParts(parts, "QwenImageEditPlusPipeline")


def qwen_image_edit_pipeline(layers: int | None, device: str, workdir: Path, zero_cond_t: bool = False):
    """Qwen-Image-Edit's transformer (the diffusers defaults: Qwen-Image's 60 blocks, `--layers N` of
    them) and VAE, Qwen2.5-VL at its real width (3584) with 2 of its 28 layers and a one-block
    vision tower, the edit template's tokenizer and the processor at Qwen2-VL's pixel bounds."""
    import torch
    from diffusers import QwenImageTransformer2DModel
    from transformers import Qwen2VLImageProcessorPil

    from pixrl.models.qwen_image_parts import qwen_image_core, tiny_edit_parts
    from pixrl.models.qwen_vl_processor import QwenVLProcessor

    parts = tiny_edit_parts(workdir / "edit_build", hidden=3584)
    _, _, sched = qwen_image_core()
    with torch.device(device):  # 20B parameters: created where they run
        parts["transformer"] = QwenImageTransformer2DModel(num_layers=layers or 60,
                                                           zero_cond_t=zero_cond_t).to(torch.bfloat16)
    from diffusers import AutoencoderKLQwenImage

    parts.update(vae=AutoencoderKLQwenImage(), scheduler=sched,
                 processor=QwenVLProcessor(Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=12845056),
                                           parts["tokenizer"]))
    return EditPipelineParts(parts)


class Qwen21PipelineParts(EditPipelineParts):
    """A QwenImage21Pipeline's components, saved in the released layout (`processor/`)."""

    def save_pretrained(self, out_dir: str, safe_serialization: bool = True) -> None:
        from pixrl.models.qwen_image21_parts import save_pipeline

        save_pipeline(self.parts, Path(out_dir))


def qwen_image21_pipeline(layers: int | None, device: str, workdir: Path):
    """Qwen-Image-2.1's DiT (the diffusers defaults: 32 single-stream blocks of 32×128, 64 latent
    channels; `--layers N` of them) and 16× RGBA VAE (defaults), Qwen3-VL at the width the DiT reads
    (4096) with 2 layers and a one-block vision tower."""
    import torch
    from diffusers import AutoencoderKLQwenImage21, QwenImage21Transformer2DModel

    from pixrl.models.qwen_image21_parts import qwen3_vl_text_encoder, tiny_parts

    parts = tiny_parts(workdir / "q21_build")
    parts["text_encoder"] = qwen3_vl_text_encoder(parts["processor"].tokenizer, hidden=4096, layers=2)
    with torch.device(device):  # created where they run
        parts["transformer"] = QwenImage21Transformer2DModel(num_layers=layers or 32).to(torch.bfloat16)
    parts["vae"] = AutoencoderKLQwenImage21()
    return Qwen21PipelineParts(parts)
