"""LTX-2 text-to-audio+video on tiny random checkpoints written by `pixrl tiny ltx2` in the
diffusers layout (LTX-2.3's by default, LTX-2.0's beside it): the Gemma encoding through the
connectors, the dynamic-shift σ grid of the video tokens, ODE latents of both streams equal to
LTX2Pipeline's under every guidance term (CFG per stream, spatio-temporal guidance, modality
isolation, rescale), the decoded frames and soundtrack equal to its output, replayed log-probs
equal the stored ones, the refusals, and two RL iterations (LoRA and full) through the unchanged
flow with each clip's soundtrack stored beside it and rewarded by CLAP."""

import io
import json
import wave

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from conftest import two_iterations
from family_checks import assert_replay_is_on_policy, gens
from pixrl.algorithms.sampling import SamplerRecipe, initial_noise, sample
from pixrl.artifacts.media import decode_media
from pixrl.cli import app
from pixrl.models.base import ModelLoadError
from pixrl.models.ltx2 import LTX2Family
from pixrl.models.registry import family_of_directory, get_family

PROMPTS = ["a red circle", "two blue squares in the sky"]
SIZE = dict(max_sequence_length=32, resolution=64, frames=9)
NO_EXTRA_PASSES = dict(stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0, audio_modality_scale=1.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny-ltx2"
    return out, LTX2Family.write_tiny(out, seed=0)


@pytest.fixture(scope="module")
def tiny20(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny-ltx2-0"
    return out, LTX2Family.write_tiny(out, seed=0, variant="2.0")


def _load(path, **kw):
    return LTX2Family.load(path, **SIZE, **{"stg_blocks": [1], **kw})


@pytest.fixture(scope="module")
def family(tiny):
    return _load(tiny[0])


def _pipeline(fam, x, cfg: float, negative: str | None = None, output_type: str = "latent", steps: int = 6, **terms):
    """LTX2Pipeline from the joint initial latents `x` (its video tokens as packed latents; its
    audio tokens un-normalised, as the pipeline normalises given audio latents); the pipeline's
    defaults for every guidance term not in `terms`."""
    xv, xa = fam.split(x)
    avae = fam.pipe.audio_vae
    return fam.pipe(prompt=PROMPTS, negative_prompt=negative, height=64, width=64, num_frames=9, num_inference_steps=steps,
                    guidance_scale=cfg, audio_guidance_scale=terms.pop("audio_guidance_scale", 7.0 if cfg > 1 else 1.0),
                    latents=xv, audio_latents=xa * avae.latents_std + avae.latents_mean, max_sequence_length=32,
                    frame_rate=fam.frame_rate, output_type=output_type, spatio_temporal_guidance_blocks=[1], **terms)


def _ode(fam, cfg: float, negative: str | None = None, seeds=(3, 4)):
    neg = fam.encode_negative(negative or "").expand(2) if cfg > 1 else None
    return sample(fam, fam.encode_prompts(PROMPTS), neg, gens(seeds), SamplerRecipe(6, 0.0, guidance_scale=cfg,
                                                                                   train_steps=()))


def _streams(fam, final):
    """Joint latents → (video [B, C, F, H, W], audio [B, C, L, M]) as the pipeline's latent output
    holds them (the video normalised, the audio not)."""
    avae = fam.pipe.audio_vae
    length, _, mel = fam.audio_shape
    audio = fam.pipe._denormalize_audio_latents(fam.split(final)[1], avae.latents_mean, avae.latents_std)
    return fam.video_latents(final), fam.pipe._unpack_audio_latents(audio, length, num_mel_bins=mel)


def test_registered_and_found_from_its_layout(tiny, family):
    assert get_family("ltx2") is LTX2Family and LTX2Family.video and LTX2Family.audio
    assert family_of_directory(tiny[0]) == "ltx2"
    assert family.latent_shape() == (3 * 4 * 4 + 9, 8)  # video tokens, then round(9/24 s × 25 per s) audio ones
    names = [n for n, _ in family.transformer.named_modules()]
    assert all(any(n.endswith(t) for n in names) for t in LTX2Family.lora_targets)
    d = family.describe()
    assert d["audio_tokens"] == 9 and d["stg_active"] and d["audio_guidance"]["cfg"] == 7.0


def test_encoding_is_the_pipelines_through_its_connectors(family):
    cond = family.encode_prompts(PROMPTS)
    embeds, mask, _, _ = family.pipe.encode_prompt(PROMPTS, do_classifier_free_guidance=False, max_sequence_length=32,
                                                   device="cpu")
    video, audio, mask = family.pipe.connectors(embeds, mask, padding_side="left")
    assert torch.equal(cond.video, video) and torch.equal(cond.audio, audio) and torch.equal(cond.mask, mask)
    assert not torch.equal(cond.video[0], cond.video[1])


def test_schedule_is_the_pipelines_shift_of_the_video_tokens(family):
    from copy import deepcopy

    from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

    sigmas, timesteps = family.schedule(6)
    sched = deepcopy(family.pipe.scheduler)
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / 6, 6), mu=calculate_shift(48, 1024, 4096, 0.95, 2.05))
    assert torch.equal(timesteps, sched.timesteps.float()) and torch.equal(sigmas, sched.sigmas.float())
    assert sigmas[-1] == 0 and abs(float(sigmas[-2]) - 0.1) < 1e-6


@pytest.mark.parametrize("cfg,negative,terms", [
    (1.0, None, NO_EXTRA_PASSES),  # plain flow
    (1.0, None, {}),  # spatio-temporal and modality-isolation guidance, rescaled, without CFG
    (3.0, "worst quality, blurry", {}),  # every term: the pipeline's defaults
    (4.0, None, dict(audio_guidance_scale=5.0, guidance_rescale=0.0, modality_scale=2.0, audio_modality_scale=1.5,
                     stg_scale=0.5, audio_stg_scale=2.0)),
    (1.0, None, {**NO_EXTRA_PASSES, "motion_speed": 0.5}),  # the rotary time axis at frame_rate / motion_speed
])
def test_ode_sampling_of_both_streams_equals_the_pipeline(tiny, cfg, negative, terms):
    fam = _load(tiny[0], **terms)
    traj = _ode(fam, cfg, negative)
    ref = _pipeline(fam, initial_noise(gens([3, 4]), fam.latent_shape()), cfg, negative, **terms)
    video, audio = _streams(fam, traj.final)
    ref_video = fam.pipe._normalize_latents(ref.frames, fam.vae.latents_mean, fam.vae.latents_std)
    assert video.shape == ref_video.shape == (2, 8, 3, 4, 4) and audio.shape == ref.audio.shape == (2, 2, 9, 4)
    assert (video - ref_video).abs().max().item() <= 1e-5
    assert (audio - ref.audio).abs().max().item() <= 1e-5


def test_the_distilled_sampling_equals_the_pipeline_given_its_sigmas(tiny):
    """LTX-2 distilled as its makers sample it: 8 steps on DISTILLED_SIGMA_VALUES, one DiT pass a
    step (no CFG on either stream, no extra guidance pass) — model/ltx2_19b_distilled."""
    from diffusers.pipelines.ltx2.utils import DISTILLED_SIGMA_VALUES

    terms = {**NO_EXTRA_PASSES, "audio_guidance_scale": 1.0}
    fam = _load(tiny[0], sigmas=DISTILLED_SIGMA_VALUES, **terms)
    traj = sample(fam, fam.encode_prompts(PROMPTS), None, gens((3, 4)), SamplerRecipe(8, 0.0, train_steps=()))
    ref = _pipeline(fam, initial_noise(gens([3, 4]), fam.latent_shape()), 1.0, steps=8, sigmas=DISTILLED_SIGMA_VALUES,
                    **terms)
    video, audio = _streams(fam, traj.final)
    ref_video = fam.pipe._normalize_latents(ref.frames, fam.vae.latents_mean, fam.vae.latents_std)
    assert (video - ref_video).abs().max().item() <= 1e-5 and (audio - ref.audio).abs().max().item() <= 1e-5
    plain = sample(_load(tiny[0], **terms), fam.encode_prompts(PROMPTS), None, gens((3, 4)),
                   SamplerRecipe(8, 0.0, train_steps=()))  # the pipeline's linspace grid at 8 steps
    assert (plain.final - traj.final).abs().max().item() > 1e-3


def test_ltx20_without_perturbable_attention_equals_the_pipeline(tiny20):
    """LTX-2.0's DiT ignores the perturbation: the family skips that pass, the pipeline's equals
    its conditional one."""
    fam = _load(tiny20[0])
    assert not fam.describe()["stg_active"] and fam.transformer.config.use_prompt_embeddings
    traj = _ode(fam, 3.0)
    ref = _pipeline(fam, initial_noise(gens([3, 4]), fam.latent_shape()), 3.0)
    video, audio = _streams(fam, traj.final)
    assert (video - fam.pipe._normalize_latents(ref.frames, fam.vae.latents_mean, fam.vae.latents_std)).abs().max() <= 1e-5
    assert (audio - ref.audio).abs().max().item() <= 1e-5


def test_each_guidance_term_acts_on_its_stream(tiny, family):
    """Controls: the perturbed and isolated passes and the motion speed change the velocity; the
    audio scales move only the audio stream's velocity, the video ones only the video stream's."""
    x = torch.randn(2, *family.latent_shape(), generator=torch.Generator().manual_seed(0))
    t, cond, neg = torch.tensor([700.0]), family.encode_prompts(PROMPTS), family.encode_negative("").expand(2)
    base = family.velocity(x, t, cond, 3.0, neg)
    n_video = family.latent_shape()[0] - 9
    for terms, moved in [(dict(stg_scale=0.0, audio_stg_scale=0.0), "both"), (dict(modality_scale=1.0, audio_modality_scale=1.0), "both"),
                         (dict(audio_guidance_scale=2.0), "audio"), (dict(guidance_rescale=0.1), "video"),
                         (dict(motion_speed=0.5), "both")]:
        other = _load(tiny[0], **terms).velocity(x, t, cond, 3.0, neg)
        dv = (other[:, :n_video] - base[:, :n_video]).abs().max().item()
        da = (other[:, n_video:] - base[:, n_video:]).abs().max().item()
        if moved == "both":
            assert dv > 1e-4 and da > 1e-4, terms
        else:
            assert (dv > 1e-4) == (moved == "video") and (da > 1e-4) == (moved == "audio"), terms


def test_decoded_frames_and_soundtrack_equal_the_pipelines_output(family):
    x = initial_noise(gens([5, 6]), family.latent_shape())
    ref = _pipeline(family, x, 3.0, output_type="np")
    traj = _ode(family, 3.0, seeds=(5, 6))
    clips = family.decode(traj.final)
    assert clips.shape == (2, 9, 64, 64, 3) and clips.dtype == np.uint8
    assert np.abs(clips.astype(int) - (np.asarray(ref.frames) * 255).round().astype(int)).max() <= 1
    sound, rate = family.decode_audio(traj.final)
    assert rate == 16000 and sound.shape == tuple(ref.audio.shape) and sound.shape[:2] == (2, 2)
    assert np.abs(sound - ref.audio.float().numpy()).max() <= 1e-4 and np.abs(sound).max() > 1e-3


@pytest.mark.parametrize("sde_type,window", [("sde", None), ("cps", None), ("sde", (1, 2))])
def test_replayed_log_probs_equal_stored_with_every_guidance_term(family, sde_type, window):
    recipe = SamplerRecipe(steps=4, noise_level=0.7, sde_type=sde_type, guidance_scale=3.0, sde_steps=window,
                           train_steps=window or (0, 1, 2))
    assert_replay_is_on_policy(family, family.encode_prompts(PROMPTS), family.encode_negative("").expand(2), recipe)


def test_refusals_name_the_fix(tiny, tmp_path):
    path = tiny[0]
    with pytest.raises(ModelLoadError, match="model.frames=8.*4k\\+1 frames"):
        LTX2Family.load(path, max_sequence_length=32, resolution=64, frames=8, stg_blocks=[1])
    with pytest.raises(ModelLoadError, match="model.resolution=40.*multiple of 16"):
        LTX2Family.load(path, max_sequence_length=32, resolution=40, frames=9, stg_blocks=[1])
    with pytest.raises(ModelLoadError, match="stg_blocks=\\[2\\]: this DiT has blocks 0–1"):
        _load(path, stg_blocks=[2])
    with pytest.raises(ModelLoadError, match="stg_scale > 0 needs stg_blocks"):
        _load(path, stg_blocks=[])
    _load(path, stg_blocks=[], stg_scale=0.0, audio_stg_scale=0.0)  # no perturbation: no blocks needed
    from diffusers import AutoencoderKLLTX2Audio, LTX2Pipeline

    fam = _load(path)
    wider = AutoencoderKLLTX2Audio.from_config({**fam.pipe.audio_vae.config, "latent_channels": 4, "base_channels": 16})
    LTX2Pipeline(**{**fam.pipe.components, "audio_vae": wider}).save_pretrained(str(tmp_path / "uneven"))
    with pytest.raises(ModelLoadError, match="video tokens have 8 features and its audio tokens 16"):
        _load(tmp_path / "uneven")


@pytest.fixture(scope="module")
def tiny_clap(tmp_path_factory):
    from pixrl.rewards.clap_tiny import write_tiny_clap

    return write_tiny_clap(tmp_path_factory.mktemp("clap") / "clap", seed=0)


def _same_pcm(a: bytes, b: bytes) -> None:
    """Two WAVs of one soundtrack: the same format and length, samples within 1 of 16-bit PCM —
    decode renders each micro-batch (in a background thread under reward.overlap) and the check
    all rows at once, and a vocoder's float rounding at another batch shape can move the last bit."""
    with wave.open(io.BytesIO(a)) as x, wave.open(io.BytesIO(b)) as y:
        assert x.getparams() == y.getparams()
        pa, pb = (np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16).astype(np.int32) for w in (x, y))
    assert len(pa) and np.abs(pa - pb).max() <= 1


def _wavs(fam, t):
    """The rows' soundtracks as decode renders them from their stored joint latents."""
    from pixrl.artifacts.media import wav_bytes

    final = torch.from_numpy(np.array(t["final_latent"].combine_chunks().to_numpy_ndarray())).float()
    waves, rate = fam.decode_audio(final)
    return [wav_bytes(w, rate) for w in waves]


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_two_rl_iterations_through_the_unchanged_flow(tiny, tiny_clap, tmp_path, prefect_harness, mode):
    """Rewarded on the frames (JPEG) and the soundtrack (CLAP): each row stores its clip's
    soundtrack as decode renders it from the joint latent — in process (full) and from the
    background decode of reward.overlap (LoRA) —, the CLAP reward scores the stored WAV, the
    MLflow grid has a WAV per cell; full fine-tuning replays its iteration bit for bit."""
    from mlflow.tracking import MlflowClient

    from pixrl.rewards.compose import RewardSet

    overlap = ["reward.overlap=true"] if mode == "lora" else []
    out, t = two_iterations(tiny, tmp_path, f"ltx2-{mode}", mode, "sampling.guidance_scale=3.0",
                            "sampling.negative_prompt='worst quality, blurry'", "reward.weights.clap_score=0.5",
                            f"reward.options.clap_score.path={tiny_clap}", *overlap)
    assert decode_media(t["image"][0].as_py()).shape == (9, 64, 64, 3)
    assert t["final_latent"].type.shape == [57, 8]
    fam = _load(tiny[0])
    assert t["soundtrack"].null_count == 0
    for stored, again in zip(t["soundtrack"].to_pylist(), _wavs(fam, t)):
        _same_pcm(stored, again)
    clap = [{r["name"]: r["value"] for r in row}["clap_score"] for row in t["rewards"].to_pylist()]
    clips = np.stack([decode_media(b) for b in t["image"].to_pylist()])
    again = RewardSet({"clap_score": 1.0}, {"clap_score": {"path": str(tiny_clap)}}).score(
        clips, t["prompt"].to_pylist(), [{"soundtrack": w} for w in t["soundtrack"].to_pylist()],
        t["sample_id"].to_pylist())["clap_score"]
    assert np.allclose(clap, again, atol=1e-6)
    logged = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").list_artifacts(out["run_id"], "samples/it_0001_sound")
    assert sorted(a.path.rsplit("/", 1)[1] for a in logged) == [f"r{r}_c{c}.wav" for r in range(2) for c in range(4)]
    if mode == "full":
        rep = CliRunner().invoke(app, ["replay", f"ltx2-{mode}", "--iteration", "1", "--workdir", str(tmp_path)])
        assert rep.exit_code == 0 and json.loads(rep.stdout.strip().splitlines()[-1])["equal"] is True, rep.output
        gen = CliRunner().invoke(app, ["generate", "--run", f"ltx2-{mode}", "--workdir", str(tmp_path), "--prompt",
                                       "a red circle", "--out", str(tmp_path / "gen"), "--steps", "2"])
        assert gen.exit_code == 0 and "clips with their soundtracks" in gen.output, gen.output
        with wave.open(str(tmp_path / "gen" / "0000_00.wav")) as w:
            assert (w.getnchannels(), w.getframerate(), w.getsampwidth()) == (2, 16000, 2) and w.getnframes() > 0
        _ray_worker_decode_writes_the_same_columns(out, tmp_path)


def test_held_out_evaluation_scores_each_clip_with_its_soundtrack(family, tiny_clap):
    """The run's rewards as its held-out evaluation: CLAP hears the soundtrack each clip was
    sampled with (the same WAV a rollout row would store), split in shards or not."""
    from pixrl.artifacts.media import wav_bytes
    from pixrl.config.schema import SamplingConfig
    from pixrl.datasets.prompts import PromptItem
    from pixrl.datasets.reward_eval import RewardEvaluator, SoundingClips, join_samples
    from pixrl.datasets.shapes.evaluate import generate_images
    from pixrl.algorithms.recipe import eval_recipe
    from pixrl.rewards.compose import RewardSet

    rewards = RewardSet({"clap_score": 1.0}, {"clap_score": {"path": str(tiny_clap)}})
    items = [PromptItem(str(i), p, {}) for i, p in enumerate(PROMPTS)]
    sampling = SamplingConfig(eval_steps=2)
    ev = RewardEvaluator(rewards.score)
    ev.batch = 1  # a generation batch per clip: shards of whole batches are what one process makes
    pairs = ev.pairs(items, 2)
    media = ev.images(family, pairs, sampling)
    assert isinstance(media, SoundingClips) and media.frames.shape == (2, 9, 64, 64, 3)
    sounds = []
    generate_images(family, [it.prompt for it, _ in pairs], [s for _, s in pairs],
                    eval_recipe(sampling, family.semantics.step.value), batch=1, soundtracks=sounds)
    assert media.soundtracks == [wav_bytes(w, r) for w, r in sounds]
    halves = join_samples([ev.images(family, pairs[:1], sampling), ev.images(family, pairs[1:], sampling)])
    assert halves.soundtracks == media.soundtracks and np.array_equal(halves.frames, media.frames)
    got = ev.aggregate(pairs, media)
    want = rewards.score(media.frames, [it.prompt for it, _ in pairs], [{"soundtrack": w} for w in media.soundtracks],
                         ["a", "b"])
    assert got["n"] == 2 and abs(got["reward/clap_score"] - float(want["clap_score"].mean())) < 1e-6


def _ray_worker_decode_writes_the_same_columns(out, workdir):
    """A Ray rollout worker's decode (`decode_rows`, here called in this process: the actor's own
    code) writes the iteration's image, poster and soundtrack column files; committed, they equal
    what the in-process decode stored."""
    import lance

    from pixrl.artifacts.trajectories import TableRef, TrajectoryStore
    from pixrl.engines.ray_workers import RolloutWorker
    from pixrl.stages.inference import load_policy

    _, cfg = load_policy(None, "ltx2-full", str(workdir))
    store = TrajectoryStore(out["table_uri"])
    ref = TableRef(store.uri, store.latest_version())
    cols = ["sample_id", "image", "poster", "soundtrack"]
    before = store.read(ref, out["run_id"], 1, cols)
    reads = store.fragment_reads(ref, out["run_id"], 1)
    worker = RolloutWorker(cfg.model_dump(mode="json"), 0, torch.get_num_threads())  # (it sets this process's threads)
    files, _ = worker.decode_rows(reads, "final_latent")
    after = store.read(store.commit_columns(reads, files), out["run_id"], 1, cols)
    assert lance.dataset(out["table_uri"]).version > ref.version and after.equals(before)


def test_a_soundtrack_is_written_as_16_bit_pcm():
    from pixrl.artifacts.media import wav_bytes

    x = np.stack([np.linspace(-1.5, 1.5, 101), np.sin(np.arange(101) / 5.0)]).astype(np.float32)
    with wave.open(io.BytesIO(wav_bytes(x, 24000))) as w:
        assert (w.getnchannels(), w.getframerate(), w.getnframes()) == (2, 24000, 101)
        pcm = np.frombuffer(w.readframes(101), "<i2").reshape(101, 2).T
    assert np.array_equal(pcm, (np.clip(x, -1, 1) * 32767).round().astype(np.int16))  # clipped beyond ±1
    with pytest.raises(ValueError, match="finite float waveform"):
        wav_bytes(np.full((2, 4), np.nan, np.float32), 24000)


def test_the_presets():
    from pixrl.config.loader import load_config

    cfg = load_config("ltx2_video", ["model.path=/x"])
    m = cfg.model
    assert (m.family, m.size(), m.frames, m.max_sequence_length) == ("ltx2", (512, 768), 49, 1024)
    assert m.family_options() == {"frame_rate": 24.0, "stg_scale": 0.0, "audio_stg_scale": 0.0, "modality_scale": 1.0,
                                  "audio_modality_scale": 1.0}
    assert cfg.sampling.guidance_scale == 3.0 and cfg.algorithm.lora.enabled and m.offload_text_encoders
    distilled = load_config("ltx2_distilled_video", ["model.path=/x"])
    assert len(distilled.model.sigmas) == distilled.sampling.steps == distilled.sampling.eval_steps == 8
    assert distilled.sampling.guidance_scale == 1.0 and distilled.model.family_options()["audio_guidance_scale"] == 1.0
    av = load_config("ltx2_av", ["model.path=/x", "dataset.path=/p.txt"])
    assert av.model.family == "ltx2" and av.reward.weights == {"hpsv2": 1.0, "temporal_consistency": 0.5,
                                                                "clap_score": 1.0}
