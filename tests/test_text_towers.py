"""CLIP pretraining of the miniature's text encoders: the loss against the InfoNCE formula,
hard-negative twins from the train split only, and a pretrain that freezes the CLIP-trained
encoders during the denoiser phase (real transformers/diffusers classes, tiny sizes)."""

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from conftest import TINY_SPEC
from pixrl.datasets.shapes.prompts import composition_key, split_prompts
from pixrl.models.mini.build import MiniSpec
from pixrl.models.mini.pretrain import PretrainConfig, SceneStream, pretrain
from pixrl.models.mini.text_towers import HardNegativeBatches, clip_loss


def test_clip_loss_is_symmetric_infonce_with_shared_positives():
    g = torch.Generator().manual_seed(0)
    t, v = torch.randn(5, 8, generator=g), torch.randn(5, 8, generator=g)
    scale = torch.tensor(2.0)
    logits = scale.exp() * F.normalize(t, dim=-1) @ F.normalize(v, dim=-1).T
    want = 0.5 * (F.cross_entropy(logits, torch.arange(5)) + F.cross_entropy(logits.T, torch.arange(5)))
    assert torch.allclose(clip_loss(t, v, list("abcde"), scale), want, atol=1e-6)
    # items 0 and 1 share a composition: each row's target is split evenly between them
    keys = ["a", "a", "c", "d", "e"]
    target = torch.eye(5)
    target[0, :2] = target[1, :2] = 0.5
    want = 0.5 * (-(target * logits.log_softmax(1)).sum(1).mean() - (target * logits.T.log_softmax(1)).sum(1).mean())
    assert torch.allclose(clip_loss(t, v, keys, scale), want, atol=1e-6)


def test_hard_negative_twins_come_from_train_and_flip_relations():
    stream = SceneStream(0)
    batches = HardNegativeBatches(stream, seed=0)
    held = {composition_key(p) for p in split_prompts()["heldout"]}
    twins = batches.twins[composition_key({"objects": [{"shape": "circle", "color": None, "count": 1},
                                                       {"shape": "square", "color": None, "count": 1}],
                                           "relation": "left of"})]
    texts = {p["prompt"] for p in twins}
    assert "a circle to the right of a square" in texts and "a circle above a square" in texts
    assert all(composition_key(p) not in held for tw in batches.twins.values() for p in tw)
    x, captions, keys = batches.batch(16)
    assert x.shape == (16, 3, 32, 32) and len(captions) == len(keys) == 16
    assert not {k for k in keys} & held


def test_pretrain_with_text_steps_freezes_the_clip_trained_encoders(tmp_path, monkeypatch):
    spec = MiniSpec(**{**TINY_SPEC, "image_size": 32, "vae_channels": (8, 16, 16)})
    cfg = PretrainConfig(vae_steps=2, denoiser_steps=3, batch_size=8, warmup_steps=1, save_every_steps=10**6,
                         text_steps=4, text_batch_size=8, threads=1)
    logs: list[dict] = []
    snap: dict = {}

    def log(rec: dict) -> None:
        logs.append(rec)

    import pixrl.models.mini.pretrain as pt
    real = pt.train_text_towers

    def spy(pipe, *a, **k):
        before = {n: p.detach().clone() for n, p in pipe.text_encoder.named_parameters()}
        real(pipe, *a, **k)
        snap.update({n: p.detach().clone() for n, p in pipe.text_encoder.named_parameters()})
        assert any(not torch.equal(before[n], snap[n]) for n in before)  # the CLIP phase trained them

    monkeypatch.setattr(pt, "train_text_towers", spy)  # the real phase, with snapshots around it
    out = pretrain(tmp_path / "mini", cfg, spec, log=log)
    saved = load_file(str(Path(out) / "text_encoder" / "model.safetensors"))
    for name, value in snap.items():  # unchanged by the denoiser phase
        assert torch.equal(saved[name], value), name
    text_logs = [r for r in logs if r.get("phase") == "text"]
    assert text_logs and all(len(r["relation_retrieval"]) == 2 for r in text_logs)
    assert json.loads((Path(out) / "pixrl_pretrain.json").read_text())["config"]["text_steps"] == 4
