"""Relation-flipped twins for pretraining: the same scene with its two shapes' places exchanged under
the flipped caption, sharing t and noise with its scene, so that the loss can only be lowered by
reading the relation word (the shapes world's text path is otherwise a bag of words)."""

import json
from pathlib import Path

import pytest
import torch
from conftest import TINY_SPEC

from pixrl.datasets.shapes.judge import judge
from pixrl.datasets.shapes.prompts import flip_relation, split_prompts
from pixrl.models.mini.build import MiniSpec
from pixrl.models.mini.pretrain import (
    PretrainConfig,
    SceneStream,
    _twin_noise,
    pretrain,
)


def test_flip_relation_swaps_the_relation_word_only():
    meta = next(p for p in split_prompts()["train"] if p.get("relation") == "left of")
    flipped = flip_relation(meta)
    assert flipped["relation"] == "right of" and flipped["objects"] == meta["objects"]
    assert flipped["prompt"] == meta["prompt"].replace("left of", "right of")
    assert flip_relation(flipped)["prompt"] == meta["prompt"]
    single = next(p for p in split_prompts()["train"] if not p.get("relation"))
    with pytest.raises(ValueError, match="no relation"):
        flip_relation(single)


def test_twin_batches_render_each_scene_and_its_mirror_from_train_only():
    stream = SceneStream(0)
    train = {p["prompt"] for p in split_prompts()["train"]}
    assert {p["relation"] for p in stream.twinnable} == {"left of", "right of", "above", "below"}
    x, captions, metas = stream.twin_batch(6)
    assert x.shape == (12, 3, 32, 32) and set(captions) <= train
    images = ((x.permute(0, 2, 3, 1) + 1) * 127.5).round().byte().numpy()
    for k in range(6):
        scene, twin = metas[k], metas[k + 6]
        assert twin == flip_relation(scene)
        # each image is right for its own caption and wrong for its twin's
        assert judge(images[k], scene)["correct"] == judge(images[k + 6], twin)["correct"] == 1.0
        assert judge(images[k], twin)["correct"] == judge(images[k + 6], scene)["correct"] == 0.0
        # same shapes, colours and sizes: the twin has the same pixels per colour, in other places
        assert sorted(images[k].reshape(-1, 3).tolist()) == sorted(images[k + 6].reshape(-1, 3).tolist())


def test_twins_share_their_scene_noise_level_and_noise():
    t, eps = _twin_noise(10, 3, (4, 8, 8), torch.Generator().manual_seed(0))
    assert t.shape == (10,) and eps.shape == (10, 4, 8, 8)
    assert torch.equal(t[4:7], t[7:10]) and torch.equal(eps[4:7], eps[7:10])
    assert len(set(t[:7].tolist())) == 7  # the rest are independent draws
    t0, eps0 = _twin_noise(5, 0, (4, 8, 8), torch.Generator().manual_seed(0))
    assert t0.shape == (5,) and eps0.shape == (5, 4, 8, 8)


def test_pretrain_trains_on_twin_pairs_when_asked(tmp_path, monkeypatch):
    spec = MiniSpec(**{**TINY_SPEC, "image_size": 32, "vae_channels": (8, 16, 16)})
    cfg = PretrainConfig(vae_steps=2, denoiser_steps=2, batch_size=8, warmup_steps=1, save_every_steps=10**6,
                         relation_twins=0.5, threads=1)
    calls: list[int] = []
    real = SceneStream.twin_batch

    def counted(self, n_pairs):
        calls.append(n_pairs)
        return real(self, n_pairs)

    monkeypatch.setattr(SceneStream, "twin_batch", counted)  # the real batches, counted
    threads = torch.get_num_threads()
    out = pretrain(tmp_path / "mini", cfg, spec, log=lambda rec: None)
    assert calls == [2, 2]  # 0.5 of a batch of 8 = 2 pairs per step
    assert torch.get_num_threads() == threads  # pretrain(threads=1) gave the caller's setting back
    assert json.loads((Path(out) / "pixrl_pretrain.json").read_text())["config"]["relation_twins"] == 0.5
