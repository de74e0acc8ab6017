"""The shapes world: renderer determinism, prompt language, disjoint splits, judge accuracy."""

import numpy as np
import pytest
from scipy import ndimage

from pixrl.datasets.shapes.judge import judge
from pixrl.datasets.shapes.prompts import (CATEGORIES, MIN_HELDOUT, PromptError, all_prompts, composition_key,
                                           holdout_group, missing_primitives, parse, split_prompts, text_of)
from pixrl.datasets.shapes.render import render_prompt


def _perturb(img: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Mild blur (σ 0.5 px), Gaussian pixel noise (σ 8) and a ±1 px translation."""
    x = ndimage.gaussian_filter(img.astype(np.float32), sigma=(0.5, 0.5, 0))
    x = x + rng.normal(0, 8, x.shape)
    dy, dx = (int(v) for v in rng.integers(-1, 2, size=2))
    x = ndimage.shift(x, (dy, dx, 0), order=0, mode="constant", cval=255)
    return np.clip(x, 0, 255).astype(np.uint8)


def test_render_is_deterministic_and_sized():
    meta = parse("two yellow squares")
    a, b = render_prompt(meta, seed=3), render_prompt(meta, seed=3)
    assert a.shape == (32, 32, 3) and a.dtype == np.uint8
    assert np.array_equal(a, b)
    assert not np.array_equal(a, render_prompt(meta, seed=4))


def test_prompts_cover_six_categories_and_parse_back():
    prompts = all_prompts()
    assert {p["category"] for p in prompts} == set(CATEGORIES)
    for p in prompts:
        m = parse(p["prompt"])
        assert (m["category"], m["objects"], m["relation"]) == (p["category"], p["objects"], p["relation"])
        assert text_of(m) == p["prompt"]
    m = parse("a blue circle above a red triangle")
    assert m["relation"] == "above" and m["objects"][0] == {"shape": "circle", "color": "blue", "count": 1}


@pytest.mark.parametrize("bad", ["a purple circle", "five squares", "a circle near a square", "",
                                 "four circles and a square", "two circles to the left of a square"])
def test_parse_rejects_text_outside_the_language(bad):
    with pytest.raises(PromptError):
        parse(bad)


def test_heldout_compositions_never_occur_in_train():
    split = split_prompts()
    train = {composition_key(p) for p in split["train"]}
    held = {composition_key(p) for p in split["heldout"]}
    assert held and not (train & held)
    assert {p["category"] for p in split["heldout"]} == set(CATEGORIES) - {"single_object"}
    words = lambda ps: {w for p in ps for w in p["prompt"].split()}  # noqa: E731
    assert words(split["heldout"]) <= words(split["train"])


def test_the_grammar_crosses_colour_with_count_and_position_and_count_with_two_objects():
    texts = {p["prompt"]: p["category"] for p in all_prompts()}
    assert texts["two red circles"] == "counting" and texts["four yellow triangles"] == "counting"
    assert texts["a red circle to the left of a blue square"] == "position"
    assert texts["two circles and a square"] == "two_object" and texts["a triangle and three squares"] == "two_object"
    assert parse("three blue squares")["objects"] == [{"shape": "square", "color": "blue", "count": 3}]


def test_every_category_but_single_object_holds_out_six_compositions_disjoint_from_train():
    """Held out are whole compositions (hold-out groups), ≥ MIN_HELDOUT per category, among them
    combinations train never shows: a coloured count, a coloured relation, counts beside another shape."""
    split = split_prompts()
    train = {holdout_group(p) for p in split["train"]}
    for cat in CATEGORIES:
        held = {holdout_group(p) for p in split["heldout"] if p["category"] == cat}
        assert not (held & train)
        assert len(held) >= (0 if cat == "single_object" else MIN_HELDOUT), (cat, len(held))
    held = split["heldout"]
    assert any(p["category"] == "counting" and p["objects"][0]["color"] for p in held)
    assert any(p["category"] == "position" and p["objects"][0]["color"] for p in held)
    assert any(p["category"] == "two_object" and max(o["count"] for o in p["objects"]) > 1 for p in held)
    assert missing_primitives(split["train"]) == []


def test_split_holds_relations_out_in_both_orders_and_keeps_every_primitive_in_train():
    split = split_prompts()
    assert missing_primitives(split["train"]) == []
    held_position = [p for p in split["heldout"] if p["relation"]]
    assert held_position
    train_groups = {holdout_group(p) for p in split["train"]}
    for p in held_position:  # the reverse order of a held-out relation is never trained
        a, b = (o["shape"] for o in p["objects"])
        flipped = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
        reverse = {"objects": [dict(p["objects"][1]), dict(p["objects"][0])], "relation": p["relation"]}
        assert text_of(reverse) in {q["prompt"] for q in split["heldout"]}, (a, b)
        assert holdout_group(p) not in train_groups
        assert holdout_group({**p, "relation": flipped[p["relation"]]}) == holdout_group(p)
    # the coverage check names what a split would lose
    no_circle_left = [p for p in split["train"]
                      if not (p["relation"] in ("left of", "right of") and "circle" in p["prompt"])]
    assert "circle on the left" in missing_primitives(no_circle_left)
    only_yellow_triangle = [p for p in split["train"] if not any(
        o.get("color") == "yellow" and o["shape"] != "triangle" for o in p["objects"])]
    assert "yellow with 2 shapes" in missing_primitives(only_yellow_triangle)


def _accuracy(perturb: bool, n: int = 1200) -> tuple[float, dict]:
    rng = np.random.default_rng(0)
    prompts = all_prompts()
    per: dict[str, list[float]] = {}
    for i in range(n):
        p = prompts[i % len(prompts)]
        img = render_prompt(p, seed=i)
        if perturb:
            img = _perturb(img, rng)
        per.setdefault(p["category"], []).append(judge(img, p)["correct"])
    allv = [v for vs in per.values() for v in vs]
    return float(np.mean(allv)), {k: float(np.mean(v)) for k, v in per.items()}


def test_judge_on_clean_renders():
    acc, per = _accuracy(perturb=False)
    assert acc >= 0.99, per


def test_judge_on_perturbed_renders():
    acc, per = _accuracy(perturb=True)
    assert acc >= 0.95, per


def test_judge_rejects_wrong_images():
    meta = parse("a red circle to the left of a blue square")
    flipped = parse("a red circle to the right of a blue square")
    wrong_color = parse("a green circle to the left of a blue square")
    hits = {"ok": 0, "flipped": 0, "color": 0}
    for s in range(50):
        img = render_prompt(meta, seed=s)
        hits["ok"] += judge(img, meta)["correct"]
        hits["flipped"] += judge(img, flipped)["correct"]
        hits["color"] += judge(img, wrong_color)["correct"]
    assert hits == {"ok": 50, "flipped": 0, "color": 0}
    blank = np.full((32, 32, 3), 255, np.uint8)
    r = judge(blank, meta)
    assert r["correct"] == 0 and r["partial"] == 0
