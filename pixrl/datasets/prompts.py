"""Prompt sets users bring, the format detected from the path: parquet or a Lance dataset (prompt
[, prompt_id, meta JSON, image bytes]), JSON lines (one object per line with "prompt"; its other
fields are the metadata — GenEval's `evaluation_metadata.jsonl` loads as is, its "tag" as the
category), or text (one prompt per line, e.g. OCR prompts with the text to render in quotes).
Errors name the file and line.

An editing prompt set gives each prompt a source image (models/source_images.py): a parquet or
Lance `image` column of encoded bytes (PNG, JPEG), or a JSON line's "image" — a file path,
relative to the JSONL's folder or absolute."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from ..errors import ExpectedError
from .registry import prompt_parser


class PromptSetError(ExpectedError, ValueError):
    pass


@dataclass(frozen=True)
class PromptItem:
    prompt_id: str
    prompt: str
    meta: dict
    image: bytes | None = None  # the source image an editing prompt applies to (encoded bytes)


def load_prompt_set(path: Path, dataset: str | None = None) -> list[PromptItem]:
    """Prompts with their metadata: a parquet's `meta` column, else the dataset's registered
    parser applied to the text (none registered: no metadata)."""
    parse = prompt_parser(dataset) if dataset else None
    _meta = parse or (lambda text: {})
    if not (path.is_file() or (path.suffix == ".lance" and path.is_dir())):
        raise PromptSetError(f"prompt file {str(path)!r} does not exist; set dataset.path to a parquet or "
                             f"text file of prompts")
    if path.suffix in (".parquet", ".lance"):
        t = _table_rows(path)
        if t and "prompt" not in t[0]:
            raise PromptSetError(f"{path}: a prompt table needs a 'prompt' column (has {sorted(t[0])})")
        items = [PromptItem(r.get("prompt_id") or f"p{i:05d}", r["prompt"],
                            json.loads(r["meta"]) if r.get("meta") else _meta(r["prompt"]),
                            _table_image(path, i, r.get("image")))
                 for i, r in enumerate(t)]
    elif path.suffix == ".jsonl":
        items = _jsonl_items(path, _meta)
    else:
        lines = [ln.strip() for ln in path.read_text().splitlines() if ln.strip()]
        items = [PromptItem(f"p{i:05d}", ln, _meta(ln)) for i, ln in enumerate(lines)]
    if not items:
        raise PromptSetError(f"prompt set {str(path)!r} is empty; add prompts or point dataset.path elsewhere")
    return items


def _table_rows(path: Path) -> list[dict]:
    if path.suffix == ".lance":
        import lance

        ds = lance.dataset(str(path))
        cols = [c for c in ("prompt", "prompt_id", "meta", "image") if c in ds.schema.names] or ds.schema.names
        return ds.to_table(columns=cols).to_pylist()
    return pq.read_table(path).to_pylist()


def _jsonl_items(path: Path, parse) -> list[PromptItem]:
    """One JSON object per line: "prompt", optionally "prompt_id"; every other field is metadata
    (GenEval's "tag" also becomes "category", so its categories stratify the draw)."""
    items = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptSetError(f"{path}:{n}: not a JSON object ({exc.msg} at column {exc.colno})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise PromptSetError(f"{path}:{n}: each line needs a non-empty \"prompt\" string; got {line.strip()[:80]!r}")
        meta = {k: v for k, v in row.items() if k not in ("prompt", "prompt_id", "image")} or parse(row["prompt"])
        if "tag" in meta and "category" not in meta:
            meta["category"] = meta["tag"]
        image = _image_file(path, n, row["image"]) if row.get("image") is not None else None
        items.append(PromptItem(str(row.get("prompt_id") or f"p{len(items):05d}"), row["prompt"].strip(), meta, image))
    return items


def _table_image(path: Path, row: int, value) -> bytes | None:
    """A table row's source image: encoded bytes, or a file path as a JSON line gives it."""
    if value is None or isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return _image_file(path, row + 1, value)
    raise PromptSetError(f"{path}: row {row}'s image is a {type(value).__name__}; store encoded image bytes (PNG, "
                         f"JPEG) or a file path")


def _image_file(path: Path, line: int, name) -> bytes:
    """A JSON line's source image: the bytes of the file it names (relative to the JSONL's folder)."""
    if not isinstance(name, str) or not name:
        raise PromptSetError(f"{path}:{line}: \"image\" must be a file path (relative to {path.parent} or absolute)")
    file = Path(name) if Path(name).is_absolute() else path.parent / name
    if not file.is_file():
        raise PromptSetError(f"{path}:{line}: source image {str(file)!r} does not exist; fix the \"image\" path")
    return file.read_bytes()


def select_categories(items: list[PromptItem], categories: list[str] | None) -> list[PromptItem]:
    """The prompts whose metadata category is one of `categories` (None: all). A category with no
    prompt is an error, not an empty draw, so a typo cannot silently shrink the training set."""
    if categories is None:
        return items
    if not categories:
        raise PromptSetError("dataset.categories is empty, so nothing could be trained; list categories, or set "
                             "dataset.categories=null to train on every prompt")
    have = sorted({it.meta.get("category", "") for it in items} - {""})
    missing = [c for c in categories if c not in have]
    if missing:
        raise PromptSetError(f"dataset.categories {missing} match no prompt; the prompt set has categories "
                             f"{have}" + ("" if have else " (none: its prompts carry no category metadata)")
                             + "; list some of those, or set dataset.categories=null to train on every prompt")
    wanted = set(categories)
    return [it for it in items if it.meta.get("category", "") in wanted]


def choose_prompts(items: list[PromptItem], n: int, rng: np.random.Generator) -> list[PromptItem]:
    """n prompts, distinct while the set allows. With categories in the metadata the draw is
    stratified — categories in a shuffled round-robin, a random prompt within each — so rare
    categories are trained as often as common ones and the per-iteration reward mix is stable."""
    cats = sorted({it.meta.get("category", "") for it in items})
    if len(cats) > 1:
        by_cat = {c: [it for it in items if it.meta.get("category", "") == c] for c in cats}
        order = [cats[int(i)] for i in rng.permutation(len(cats))]
        out: list[PromptItem] = []
        seen: set[str] = set()
        for slot in range(n):
            pool = by_cat[order[slot % len(order)]]
            fresh = [it for it in pool if it.prompt_id not in seen] or pool
            it = fresh[int(rng.integers(len(fresh)))]
            seen.add(it.prompt_id)
            out.append(it)
        return out
    idx = rng.choice(len(items), size=n, replace=len(items) < n)
    return [items[int(i)] for i in idx]


def split_items(dataset, split: str) -> list[PromptItem]:
    """The prompt items of a split of the configured dataset: 'train' is dataset.path, 'heldout'
    dataset.heldout_path (what evaluation judges)."""
    from ..engines.assets import resolve_asset

    if split not in ("train", "heldout"):
        raise ValueError(f"unknown split {split!r}; choose 'train' or 'heldout'")
    path = dataset.path if split == "train" else dataset.heldout_path
    if path is None:
        raise PromptSetError(f"dataset.heldout_path is not set for dataset {dataset.name!r}; point it at a held-out "
                             f"prompt file to evaluate on the held-out split")
    return load_prompt_set(resolve_asset(path), dataset.name)
