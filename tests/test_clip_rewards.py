"""Model-based rewards on tiny random checkpoints written in the upstream layouts: `clip_score`
(a transformers CLIPModel directory with its processor) and `aesthetic` (that CLIP tower plus the
LAION predictor head as a released-style .pth). Real loaders, finite scores in range, the same
image twice gives the same score, a batch equals one by one, the cosine equals the one computed
from the model's own features, and bad paths fail in preflight naming the setting."""

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from pixrl.cli import app
from pixrl.rewards.aesthetic import aesthetic_head
from pixrl.rewards.compose import RewardSet


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    """A tiny CLIPModel + CLIPProcessor saved with save_pretrained, and a predictor head for it."""
    from pixrl.rewards.clip_tiny import write_tiny_clip

    out = tmp_path_factory.mktemp("clip")
    write_tiny_clip(out / "clip", seed=0)
    head = aesthetic_head(24)
    torch.save({f"layers.{k}": v for k, v in head.state_dict().items()}, str(out / "head.pth"))
    return out / "clip", out / "head.pth"


def _images(n=4, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, 48, 40, 3), dtype=np.uint8)


PROMPTS = ["a red circle", "two blue squares", "a photo of a cat", "a sign that says hello"]


def test_clip_score_is_the_models_cosine_and_batch_invariant(tiny_clip):
    from transformers import CLIPModel, CLIPProcessor

    path, _ = tiny_clip
    rs = RewardSet({"clip_score": 1.0}, {"clip_score": {"path": str(path), "batch_size": 3}})
    imgs = _images()
    out = rs.score(imgs, PROMPTS, [{}] * 4, list("abcd"))
    c = out["clip_score"]
    assert c.shape == (4,) and np.isfinite(c).all() and (np.abs(c) <= 1).all()
    assert np.allclose(out["clip_score.clipscore"], 2.5 * np.maximum(c, 0))
    model, proc = CLIPModel.from_pretrained(str(path)), CLIPProcessor.from_pretrained(str(path))
    with torch.no_grad():
        inputs = proc(text=PROMPTS, images=list(imgs), return_tensors="pt", padding=True)
        o = model(**inputs)
    ref = torch.nn.functional.cosine_similarity(o.image_embeds, o.text_embeds).numpy()
    assert np.allclose(c, ref, atol=1e-5)
    one = np.concatenate([rs.score(imgs[i:i + 1], PROMPTS[i:i + 1], [{}], ["x"])["clip_score"] for i in range(4)])
    assert np.allclose(one, c, atol=1e-5)
    assert np.array_equal(rs.score(imgs, PROMPTS, [{}] * 4, list("abcd"))["clip_score"], c)


def test_pickscore_is_the_models_own_logit_over_26_with_a_separate_processor(tiny_clip, tmp_path):
    """PickScore_v1's layout: a CLIPModel directory without a processor, used with CLIP-H's."""
    import shutil

    from transformers import CLIPModel, CLIPProcessor

    path, _ = tiny_clip
    model_dir = tmp_path / "PickScore_v1"
    model_dir.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(path / f, model_dir / f)
    rs = RewardSet({"pickscore": 1.0}, {"pickscore": {"path": str(model_dir), "processor": str(path), "batch_size": 3}})
    imgs = _images()
    out = rs.score(imgs, PROMPTS, [{}] * 4, list("abcd"))
    model, proc = CLIPModel.from_pretrained(str(model_dir)), CLIPProcessor.from_pretrained(str(path))
    with torch.no_grad():
        ref = model(**proc(text=PROMPTS, images=list(imgs), return_tensors="pt", padding=True)).logits_per_image.diag()
    assert np.allclose(out["pickscore.raw"], ref.numpy(), atol=1e-4)
    assert np.allclose(out["pickscore"], out["pickscore.raw"] / 26, atol=1e-6)
    one = np.concatenate([rs.score(imgs[i:i + 1], PROMPTS[i:i + 1], [{}], ["x"])["pickscore"] for i in range(4)])
    assert np.allclose(one, out["pickscore"], atol=1e-5)
    with pytest.raises(ValueError, match="reward.options.pickscore.processor"):  # PickScore_v1 has no processor
        RewardSet({"pickscore": 1.0}, {"pickscore": {"path": str(model_dir)}})


def test_aesthetic_loads_the_released_head_layout(tiny_clip):
    path, head = tiny_clip
    rs = RewardSet({"aesthetic": 1.0}, {"aesthetic": {"path": str(path), "head": str(head)}})
    imgs = _images(5, seed=1)
    a = rs.score(imgs, ["x"] * 5, [{}] * 5, list("abcde"))["aesthetic"]
    assert a.shape == (5,) and np.isfinite(a).all() and np.ptp(a) > 0
    reward = rs.rewards["aesthetic"]
    with torch.no_grad():
        ref = reward.head(reward.clip.image_embeds(imgs)).squeeze(-1).numpy()
    assert np.allclose(a, ref)
    one = np.concatenate([rs.score(imgs[i:i + 1], ["x"], [{}], ["x"])["aesthetic"] for i in range(5)])
    assert np.allclose(one, a, atol=1e-5)


def test_bad_paths_fail_in_preflight_naming_the_setting(tiny_clip, tmp_path):
    path, _ = tiny_clip
    for args, msg in ((["reward.weights={clip_score: 1.0}", f"reward.options.clip_score.path={tmp_path}"],
                       "reward.options.clip_score.path"),
                      (["reward.weights={aesthetic: 1.0}", f"reward.options.aesthetic.path={path}",
                        f"reward.options.aesthetic.head={tmp_path / 'missing.pth'}"], "reward.options.aesthetic.head")):
        res = CliRunner().invoke(app, ["train", "--iterations", "1", "--workdir", str(tmp_path / "wd"), *args])
        assert res.exit_code == 2, res.output
        assert msg in " ".join(res.output.split()) and not (tmp_path / "wd").exists()


def test_pixrl_score_scores_a_folder_with_its_sidecar_prompts(tiny_clip, tmp_path):
    import json

    from PIL import Image

    path, _ = tiny_clip
    imgs = _images(2, seed=3)
    for i, im in enumerate(imgs):
        Image.fromarray(im).save(tmp_path / f"{i:04d}.png")
        (tmp_path / f"{i:04d}.json").write_text(json.dumps({"prompt": PROMPTS[i], "seed": i}))
    res = CliRunner().invoke(app, ["score", "--reward", "clip_score,jpeg_compressibility", "--images", str(tmp_path),
                                   f"clip_score.path={path}"])
    assert res.exit_code == 0, res.output
    lines = [json.loads(ln) for ln in res.stdout.strip().splitlines()]
    assert [ln["file"] for ln in lines] == ["0000.png", "0001.png"] and lines[1]["prompt"] == PROMPTS[1]
    direct = RewardSet({"clip_score": 1.0}, {"clip_score": {"path": str(path)}}).score(imgs, PROMPTS[:2], [{}] * 2,
                                                                                       ["a", "b"])
    assert np.allclose([ln["clip_score"] for ln in lines], direct["clip_score"], atol=1e-6)
    assert all("jpeg_compressibility" in ln for ln in lines)
    (tmp_path / "0001.json").unlink()
    res = CliRunner().invoke(app, ["score", "--reward", "jpeg_compressibility", "--images", str(tmp_path)])
    assert res.exit_code == 2 and "0001.png: no prompt" in " ".join(res.output.split())
    res = CliRunner().invoke(app, ["score", "--reward", "shapes", "--images", str(tmp_path), "--prompt", "a red circle",
                                   "--dataset", "shapes"])
    assert res.exit_code == 0, res.output
    assert all(0 <= json.loads(ln)["shapes"] <= 1 for ln in res.stdout.strip().splitlines())


def test_image_similarity_is_the_cosine_of_the_edit_and_its_source(tiny_clip):
    """flow_grpo's image_similarity: cos between CLIP image embeddings of each edit and its source
    image (the metadata's `source_image` bytes, any size); the same over the reward service's JSON
    wire; a sample without a source fails by name."""
    from transformers import CLIPModel, CLIPProcessor

    from pixrl.models.source_images import png_bytes
    from pixrl.rewards.base import ScoringError
    from pixrl.rewards.wire import decode_metadata, encode_batch

    path, _ = tiny_clip
    rs = RewardSet({"image_similarity": 1.0}, {"image_similarity": {"path": str(path), "batch_size": 3}})
    imgs, sources = _images(), _images(seed=1)[:, :32, :36]
    metas = [{"category": "edit", "source_image": png_bytes(s)} for s in sources]
    got = rs.score(imgs, PROMPTS, metas, list("abcd"))["image_similarity"]
    model, proc = CLIPModel.from_pretrained(str(path)), CLIPProcessor.from_pretrained(str(path))
    with torch.no_grad():
        a = model.get_image_features(**proc(images=list(imgs), return_tensors="pt"))
        b = model.get_image_features(**proc(images=list(sources), return_tensors="pt"))
    a, b = (getattr(x, "pooler_output", x) for x in (a, b))
    assert np.allclose(got, torch.nn.functional.cosine_similarity(a, b).numpy(), atol=1e-5)
    same = rs.score(sources, PROMPTS, metas, list("abcd"))["image_similarity"]
    assert np.allclose(same, 1.0, atol=1e-5) and (got < same).all()
    wired = [decode_metadata(m) for m in encode_batch(imgs, PROMPTS, metas)["metadata"]]
    assert wired == metas
    with pytest.raises(ScoringError, match=r"samples \[1\] carry none"):
        rs.score(imgs[:2], PROMPTS[:2], [metas[0], {"category": "edit"}], ["a", "b"])


def test_image_similarity_of_a_clip_is_the_mean_over_its_frames_against_its_first_frame(tiny_clip):
    """Image-to-video (wan_i2v): each frame of a clip is compared with the clip's one source image
    (its first frame) and the clip scores the mean."""
    from pixrl.models.source_images import png_bytes

    path, _ = tiny_clip
    rs = RewardSet({"image_similarity": 1.0}, {"image_similarity": {"path": str(path)}})
    clips = _images(6, seed=2).reshape(2, 3, 48, 40, 3)
    sources = _images(2, seed=3)
    metas = [{"source_image": png_bytes(s)} for s in sources]
    got = rs.score(clips, PROMPTS[:2], metas, ["a", "b"])["image_similarity"]
    per_frame = rs.score(clips.reshape(6, 48, 40, 3), [p for p in PROMPTS[:2] for _ in range(3)],
                         [m for m in metas for _ in range(3)], list("abcdef"))["image_similarity"]
    assert np.allclose(got, per_frame.reshape(2, 3).mean(axis=1), atol=1e-6)


def test_image_similarity_under_dino_features_is_their_cosine(tiny_dino):
    """A DINOv2 directory as image_similarity's path (visual-rl's DINO similarity): the cosine of
    the CLS features after the last norm, each image through the model's own processor."""
    from transformers import AutoImageProcessor, Dinov2Model

    from pixrl.models.source_images import png_bytes

    rs = RewardSet({"image_similarity": 1.0}, {"image_similarity": {"path": str(tiny_dino), "batch_size": 3}})
    imgs, sources = _images(), _images(seed=1)
    metas = [{"category": "edit", "source_image": png_bytes(s)} for s in sources]
    got = rs.score(imgs, PROMPTS, metas, list("abcd"))["image_similarity"]
    model, proc = Dinov2Model.from_pretrained(str(tiny_dino)), AutoImageProcessor.from_pretrained(str(tiny_dino))
    with torch.no_grad():
        a, b = (model(**proc(images=list(x), return_tensors="pt")).last_hidden_state[:, 0] for x in (imgs, sources))
    assert np.allclose(got, torch.nn.functional.cosine_similarity(a, b).numpy(), atol=1e-5)
    assert np.allclose(rs.score(sources, PROMPTS, metas, list("abcd"))["image_similarity"], 1.0, atol=1e-5)


@pytest.mark.parametrize("name", ["clip_score", "pickscore", "aesthetic"])
def test_the_differentiable_path_is_the_rewards_own_score(tiny_clip, name):
    """`pixel_scores` (what DRaFT and ReFL train through) equals `score` on an image at the tower's
    size, and carries a gradient to the pixels at any size."""
    clip, head = tiny_clip
    options = {"path": str(clip), **({"head": str(head)} if name == "aesthetic" else {})}
    reward = RewardSet({name: 1.0}, {name: options}).rewards[name]
    reward.ensure_setup("cpu")
    images = np.random.default_rng(3).integers(0, 256, (4, 32, 32, 3), dtype=np.uint8)
    want = reward.score(images, PROMPTS, [{}] * 4)[name]
    pixels = torch.from_numpy(images).permute(0, 3, 1, 2).float().div(255).requires_grad_(True)
    got = reward.pixel_scores(pixels, PROMPTS)
    assert got.shape == (4,) and np.allclose(got.detach().numpy(), want, atol=1e-5), (got, want)
    got.sum().backward()
    assert pixels.grad.abs().sum() > 0
    other = torch.from_numpy(_images()).permute(0, 3, 1, 2).float().div(255).requires_grad_(True)
    moved = reward.pixel_scores(other, PROMPTS)
    moved.sum().backward()
    assert torch.isfinite(moved).all() and other.grad.abs().sum() > 0
