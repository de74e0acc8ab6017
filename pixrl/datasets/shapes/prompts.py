"""GenEval-style prompts for the shapes world: templates, a parser for the template language,
and train / held-out splits whose compositions are disjoint.

Every prompt carries structured metadata (what the judge checks):
``{"category", "objects": [{"shape", "color" | None, "count"}], "relation": str | None}``.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ...errors import ExpectedError
from ..registry import register_prompt_parser
from .scene import COLORS, NUMBER_WORDS, RELATIONS, SHAPES

CATEGORIES = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
_WORD_NUMBERS = {"a": 1, "an": 1, **{w: n for n, w in NUMBER_WORDS.items()}}
_REL_PHRASES = {"to the left of": "left of", "left of": "left of", "to the right of": "right of",
                "right of": "right of", "above": "above", "below": "below"}
_REL_TEXT = {"left of": "to the left of", "right of": "to the right of", "above": "above", "below": "below"}


class PromptError(ExpectedError, ValueError):
    """A prompt outside the shapes template language."""


def _phrase(count: int, color: str | None, shape: str) -> str:
    word = "a" if count == 1 else NUMBER_WORDS[count]
    noun = shape if count == 1 else shape + "s"
    return f"{word} {color + ' ' if color else ''}{noun}"


def text_of(meta: dict) -> str:
    """Canonical prompt text for metadata."""
    parts = [_phrase(o["count"], o.get("color"), o["shape"]) for o in meta["objects"]]
    if meta.get("relation"):
        return f"{parts[0]} {_REL_TEXT[meta['relation']]} {parts[1]}"
    return " and ".join(parts)


_FLIPPED = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}


def flip_relation(meta: dict) -> dict:
    """The same two objects under the opposite relation ("left of" <-> "right of", "above" <->
    "below"): what a scene with the two objects' places exchanged shows."""
    if not meta.get("relation"):
        raise ValueError(f"prompt {meta.get('prompt')!r} has no relation to flip")
    out = {**meta, "relation": _FLIPPED[meta["relation"]]}
    out["prompt"] = text_of(out)
    return out


def _parse_phrase(words: list[str], text: str) -> dict:
    if not words:
        raise PromptError(f"empty object phrase in {text!r}")
    count = _WORD_NUMBERS.get(words[0])
    if count is None:
        raise PromptError(f"{text!r}: expected a count word ({', '.join(_WORD_NUMBERS)}) before "
                          f"{' '.join(words)!r}")
    rest = words[1:]
    color = rest[0] if rest and rest[0] in COLORS else None
    if color:
        rest = rest[1:]
    if len(rest) != 1:
        raise PromptError(f"{text!r}: expected '[colour] shape' after the count, got {' '.join(words[1:])!r}")
    noun = rest[0]
    shape = noun[:-1] if count > 1 and noun.endswith("s") else noun
    if shape not in SHAPES:
        raise PromptError(f"{text!r}: unknown shape {noun!r}; the shapes are {', '.join(SHAPES)}")
    return {"shape": shape, "color": color, "count": count}


def parse(text: str) -> dict:
    """Metadata for a free-form prompt in the template language, e.g. 'two yellow squares' or
    'a blue circle above a red triangle'. Raises PromptError naming what is not understood."""
    clean = re.sub(r"\s+", " ", text.strip().lower().rstrip("."))
    for phrase, rel in sorted(_REL_PHRASES.items(), key=lambda kv: -len(kv[0])):
        if f" {phrase} " in f" {clean} ":
            left, right = clean.split(f" {phrase} ", 1)
            objs = [_parse_phrase(left.split(), text), _parse_phrase(right.split(), text)]
            if any(o["count"] != 1 for o in objs):
                raise PromptError(f"{text!r}: relations take single objects ('a ... {phrase} a ...')")
            return {"category": "position", "objects": objs, "relation": rel}
    objs = [_parse_phrase(p.split(), text) for p in clean.split(" and ")]
    return {"category": _category(objs), "objects": objs, "relation": None}


#: shapes a scene holds at most (the 2×2 placement grid)
MAX_SHAPES = 4


def _category(objs: list[dict]) -> str:
    if sum(o["count"] for o in objs) > MAX_SHAPES:
        raise PromptError(f"{sum(o['count'] for o in objs)} shapes do not fit the world's {MAX_SHAPES} places")
    if len(objs) == 1:
        o = objs[0]
        if o["count"] > 1:
            return "counting"  # "three triangles", "two red circles"
        return "colors" if o["color"] else "single_object"
    if len(objs) == 2:
        if all(o["count"] == 1 for o in objs) and all(o["color"] for o in objs):
            return "color_attr"
        return "two_object"  # "a circle and a square", "two circles and a square"
    raise PromptError(f"unsupported composition: {objs}")


#: the count pairs of a two-object prompt (first, second), at most MAX_SHAPES shapes in all
_TWO_OBJECT_COUNTS = tuple((a, b) for a in range(1, MAX_SHAPES) for b in range(1, MAX_SHAPES) if a + b <= MAX_SHAPES)


def all_prompts() -> list[dict]:
    """Every templated prompt of the six categories (metadata dicts, text under 'prompt').

    The grammar crosses colour with count ("two red circles": counting) and with position ("a
    red circle to the left of a blue square"), and count with two objects ("two circles and a
    square"), so that held-out prompts can ask for combinations train never shows (see
    `split_prompts`)."""
    def obj(shape, color=None, count=1):
        return {"shape": shape, "color": color, "count": count}

    metas: list[dict] = []
    for s in SHAPES:
        metas.append({"objects": [obj(s)], "relation": None})
    for s1, s2 in itertools.permutations(SHAPES, 2):
        for n1, n2 in _TWO_OBJECT_COUNTS:
            metas.append({"objects": [obj(s1, count=n1), obj(s2, count=n2)], "relation": None})
    for n in (2, 3, 4):
        for c in (None, *COLORS):
            for s in SHAPES:
                metas.append({"objects": [obj(s, c, n)], "relation": None})
    for c in COLORS:
        for s in SHAPES:
            metas.append({"objects": [obj(s, c)], "relation": None})
    for rel in RELATIONS:
        for s1, s2 in itertools.permutations(SHAPES, 2):
            metas.append({"objects": [obj(s1), obj(s2)], "relation": rel})
            for c1, c2 in itertools.permutations(COLORS, 2):
                metas.append({"objects": [obj(s1, c1), obj(s2, c2)], "relation": rel})
    for (c1, c2) in itertools.permutations(COLORS, 2):
        for (s1, s2) in itertools.permutations(SHAPES, 2):
            metas.append({"objects": [obj(s1, c1), obj(s2, c2)], "relation": None})
    out = []
    for m in metas:
        m["category"] = _category(m["objects"]) if not m["relation"] else "position"
        out.append({"prompt": text_of(m), **m})
    return out


def composition_key(meta: dict) -> str:
    """Order-free identity of a composition (so 'a X and a Y' == 'a Y and a X')."""
    objs = sorted(json.dumps(o, sort_keys=True) for o in meta["objects"])
    if meta.get("relation"):  # relations are ordered; 'A left of B' == 'B right of A'
        flip = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
        a, b = (json.dumps(o, sort_keys=True) for o in meta["objects"])
        key_ab, key_ba = f"{a}|{meta['relation']}|{b}", f"{b}|{flip[meta['relation']]}|{a}"
        return min(key_ab, key_ba)
    return "+".join(objs)


_AXIS = {"left of": "horizontal", "right of": "horizontal", "above": "vertical", "below": "vertical"}
_SIDES = {"left of": ("left", "right"), "right of": ("right", "left"), "above": ("top", "bottom"),
          "below": ("bottom", "top")}


def holdout_group(meta: dict) -> str:
    """The unit a split holds out. A composition, except for relations: both orders of a pair on
    one axis go together ('circle left of triangle' with 'triangle left of circle'). Holding out
    one order while training the other would reward a pair-specific layout on train prompts that
    fails the held-out prompt by construction; held out together, only the relation itself
    transfers to them."""
    if meta.get("relation"):
        pair = "+".join(sorted(json.dumps(o, sort_keys=True) for o in meta["objects"]))
        return f"position:{pair}:{_AXIS[meta['relation']]}"
    return composition_key(meta)


def missing_primitives(train: list[dict]) -> list[str]:
    """Primitives a held-out prompt may need that the train prompts never show: a shape on a
    side of an axis, a colour with fewer than 2 shapes (or a shape with fewer than 2 colours),
    a count, or a word. A split must not hold out the only examples of a primitive."""
    missing: list[str] = []
    sides = {(o["shape"], side) for m in train if m.get("relation")
             for o, side in zip(m["objects"], _SIDES[m["relation"]])}
    missing += [f"{s} on the {side}" for s in SHAPES for side in ("left", "right", "top", "bottom")
                if (s, side) not in sides]
    pairs = {(o["color"], o["shape"]) for m in train for o in m["objects"] if o.get("color")}
    missing += [f"{c} with 2 shapes" for c in COLORS if len({s for cc, s in pairs if cc == c}) < 2]
    missing += [f"{s} in 2 colours" for s in SHAPES if len({c for c, ss in pairs if ss == s}) < 2]
    counts = {o["count"] for m in train for o in m["objects"]}
    missing += [f"count {n}" for n in NUMBER_WORDS if n not in counts]
    coloured_counts = {o["count"] for m in train for o in m["objects"] if o.get("color") and o["count"] > 1}
    missing += [f"count {n} of a coloured shape" for n in (2, 3, 4) if n not in coloured_counts]
    related = {o.get("color") for m in train if m.get("relation") for o in m["objects"]}
    missing += [f"{c} in a relation" for c in COLORS if c not in related]
    multi = {o["shape"] for m in train if len(m["objects"]) == 2 for o in m["objects"] if o["count"] > 1}
    missing += [f"several {s}s beside another shape" for s in SHAPES if s not in multi]
    words = {w for m in train for w in m["prompt"].split()}
    missing += [f"word {w!r}" for w in sorted({w for m in all_prompts() for w in m["prompt"].split()} - words)]
    return missing


#: every category but single-object holds out at least this many compositions (hold-out groups),
#: so that a category's held-out accuracy does not move with one composition
MIN_HELDOUT = 6


def split_prompts(seed: int = 0, heldout_fraction: float = 0.25) -> dict[str, list[dict]]:
    """Train / held-out split over hold-out groups (see `holdout_group`), per category.

    Groups are drawn in a seeded order; a group is held out only if train keeps every primitive
    (`missing_primitives`), until the category's share — at least MIN_HELDOUT groups — is
    reached. single_object (3 prompts) stays in train: holding one out would remove a shape word
    from training."""
    rng = np.random.default_rng(seed)
    prompts = all_prompts()
    held_groups: set[str] = set()
    for cat in CATEGORIES:
        groups = sorted({holdout_group(p) for p in prompts if p["category"] == cat})
        n_held = 0 if cat == "single_object" else max(MIN_HELDOUT, round(heldout_fraction * len(groups)))
        chosen = 0
        for g in rng.permutation(groups).tolist():
            if chosen == n_held:
                break
            trial = held_groups | {g}
            if not missing_primitives([p for p in prompts if holdout_group(p) not in trial]):
                held_groups, chosen = trial, chosen + 1
    train = [p for p in prompts if holdout_group(p) not in held_groups]
    held = [p for p in prompts if holdout_group(p) in held_groups]
    return {"train": train, "heldout": held}


PROMPT_SCHEMA = pa.schema([
    pa.field("prompt_id", pa.string()), pa.field("prompt", pa.string()),
    pa.field("category", pa.string()), pa.field("meta", pa.string()),
])


def write_prompt_files(out_dir: Path, seed: int = 0) -> dict[str, Path]:
    """Write prompts_<split>.parquet (prompt_id, prompt, category, meta JSON)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, rows in split_prompts(seed).items():
        table = pa.Table.from_pylist([
            {"prompt_id": f"{split}-{i:04d}", "prompt": r["prompt"], "category": r["category"],
             "meta": json.dumps({k: r[k] for k in ("category", "objects", "relation")})}
            for i, r in enumerate(rows)], schema=PROMPT_SCHEMA)
        paths[split] = out_dir / f"prompts_{split}.parquet"
        pq.write_table(table, paths[split])
    return paths


@register_prompt_parser("shapes")
def metadata(text: str) -> dict:
    """Shapes metadata when the text is in the template language; {} otherwise (a free-form
    prompt in a shapes prompt file is then refused by the shapes reward, naming it)."""
    try:
        return parse(text)
    except PromptError:
        return {}
