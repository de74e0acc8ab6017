"""The reward service's wire format: JSON with each image (or clip) as base64 of its PNG (MP4)
bytes — or of an .npz of its uint8 array — the prompts and their metadata. Both are lossless,
so the served scorer sees the exact pixels the in-process one would. flow_grpo's servers take
pickles (JPEG bytes inside), and unpickling runs code from the sender: the service accepts that
format only when started with `--accept-pickle`, and then unpickles plain data and numpy arrays
only."""

from __future__ import annotations

import base64
import pickle

import numpy as np

from ..artifacts.media import decode_media, media_bytes


def encode_batch(images: np.ndarray, prompts: list[str], metadata: list[dict], payload: str = "png") -> dict:
    """`payload`: "png" (each image a PNG, each clip a lossless MP4) or "npz" (each sample its raw
    uint8 array in an uncompressed .npz: no encode cost, larger bodies). Both are lossless."""
    if payload not in ("png", "npz"):
        raise ValueError(f"payload {payload!r}: choose png or npz")
    blob = media_bytes if payload == "png" else _npz_bytes
    return {"images": [base64.b64encode(blob(np.asarray(im, np.uint8))).decode("ascii") for im in images],
            "prompts": list(prompts), "metadata": [encode_metadata(m) for m in metadata]}


BYTES_KEY = "$base64"  # a metadata value that is bytes (an editing prompt's source_image) travels as {BYTES_KEY: …}


def encode_metadata(meta: dict) -> dict:
    """A sample's metadata as JSON can carry it: bytes values as {"$base64": …}."""
    return {k: {BYTES_KEY: base64.b64encode(v).decode("ascii")} if isinstance(v, (bytes, bytearray)) else v
            for k, v in meta.items()}


def decode_metadata(meta: dict) -> dict:
    """`encode_metadata` undone: what the in-process scorer would have been given."""
    return {k: base64.b64decode(v[BYTES_KEY]) if isinstance(v, dict) and set(v) == {BYTES_KEY} else v
            for k, v in meta.items()}


def _npz_bytes(sample: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    np.savez(buf, sample=sample)
    return buf.getvalue()


def _npz_sample(data: bytes) -> np.ndarray:
    """One uint8 image [H, W, 3] or clip [F, H, W, 3] from an .npz holding exactly that array
    (allow_pickle off: an object array is refused, not unpickled)."""
    import io

    with np.load(io.BytesIO(data), allow_pickle=False) as f:
        if len(f.files) != 1:
            raise ValueError(f"an .npz sample holds one array, not {len(f.files)} ({', '.join(f.files)})")
        arr = f[f.files[0]]
    if arr.dtype != np.uint8 or arr.ndim not in (3, 4) or arr.shape[-1] != 3:
        raise ValueError(f"an .npz sample must be uint8 [H, W, 3] or [F, H, W, 3], not {arr.dtype} {list(arr.shape)}")
    return arr


def decode_images(encoded: list[str]) -> np.ndarray:
    """base64 PNG/MP4 strings → uint8 [B, H, W, 3] (or clips [B, F, H, W, 3]); ValueError naming
    the first bad item."""
    out = []
    for i, s in enumerate(encoded):
        try:
            raw = base64.b64decode(s, validate=True)
            out.append(_npz_sample(raw) if raw[:4] == b"PK\x03\x04" else decode_media(raw))
        except Exception as exc:  # binascii, numpy, PIL and PyAV raise many types
            raise ValueError(f"images[{i}] is not a base64 PNG/MP4/NPZ sample: {exc}") from None
    return _stack(out)


def _stack(samples: list[np.ndarray]) -> np.ndarray:
    shapes = {im.shape for im in samples}
    if len(shapes) > 1:
        raise ValueError(f"images of different shapes in one request: {sorted(shapes)}")
    return np.stack(samples)


# --- flow_grpo's wire format (`pixrl reward-serve --accept-pickle` only) ---------------------
#: what a flow_grpo client's pickle may name: numpy arrays (its prompt batches are arrays of str)
_PICKLE_GLOBALS = {("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "_reconstruct"),
                   ("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "scalar"),
                   ("numpy._core.multiarray", "scalar"), ("_codecs", "encode")}


class _PlainDataUnpickler(pickle.Unpickler):
    """Unpickles plain data and numpy arrays only: any other global (the way a pickle runs code)
    is refused before it is looked up."""

    def find_class(self, module: str, name: str):
        if (module, name) in _PICKLE_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"the pickled request names {module}.{name}; only plain data and numpy arrays "
                                     f"are accepted")


def restricted_loads(data: bytes):
    """Unpickle plain data and numpy arrays only (a pickle naming any other global is refused)."""
    import io

    return _PlainDataUnpickler(io.BytesIO(data)).load()


def decode_pickled_request(body: bytes) -> tuple[np.ndarray, list[str], list[dict]]:
    """flow_grpo's reward-server request — a pickled dict with "images" (JPEG or PNG bytes per
    sample), "prompts" and "meta_datas" (both optional) — as (uint8 images, prompts, metadata);
    ValueError naming what is wrong."""
    try:
        data = restricted_loads(body)
    except Exception as exc:  # UnpicklingError, EOFError, … on a bad body
        raise ValueError(f"not an acceptable pickled request: {exc}") from None
    if not isinstance(data, dict) or "images" not in data:
        raise ValueError("a pickled request is a dict with 'images' (JPEG/PNG bytes per sample)")
    blobs = list(data["images"])
    if not blobs or not all(isinstance(b, (bytes, bytearray)) for b in blobs):
        raise ValueError("'images' must be a non-empty list of JPEG/PNG bytes")
    images = []
    for i, b in enumerate(blobs):
        try:
            images.append(decode_media(bytes(b)))  # PIL: JPEG and PNG alike
        except Exception as exc:
            raise ValueError(f"images[{i}] is not a JPEG/PNG: {exc}") from None
    images = _stack(images)
    n = len(images)
    prompts = [str(p) for p in data.get("prompts", [""] * n)]
    metas = data.get("meta_datas", data.get("metadata")) or [{}] * n
    metas = [dict(m) if isinstance(m, dict) else {} for m in metas]
    if not len(prompts) == len(metas) == n:
        raise ValueError(f"{n} images, {len(prompts)} prompts, {len(metas)} meta_datas: one of each per image")
    return images, prompts, metas


def encode_pickled_response(scores: dict[str, np.ndarray]) -> bytes:
    """What a flow_grpo client reads back: the weighted total as "scores" (and "outputs", the key
    its remote scorers read), every component under "components"."""
    total = np.asarray(scores["reward"], np.float32).tolist()
    return pickle.dumps({"scores": total, "outputs": total,
                         "components": {k: np.asarray(v, np.float32).tolist() for k, v in scores.items()}})
