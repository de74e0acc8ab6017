"""Family name → implementation. A new family registers itself with @register_family."""

from __future__ import annotations

from ..config.registry import Registry, UnknownNameError


def _builtin() -> None:
    from . import (cosmos2, cosmos2_v2w, cosmos25, flux, flux2, flux2_klein, flux_kontext, hunyuan_image, hunyuan_video, hunyuan_video15, hunyuan_video15_i2v,  # noqa: F401
                   cogvideox, cogvideox_i2v, glm_image, glm_image_ar, janus, ltx2, ltx2_i2v, ltx_video, ltx_video_i2v, lumina2, mochi, pixart_sigma, qwen_image, qwen_image21, qwen_image_edit, qwen_image_edit_plus, sana, sd3, sd15, sdxl, skyreels_i2v, wan, wan_i2v, wan_ti2v, z_image)  # (register each by its name)


FAMILIES: Registry[type] = Registry("model family", "families", _builtin)
register_family = FAMILIES.register
get_family = FAMILIES.get
registered_families = FAMILIES.names
UnknownFamilyError = UnknownNameError


def family_of_directory(path) -> str | None:
    """The registered family whose on-disk layout `path` holds — the pipeline class a diffusers
    directory's model_index.json names, or the model class a transformers config.json lists — or
    None when no family's matches."""
    import json
    from pathlib import Path

    p = Path(path)
    if (p / "model_index.json").is_file():
        names = [json.loads((p / "model_index.json").read_text()).get("_class_name")]
    elif (p / "config.json").is_file():
        names = json.loads((p / "config.json").read_text()).get("architectures") or []
    else:
        return None
    for family in registered_families():
        if get_family(family).pipeline_class in names:
            return family
    return None


def image_taking_families() -> str:
    """The registered families that take a source image with a prompt (editing, image-to-video),
    comma-separated: what an error about an image dataset on a text-only family points to."""
    return ", ".join(n for n in registered_families() if getattr(get_family(n), "takes_images", False))
