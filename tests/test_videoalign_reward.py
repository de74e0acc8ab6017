"""VideoAlign's VideoReward on a tiny checkpoint in the released layout (a Qwen2-VL base with
weights in transformers 4.45's keys; model_config.json and checkpoint-<step>/ with PEFT's adapter
and the non-LoRA tensors): the scores equal the model built and loaded the way VideoAlign's
inferencer loads it (PEFT wrapping by its target rule, its state-dict update, unmerged LoRA) and
run as its forward runs (sequential positions, the head at the three reward tokens, z-normalised);
frames are picked, resized and patched as qwen-vl-utils and Qwen2-VL's processor do; bad inputs
fail naming the fix."""

import math

import numpy as np
import pytest
import torch

from pixrl.rewards.base import ScoringError, build_reward
from pixrl.rewards.videoalign_prompts import SPECIAL_TOKENS, build_prompt

PROMPTS = ["a red circle rolls to the left", "a cat jumps onto a chair", "two dogs run on the beach"]


@pytest.fixture(scope="module", params=[3, 1], ids=["head3", "head1"])
def tiny(request, tmp_path_factory):
    from pixrl.rewards.videoalign_tiny import write_tiny_videoalign

    return write_tiny_videoalign(tmp_path_factory.mktemp(f"videoalign{request.param}"), output_dim=request.param)


def _reward(tiny, **kw):
    r = build_reward("videoalign", path=str(tiny[0]), base=str(tiny[1]), dtype="float32", **kw)
    r.ensure_setup("cpu")
    return r


def _clips(n=3, f=17, h=48, w=64, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, f, h, w, 3), dtype=np.uint8)


def _remap(key):
    """VideoAlign's PEFT keys (transformers 4.45) in transformers 5's module names."""
    key = key.replace("base_model.model.visual.", "base_model.model.model.visual.", 1)
    for part in ("embed_tokens.", "layers.", "norm."):
        key = key.replace(f"base_model.model.model.{part}", f"base_model.model.model.language_model.{part}", 1)
    return key


def _videoalign_model(tiny):
    """The reward model as VideoAlign's inferencer builds it: the base, the special tokens, the head,
    PEFT over its target rule, then `model_state.update(non_lora); update(lora)` with the adapter
    name inserted, loaded strictly — the LoRA left unmerged."""
    import json

    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration

    from pixrl.rewards.videoalign_tiny import lora_targets

    root, base = tiny
    cfg = json.loads((root / "model_config.json").read_text())
    tok = AutoTokenizer.from_pretrained(str(base), padding_side="right")
    tok.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    model = Qwen2VLForConditionalGeneration.from_pretrained(str(base), dtype=torch.float32)
    model.resize_token_embeddings(len(tok))
    model.rm_head = torch.nn.Linear(32, cfg["model_config"]["output_dim"], bias=False)
    lc = cfg["peft_lora_config"]
    model = get_peft_model(model, LoraConfig(r=lc["lora_r"], lora_alpha=lc["lora_alpha"], lora_dropout=0.05,
                                             bias="none", target_modules=lora_targets(model, lc["lora_namespan_exclude"])))
    folder = root / "checkpoint-100"
    lora = {k.replace(".weight", ".default.weight"): v for k, v in
            load_file(str(folder / "adapter_model.safetensors")).items()}
    state = model.state_dict()
    state.update({_remap(k): v for k, v in torch.load(folder / "non_lora_state_dict.pth").items()})
    state.update({_remap(k): v for k, v in lora.items()})
    model.load_state_dict(state, strict=True)
    return model.eval(), tok, cfg


def _videoalign_scores(ref, inputs, rope_index=False):
    """VideoAlign's forward: embeddings, the video placeholders replaced by the vision tower's
    patches, the language model (at sequential positions), the head at the reward tokens."""
    model, tok, cfg = ref
    inner, ids = model.base_model.model, inputs["input_ids"]
    with torch.no_grad():
        embeds = inner.model.language_model.embed_tokens(ids)
        feats = inner.model.visual(inputs["pixel_values_videos"], grid_thw=inputs["video_grid_thw"]).pooler_output
        embeds = embeds.masked_scatter((ids == inner.config.video_token_id).unsqueeze(-1).expand_as(embeds), feats)
        pos = None
        if rope_index:
            marks = (ids == inner.config.video_token_id).int() * 2
            pos, _ = inner.model.get_rope_index(ids, mm_token_type_ids=marks, video_grid_thw=inputs["video_grid_thw"],
                                                attention_mask=inputs["attention_mask"])
        hidden = inner.model.language_model(inputs_embeds=embeds, attention_mask=inputs["attention_mask"],
                                            position_ids=pos)[0]
        logits = inner.rm_head(hidden)
    at = torch.zeros_like(ids, dtype=torch.bool)
    for i in tok.convert_tokens_to_ids(list(SPECIAL_TOKENS)):
        at |= ids == i
    pooled = logits[at].view(ids.shape[0], 3, -1)
    pooled = pooled.diagonal(dim1=1, dim2=2) if cfg["model_config"]["output_dim"] == 3 else pooled.reshape(-1, 3)
    norm = cfg["inference_config"]
    out = {d: (pooled[:, k] - norm[f"{d}_mean"]) / norm[f"{d}_std"] for k, d in enumerate(("VQ", "MQ", "TA"))}
    out["Overall"] = out["VQ"] + out["MQ"] + out["TA"]
    return out


def test_scores_equal_videoalign_loaded_and_run_as_its_inferencer_does(tiny):
    reward, ref = _reward(tiny, batch_size=3), _videoalign_model(tiny)
    clips = _clips()
    got = reward.score(clips, PROMPTS, [{}] * 3)
    want = _videoalign_scores(ref, reward.inputs(clips, PROMPTS))
    for d in ("VQ", "MQ", "TA"):
        assert np.abs(got[f"videoalign.{d.lower()}"] - want[d].numpy()).max() <= 1e-5
    assert np.abs(got["videoalign"] - want["Overall"].numpy()).max() <= 1e-5
    # the text is the checkpoint's template after the video, under the chat template
    text = reward.tokenizer.decode(reward.inputs(clips[:1], PROMPTS[:1])["input_ids"][0])
    assert build_prompt(PROMPTS[0], ["VQ", "MQ", "TA"], "detailed_special") in text
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                           "<|vision_start|><|video_pad|>") and text.endswith("<|im_start|>assistant\n")


def test_positions_are_sequential_as_in_videoaligns_forward_not_qwen2_vls_rope_index(tiny):
    reward, ref = _reward(tiny), _videoalign_model(tiny)
    inputs = reward.inputs(_clips(1), PROMPTS[:1])
    seq, rope = _videoalign_scores(ref, inputs)["Overall"], _videoalign_scores(ref, inputs, rope_index=True)["Overall"]
    assert abs(float(seq[0]) - float(rope[0])) > 1e-5
    assert abs(reward.score(_clips(1), PROMPTS[:1], [{}])["videoalign"][0] - float(seq[0])) <= 1e-5


def test_frames_are_picked_as_qwen_vl_utils_picks_them():
    from pixrl.models.qwen_vl_video import frame_indices, smart_nframes

    assert smart_nframes(81, 16, fps=2.0) == 10  # Wan's 81 frames at 16 fps: 5.06 s at 2 fps
    assert frame_indices(81, 10) == [0, 9, 18, 27, 36, 44, 53, 62, 71, 80]
    assert smart_nframes(129, 24, fps=2.0) == 10  # HunyuanVideo's 129 at 24 fps: 10.75 → 10
    assert smart_nframes(17, 16, fps=2.0) == 4 and frame_indices(5, 4) == [0, 1, 3, 4]  # at least 4
    assert smart_nframes(5, 16, fps=2.0) == 4 and smart_nframes(33, 16, nframes=7) == 8
    assert smart_nframes(3, 16, fps=2.0) == 2  # at most the clip's, on the 2-frame patch
    with pytest.raises(ValueError, match="between 2 and 1"):
        smart_nframes(1, 16, fps=2.0)


def test_frames_are_resized_on_the_grid_within_the_pixel_bounds():
    from PIL import Image

    from pixrl.models.qwen_vl_video import resized_frames, smart_resize

    assert smart_resize(480, 832, 128 * 28 * 28, 448 * 448) == (336, 588)  # Wan's 480p into 200,704 pixels
    assert smart_resize(32, 40, 128 * 28 * 28, 448 * 448) == (308, 364)  # small frames grow to 128 tokens
    assert smart_resize(10, 2000, 784, 10 ** 7) == (28, 1988)  # a side under half a cell keeps one cell
    frame = np.random.default_rng(1).integers(0, 256, (2, 56, 84, 3), dtype=np.uint8)
    same = resized_frames(frame, 784, 56 * 84)
    assert torch.equal(same, torch.from_numpy(frame).permute(0, 3, 1, 2).float())  # on the grid: untouched
    smooth = np.asarray(Image.fromarray(frame[0]).resize((168, 112), Image.BILINEAR))  # smooth content
    out = resized_frames(smooth[None], 112 * 168 // 4, 112 * 168 // 4)
    assert tuple(out.shape) == (1, 3, 56, 84) and out.dtype == torch.float32 and float(out.frac().abs().max()) == 0
    pil = np.asarray(Image.fromarray(smooth).resize((84, 56), Image.BICUBIC)).astype(np.float32)
    assert np.abs(out[0].permute(1, 2, 0).numpy() - pil).mean() < 1.0  # antialiased bicubic, as PIL's


def test_video_patches_are_what_the_vision_towers_3d_convolution_reads(tiny):
    """The patches in merge-window order: the tower's Conv3d over the normalised video directly
    (kernel = stride = 2 × 14 × 14) gives the same embeddings as over the flat patches."""
    from pixrl.models.qwen_vl_video import video_patches

    reward = _reward(tiny)
    video = torch.from_numpy(_clips(1, 5, 56, 112)[0]).permute(0, 3, 1, 2).float()  # odd: the last frame doubled
    ip = reward.images
    flat, grid = video_patches(video, ip.image_mean, ip.image_std)
    assert grid.tolist() == [3, 4, 8] and tuple(flat.shape) == (3 * 4 * 8, 3 * 2 * 14 * 14)
    embed = reward.model.model.visual.patch_embed
    with torch.no_grad():
        via_flat = embed(flat)  # [gt·gh·gw, D]
        x = (video / 255 - torch.tensor(ip.image_mean).view(1, 3, 1, 1)) / torch.tensor(ip.image_std).view(1, 3, 1, 1)
        x = torch.cat([x, x[-1:]]).permute(1, 0, 2, 3)[None]  # [1, C, T, H, W]
        direct = embed.proj(x)[0]  # [D, gt, gh, gw]
    d = direct.shape[0]
    direct = direct.reshape(d, 3, 2, 2, 4, 2).permute(1, 2, 4, 3, 5, 0).reshape(-1, d)  # merge windows of 2×2
    assert torch.allclose(via_flat, direct, atol=1e-5)


def test_a_batch_scores_as_its_rows_alone_and_prompt_and_clip_matter(tiny):
    reward = _reward(tiny)
    clips = _clips()
    batch = reward.score(clips, PROMPTS, [{}] * 3)["videoalign"]
    alone = np.concatenate([reward.score(clips[i:i + 1], PROMPTS[i:i + 1], [{}])["videoalign"] for i in range(3)])
    assert np.allclose(batch, alone, atol=1e-5) and batch.dtype == np.float32
    assert reward.score(clips[:1], ["a cat"], [{}])["videoalign"][0] != pytest.approx(batch[0], abs=1e-7)
    assert reward.score(clips[1:2], PROMPTS[:1], [{}])["videoalign"][0] != pytest.approx(batch[0], abs=1e-7)
    reversed_ = reward.score(clips[:1, ::-1], PROMPTS[:1], [{}])["videoalign"][0]
    assert reversed_ != pytest.approx(batch[0], abs=1e-7)  # the order of frames is read


def test_dimensions_and_normalisation(tiny):
    from pixrl.rewards.videoalign_tiny import NORM

    clips = _clips(2)
    full = _reward(tiny).score(clips, PROMPTS[:2], [{}] * 2)
    two = _reward(tiny, dimensions=["vq", "mq"]).score(clips, PROMPTS[:2], [{}] * 2)
    assert np.allclose(two["videoalign"], full["videoalign.vq"] + full["videoalign.mq"], atol=1e-6)
    raw = _reward(tiny, normalize=False).score(clips, PROMPTS[:2], [{}] * 2)
    for d in ("vq", "mq", "ta"):
        want = full[f"videoalign.{d}"] * NORM[f"{d.upper()}_std"] + NORM[f"{d.upper()}_mean"]
        assert np.allclose(raw[f"videoalign.{d}"], want, atol=1e-5)
    # sampling at another rate reads other frames
    fast = _reward(tiny, fps=8.0).score(clips, PROMPTS[:2], [{}] * 2)["videoalign"]
    assert not np.allclose(fast, full["videoalign"], atol=1e-6)


def test_through_the_preset_on_clips(tiny):
    from pixrl.config.loader import load_config
    from pixrl.rewards.compose import RewardSet

    cfg = load_config(None, ["reward=videoalign", f"reward.options.videoalign.path={tiny[0]}",
                             f"reward.options.videoalign.base={tiny[1]}", "reward.options.videoalign.dtype=float32"])
    rs = RewardSet(cfg.reward.weights, cfg.reward.options)
    clips = _clips(2)
    out = rs.score(clips, PROMPTS[:2], [{}] * 2, ["00001-000-00", "00001-000-01"])
    alone = _reward(tiny).score(clips, PROMPTS[:2], [{}] * 2)
    assert np.allclose(out["videoalign"], alone["videoalign"], atol=1e-6) and "videoalign.mq" in out


def test_pixrl_score_reads_each_mp4_at_its_own_frame_rate(tiny, tmp_path):
    """A clip written at 8 fps is read as 8 fps (14 of 53 frames at 2 fps), not at `clip_fps`."""
    import json

    from typer.testing import CliRunner

    from pixrl.artifacts.media import clip_bytes
    from pixrl.cli import app

    clip = _clips(1, 53, 32, 32, seed=3)[0]
    (tmp_path / "a.mp4").write_bytes(clip_bytes(clip, fps=8))
    res = CliRunner().invoke(app, ["score", "--reward", "videoalign", "--images", str(tmp_path), "--prompt", PROMPTS[0],
                                   f"videoalign.path={tiny[0]}", f"videoalign.base={tiny[1]}", "videoalign.dtype=float32"])
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout.strip().splitlines()[-1])["videoalign"]
    at8, at16 = (_reward(tiny, clip_fps=r).score(clip[None], PROMPTS[:1], [{}])["videoalign"][0] for r in (8, 16))
    assert got == pytest.approx(float(at8), abs=1e-5) and abs(at8 - at16) > 1e-6
    assert _reward(tiny).inputs(clip[None], PROMPTS[:1], [8.0])["video_grid_thw"][0, 0] == 7  # 14 frames, in pairs


def test_bad_inputs_and_checkpoints_fail_naming_the_fix(tiny, tmp_path):
    import shutil

    root, base = tiny
    with pytest.raises(ValueError, match="KlingTeam/VideoReward"):
        build_reward("videoalign", path=str(tmp_path), base=str(base))
    with pytest.raises(ValueError, match="Qwen2-VL-2B-Instruct"):
        build_reward("videoalign", path=str(root), base=str(tmp_path))
    with pytest.raises(ValueError, match="distinct ones of"):
        build_reward("videoalign", path=str(root), base=str(base), dimensions=["vq", "aesthetics"])
    with pytest.raises(ScoringError, match="no checkpoint-7 .*checkpoint-100"):
        _reward(tiny, step=7)
    with pytest.raises(ValueError, match="holds one of its reward tokens"):
        build_reward("videoalign", path=str(root), base=str(base)).check_prompts(["a <|VQ_reward|> cat"], [{}])
    with pytest.raises(ScoringError, match="scores clips"):
        _reward(tiny).score(_clips(2)[:, 0], PROMPTS[:2], [{}] * 2)
    bare = tmp_path / "bare"
    shutil.copytree(root, bare)
    rest = bare / "checkpoint-100" / "non_lora_state_dict.pth"
    torch.save({k: v for k, v in torch.load(rest).items() if "embed_tokens" not in k}, rest)
    with pytest.raises(ScoringError, match="no trained embeddings for the reward tokens"):
        build_reward("videoalign", path=str(bare), base=str(base)).ensure_setup("cpu")
    (bare / "checkpoint-100" / "adapter_model.safetensors").unlink()
    with pytest.raises(ScoringError, match="neither model.pth nor"):
        build_reward("videoalign", path=str(bare), base=str(base)).ensure_setup("cpu")


@pytest.fixture(scope="module")
def tiny_reward(tmp_path_factory):
    from pixrl.rewards.videoalign_tiny import write_tiny_videoalign

    return write_tiny_videoalign(tmp_path_factory.mktemp("videoalign_e2e"))


def test_wan_trains_on_videoalign_through_the_flow(tiny_wan, tiny_reward, tmp_path, prefect_harness):
    """Two iterations of Wan with DanceGRPO's reward settings (VQ alone): each clip's three heads
    stored with it, the advantage from VQ, and `pixrl replay` of iteration 1 exact."""
    import json

    import lance
    from mlflow.tracking import MlflowClient
    from typer.testing import CliRunner

    from pixrl.cli import app
    from tests.conftest import tiny_overrides

    path, o = tiny_wan
    extra = {k: v for k, v in o.items() if k != "model.path"}
    res = CliRunner().invoke(app, ["train", "--iterations", "2", "--run", "wan-va", "reward=videoalign",
                                   f"reward.options.videoalign.path={tiny_reward[0]}",
                                   f"reward.options.videoalign.base={tiny_reward[1]}",
                                   "reward.options.videoalign.dtype=float32", "reward.options.videoalign.dimensions=[VQ]",
                                   *tiny_overrides(path, tmp_path, **extra)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    out = json.loads(res.stdout.strip().splitlines()[-1])
    t = lance.dataset(out["table_uri"]).to_table()
    assert t.num_rows == 16 and all(t[c].null_count == 0 for c in ("image", "reward", "advantage", "log_probs"))
    comps = [{c["name"]: c["value"] for c in row} for row in t["rewards"].to_pylist()]
    assert all({"videoalign.vq", "videoalign.mq", "videoalign.ta"} <= set(c) for c in comps)
    assert np.allclose(t["reward"].to_numpy(), [c["videoalign.vq"] for c in comps], atol=1e-6)  # VQ alone
    assert np.allclose([c["videoalign"] for c in comps], [c["videoalign.vq"] for c in comps], atol=1e-6)
    metrics = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(out["run_id"]).data.metrics
    assert "reward/videoalign.mq/mean" in metrics and "reward/videoalign/mean" in metrics
    rep = CliRunner().invoke(app, ["replay", "wan-va", "--iteration", "1", "--workdir", str(tmp_path)])
    assert rep.exit_code == 0 and json.loads(rep.stdout.strip().splitlines()[-1])["equal"] is True, rep.output


def test_dance_grpos_two_rewards_vq_and_mq_normalised_apart(tiny_wan, tiny_reward, tmp_path, prefect_harness):
    """DanceGRPO's VideoAlign loss with both heads (vq_coef, mq_coef): VQ and MQ each normalised in
    its group by the algorithm's estimator and clipped, then weighted and summed —
    reward.aggregate=advantage over the components VideoAlign stores (reward.advantage_weights)."""
    import json

    import lance
    from typer.testing import CliRunner

    from pixrl.algorithms.advantages import aggregated_advantages
    from pixrl.algorithms.base import build_algorithm
    from pixrl.cli import app
    from pixrl.config.schema import AlgorithmConfig
    from tests.conftest import tiny_overrides

    path, o = tiny_wan
    extra = {k: v for k, v in o.items() if k != "model.path"}
    res = CliRunner().invoke(app, ["train", "--iterations", "1", "--run", "wan-vqmq", "reward=videoalign",
                                   f"reward.options.videoalign.path={tiny_reward[0]}",
                                   f"reward.options.videoalign.base={tiny_reward[1]}",
                                   "reward.options.videoalign.dtype=float32", "reward.options.videoalign.dimensions=[VQ,MQ]",
                                   "reward.aggregate=advantage", "reward.advantage_weights={videoalign.vq: 1.0, videoalign.mq: 0.5}",
                                   *tiny_overrides(path, tmp_path, **extra)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    out = json.loads(res.stdout.strip().splitlines()[-1])
    t = lance.dataset(out["table_uri"]).to_table(columns=["group_id", "rewards", "advantage"])
    comps = [{c["name"]: c["value"] for c in row} for row in t["rewards"].to_pylist()]
    weights = {"videoalign.vq": 1.0, "videoalign.mq": 0.5}
    parts = {k: np.array([c[k] for c in comps]) for k in weights}
    algo = build_algorithm(AlgorithmConfig(name="flow_grpo"))
    want = aggregated_advantages(algo.advantages, parts, weights, t["group_id"].to_numpy()).advantages
    assert np.array_equal(t["advantage"].to_numpy(), want)
    total = algo.advantages(np.array([c["videoalign"] for c in comps]), t["group_id"].to_numpy()).advantages
    assert not np.allclose(t["advantage"].to_numpy(), total)  # not the summed reward's advantage


def test_advantage_weights_name_stored_scores(tiny_wan, tiny_reward, tmp_path):
    from typer.testing import CliRunner

    from pixrl.cli import app
    from tests.conftest import tiny_overrides

    path, o = tiny_wan
    base = ["train", "-n", "1", "reward=videoalign", f"reward.options.videoalign.path={tiny_reward[0]}",
            f"reward.options.videoalign.base={tiny_reward[1]}",
            *tiny_overrides(path, tmp_path / "wd", **{k: v for k, v in o.items() if k != "model.path"})]
    res = CliRunner().invoke(app, [*base, "reward.aggregate=advantage", "reward.advantage_weights={videoalign.vqq: 1.0}"])
    said = " ".join(res.output.split())
    assert res.exit_code == 2 and "'videoalign.vqq' is not a score these rewards store" in said
    assert "videoalign.mq" in said
    res = CliRunner().invoke(app, [*base, "reward.advantage_weights={videoalign.vq: 1.0}"])
    assert res.exit_code == 2 and "set reward.aggregate=advantage" in " ".join(res.output.split())
    assert not (tmp_path / "wd").exists()
