"""Source images of image-conditioned generation (instruction editing: FLUX.1 Kontext).

A prompt of an editing dataset is an instruction *and* an image. Everything that passes prompt
strings between stages, engines and caches passes a condition key instead: the prompt itself
when there is no image, else `prompt` + SEP + the image bytes' digest. The bytes travel beside
the keys (the trajectory rows keep them in `source_image`; a prompt cache is given them), so a
key always names exactly what was encoded, and two instructions on two images never share an
encoding.
"""

from __future__ import annotations

import hashlib
import io

import numpy as np

from ..errors import ExpectedError

SEP = "\x1f"  # ASCII unit separator; a prompt holding it is refused (condition_key)


class SourceImageError(ExpectedError, ValueError):
    """A source image that cannot be read, or one given to a family that takes none."""


def require_sources(family, prompts: list[str], images: list[bytes | None] | None) -> None:
    """An editing or image-to-video family's prompts each with a source image, else a
    SourceImageError saying what the family does with them and where images come from."""
    if images is None or len(images) != len(prompts) or any(im is None for im in images):
        raise SourceImageError(f"the {family.name} family {family.image_use}: every prompt needs a source image (a "
                               "dataset whose rows carry an `image`, docs/editing.md)")


def source_pixels(family, image: bytes, dtype):
    """(the picture, its pixels [1, 3, H, W] in [-1, 1]) of a source image as an image-to-video
    pipeline reads it at the family's size H×W: its video processor's resize (aspect kept,
    centre-cropped), then its preprocess, on the family's device in `dtype`."""
    h, w, proc = family.height, family.width, family.pipe.video_processor
    picture = proc.resize(decode_rgb(image), h, w, resize_mode="crop")
    return picture, proc.preprocess(picture, height=h, width=w).to(family.device, dtype)


def crop_to_aspect(pil, height: int, width: int):
    """`pil` centre-cropped to the aspect of a `height`×`width` target (the largest such box):
    the editing families that size a source from its own aspect then read it at the target's."""
    if pil.width * height > pil.height * width:  # wider than the target: trim the sides
        cw, ch = round(pil.height * width / height), pil.height
    else:
        cw, ch = pil.width, round(pil.width * height / width)
    left, top = (pil.width - cw) // 2, (pil.height - ch) // 2
    return pil.crop((left, top, left + cw, top + ch))


def digest(image: bytes) -> str:
    return hashlib.sha256(image).hexdigest()[:32]


def condition_key(prompt: str, image: bytes | None) -> str:
    if SEP in prompt:
        raise SourceImageError(f"prompt {prompt[:60]!r} holds the control character U+001F; remove it")
    return prompt if image is None else f"{prompt}{SEP}{digest(image)}"


def condition_keys(prompts: list[str], images: list[bytes | None] | None) -> list[str]:
    if images is None:
        return list(prompts)
    if len(images) != len(prompts):
        raise ValueError(f"{len(images)} source images for {len(prompts)} prompts")
    return [condition_key(p, im) for p, im in zip(prompts, images)]


def split_key(key: str) -> tuple[str, str | None]:
    """(prompt, image digest or None) of a condition key."""
    prompt, _, dig = key.partition(SEP)
    return prompt, dig or None


def image_bank(images: list[bytes | None] | None) -> dict[str, bytes]:
    """digest → bytes of the given images (None entries skipped)."""
    return {digest(im): im for im in images or () if im is not None}


def decode_rgb(image: bytes, what: str = "source image"):
    """A PIL RGB image from encoded bytes (PNG, JPEG, WebP, …), or a SourceImageError naming the problem."""
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(image))
        img.load()
    except (UnidentifiedImageError, OSError) as exc:
        raise SourceImageError(f"{what} ({len(image)} bytes) is not a readable image: {exc}; give PNG or JPEG "
                               f"bytes") from None
    return img.convert("RGB")


def png_bytes(array: np.ndarray) -> bytes:
    """uint8 [H, W, 3] → PNG bytes (tests and tiny datasets write their source images with it)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.asarray(array, np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def write_prompt_images(folder, prompts: list[str], seed: int = 0, n: int | None = None, stem: str = "source",
                        jsonl: str = "prompts.jsonl", size: int = 32):
    """A small prompt set with source images (tiny checkpoints write one beside them; tests and
    recorded runs use them): `n` random `size` px PNGs and a JSONL of
    the prompts, cycled, naming them (`jsonl`, in `folder`). Returns the JSONL's path."""
    import json
    from pathlib import Path

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(n or len(prompts)):
        name = f"{stem}_{i}.png"
        (folder / name).write_bytes(png_bytes(rng.integers(0, 256, (size, size, 3))))
        lines.append(json.dumps({"prompt": prompts[i % len(prompts)], "image": name, "prompt_id": f"e{i:03d}"}))
    path = folder / jsonl
    path.write_text("\n".join(lines) + "\n")
    return path

