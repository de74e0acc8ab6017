"""GPU smoke check: one iteration of the real online flow (Prefect, Lance, MLflow, all six stages)
with a random model of a family's real shapes, at 512², bf16, on `cuda`. Prints per-stage seconds,
images/s and peak memory.

- `--family sd3` (default): SD3.5-Medium — the real transformer (24 MMDiT blocks of 24×64 heads,
  dual attention in the first 13, RMS qk-norm, 16 latent channels, patch 2), the real SD3 VAE and
  CLIP-L/G text towers at their real widths and depths (no T5: the pipeline zero-pads, as SD3 runs
  without it); full fine-tune.
- `--family flux1`: FLUX.1-dev — the real transformer (19 double + 38 single blocks, 24×128 heads,
  guidance embedding; 12B parameters), the real VAE, CLIP-L; T5 at its real width (4096) with 2 of
  its 24 layers; LoRA r64 as flow_grpo trains it.
- `--family flux1_kontext`: FLUX.1-Kontext-dev — FLUX.1-dev's shapes in a FluxKontextPipeline,
  editing 8 random source images (each a further 1024 tokens of the sequence at 512²), guidance
  2.5, LoRA r64.
- `--family qwen_image`: Qwen-Image — the real transformer (60 blocks, 24×128 heads; 20B), the
  real causal VAE; the Qwen2.5-VL text encoder at its real width (3584) with 2 of its 28 layers;
  LoRA r64 as VeRL-Omni trains it. `--layers N` shrinks the transformer (disk: 40 GB at 60).
- `--family sana`: SANA-1600M — the real linear-attention transformer and DC-AE; Gemma-2 at its
  real width with 2 layers; LoRA r64 on both attentions.
- `--family flux2`: FLUX.2-dev — the real transformer (32B) and VAE; Mistral-3 at its real width
  with the 30 layers the pipeline reads (narrow MLP); LoRA r64 on diffusers' FLUX.2 targets.
- `--family wan`: Wan2.1-T2V-1.3B — the real transformer and causal video VAE, 33 frames; UMT5-XXL
  at its real width with 2 layers; LoRA r32 as flow_grpo trains Wan.
- `--family wan_a14b`: Wan2.2-T2V-A14B — two experts of the real width (40×128 heads, FFN 13824)
  switched at boundary_ratio 0.875, CFG 5 / 3; the high-noise expert trains (LoRA r32) with the SDE
  window on its steps. `--layers N` blocks per expert (40 in the real one).
- `--family wan_i2v`: Wan2.1-I2V-14B-480P — the real-width transformer (40×128 heads, FFN 13824,
  36 input channels, CLIP image cross-attention), CLIP ViT-H/14, the causal video VAE, 33 frames
  animating 8 random first frames, CFG 5; LoRA r32. `--layers N` blocks (40 in the real one).
- `--family wan_ti2v`: Wan2.2-TI2V-5B's image-to-video — the real-width 5B transformer (a timestep
  per token) and the Wan2.2 VAE (×16 in space, ×4 in time, 48 channels), 33 frames animating 8
  random first frames held clean, CFG 5; UMT5-XXL at real width with 2 layers; LoRA r32.
- `--family z_image`: Z-Image-Turbo — the real single-stream transformer (30 blocks of width 3840,
  30 heads, its 2 + 2 refiner blocks; 6.2B), the FLUX.1 VAE; Qwen3-4B at its real width (2560)
  with 2 of its 36 layers; the Turbo's sampling without CFG; LoRA r64.
- `--family hunyuan_video`: HunyuanVideo — the real 13B transformer (20 dual + 40 single blocks,
  guidance embedding) and causal video VAE, 33 frames, embedded guidance 6; llava-llama-3's
  language model at its real width with 3 layers, CLIP-L; LoRA r32. `--layers N`: N + 2N blocks.
- `--family skyreels_i2v`: SkyReels-V1-Hunyuan-I2V — HunyuanVideo's shapes with a 32-channel input
  (first-frame latents), true CFG 6, animating 8 random first frames.
- `--family hunyuan_video15`: HunyuanVideo-1.5 — the real 8.3B transformer (54 blocks) and causal
  video VAE, 33 frames, CFG 6; Qwen2.5-VL and ByT5 at their real widths with 2 layers each;
  LoRA r32. `--layers N` blocks.
- `--family hunyuan_video15_i2v`: its image-to-video — the same shapes with SigLIP so400m (729
  image tokens), animating 8 random first frames.
- `--family ltx_video`: LTX-Video 0.9.1 — the real 2B transformer and 0.9.1 VAE (×32 in space,
  ×8 in time, timestep-conditioned decoder), 65 frames, CFG 3, decode at timestep 0.03; T5-XXL at
  its real width with 2 layers; LoRA r32.
- `--family ltx_video_i2v`: its image-to-video — the same shapes animating 8 random first frames
  held clean.
- `--family mochi`: Mochi 1 — the real 10B asymmetric transformer and VAE, 19 frames, CFG 4.5;
  T5-XXL at its real width with 2 layers; LoRA r32. `--layers N` blocks.
- `--family cogvideox`: CogVideoX-5B — the real transformer (42 blocks, rotary) and VAE, 25
  frames, CFG 6 on the DDIM grid of its zero-terminal-SNR table; T5-XXL at its real width with 2
  layers; LoRA r32.
- `--family cogvideox_i2v`: CogVideoX1.5-5B-I2V — its transformer (2-frame patches, 32 input
  channels, `ofs`) animating 8 random first frames, 25 frames, CFG 6.
- `--family pixart_sigma`: PixArt-Σ XL-2 512 — the real DiT (28 blocks, learned variance) and SDXL
  VAE, T5-XXL at its real width with 2 layers, CFG 4.5 on its DDIM grid; LoRA r32.
- `--family sd15`: Stable Diffusion 1.5 — the real UNet (860M), SD VAE and CLIP-L; DDPO's recipe
  (DDIM-η with η = 1 at every step, CFG 5) with its LoRA (rank 4).
- `--family sdxl`: SDXL base — the real UNet (2.6B), VAE, CLIP-L and OpenCLIP-bigG; Flow-GRPO
  with LoRA r32 (`--resolution 1024` for its native size).
- `--family janus_pro`: Janus-Pro-1B — the real decoder, vision tower, VQ-VAE and generation
  head (576 image tokens, 384²), Token-GRPO with CFG 5 on the logits, full fine-tune; `--cot N`
  first samples a chain of thought of up to N text tokens (T2I-R1's reasoning prompt).
- `--family cosmos2`: Cosmos-Predict2-2B-Text2Image — the real transformer (28 blocks of 16×128
  heads, 2B), the Wan2.1 VAE, T5-11B at its real width with 2 of its 24 layers; CFG 8 (the
  pipeline's 7: w = s − 1) against its negative prompt; LoRA r64 on attention and MLP.
- `--family cosmos2_v2w`: Cosmos-Predict2-2B-Video2World given one image — the same widths with
  the condition-mask channel, 33 frames animating 8 random first frames, CFG 8; LoRA r64.
- `--family cosmos25`: Cosmos-Predict2.5-2B Text2World — the 2B DiT with its text projection,
  Cosmos-Reason1 (Qwen2.5-VL-7B) at its width with 2 of its 28 layers, 33 frames, CFG 8; LoRA r64.
- `--family glm_image`: GLM-Image's decoder — the real DiT (30 blocks of 32×128 heads, 7B), ByT5-small
  glyph encoder, a 16-channel VAE; the autoregressive model at GLM-4-9B's width with 2 of its 40
  layers samples each prompt's prior tokens; CFG 1.5 (prior tokens dropped); LoRA r64.
- `--family glm_image_ar`: GLM-Image's autoregressive model (GLM-4-9B's width, 2 of 40 layers)
  trained with Token-GRPO, full fine-tune; 512 tokens per 512² image, rendered by the 7B decoder
  at 10 steps.
- `--family hunyuan_image`: HunyuanImage-2.1 — the real 17B DiT's width (20 + 40 blocks of
  28×128 heads; `--layers N`: N + 2N), the ×32 VAE, Qwen2.5-VL-7B at its width with 2 of its 28
  layers and ByT5-small's width; sampled under its APG guiders (CFG 3.5, APG after step 5, the
  momentum stored with each transition); LoRA r64.
- `--family ltx2`: LTX-2 — the real 19B audio-video DiT (48 blocks; `--layers N` blocks), the
  video VAE, audio VAE and vocoder, the text connectors, Gemma-3-12B at its width with 2 of its 48
  layers; 49 frames at 512×768 with their soundtrack (one joint latent), CFG 3 (audio 7, rescaled
  0.7) without spatio-temporal or modality guidance, as its preset; LoRA r32.
- `--family ltx2_i2v`: its image-to-audio+video — the same shapes animating 8 random first frames
  (re-compressed at CRF 33, held clean) with their soundtracks.
  Builders: benchmarks/real_shapes.py (video: real_shapes_video.py; Cosmos, GLM-Image, HunyuanImage: real_shapes_image.py).

    python benchmarks/gpu_smoke.py [--family F]                       # the check a GPU machine runs
    python benchmarks/gpu_smoke.py --family F --tiny --device cpu     # the same path, tiny (tests run it)

Weights are random (nothing is downloaded); the figures are about memory and speed, not images.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

STAGES = ("generate", "decode", "score", "replay", "update", "publish")


GC = "model.gradient_checkpointing=true"  # as the presets of the 12B–32B DiTs and of Wan's clips set it
VARIANTS = {"wan_a14b": ("wan", {"two_experts": True})}  # a smoke of a family's other layout: (family, tiny options)
FAMILY_OVERRIDES = {  # what each family's smoke sets beyond the common settings
    "sd3": lambda tiny: ["model.max_sequence_length=0" if tiny else "model.max_sequence_length=256"],
    "flux1": lambda tiny: [GC, "model.max_sequence_length=64" if tiny else "model.max_sequence_length=512",
                           "sampling.guidance_scale=3.5", *([] if tiny else ["algorithm=flow_grpo_lora64"])],
    "flux1_kontext": lambda tiny: [GC, "model.max_sequence_length=64" if tiny else "model.max_sequence_length=512",
                                   "sampling.guidance_scale=2.5", *([] if tiny else ["algorithm=flow_grpo_lora64"])],
    "qwen_image": lambda tiny: [GC, "model.max_sequence_length=64" if tiny else "model.max_sequence_length=512",
                                "sampling.guidance_scale=4.0", *([] if tiny else ["algorithm=flow_grpo_lora64"])],
    "qwen_image_edit": lambda tiny: [GC, "model.max_sequence_length=64" if tiny else "model.max_sequence_length=512",
                                     "sampling.guidance_scale=4.0", "sampling.negative_prompt=' '",
                                     *([] if tiny else ["algorithm=flow_grpo_lora64"])],
    "qwen_image21": lambda tiny: [GC, "model.max_sequence_length=64" if tiny else "model.max_sequence_length=512",
                                  "sampling.guidance_scale=4.0", "sampling.negative_prompt=' '",
                                  *([] if tiny else ["algorithm=flow_grpo_lora64"])],
    "qwen_image_edit_plus": lambda tiny: [GC, "model.max_sequence_length=64" if tiny else "model.max_sequence_length=512",
                                          "sampling.guidance_scale=4.0", "sampling.negative_prompt=' '",
                                          *([] if tiny else ["algorithm=flow_grpo_lora64"])],
    "sana": lambda tiny: ["model.max_sequence_length=64" if tiny else "model.max_sequence_length=300",
                          "sampling.guidance_scale=4.5", *([] if tiny else ["algorithm=flow_grpo_lora64"])],
    "flux2": lambda tiny: [GC, "model.offload_text_encoders=true", "model.max_sequence_length=96" if tiny else "model.max_sequence_length=512",
                           "sampling.guidance_scale=4.0", *([] if tiny else ["algorithm=flow_grpo_lora64"])],
    # the window on the high-noise expert's steps: t ≥ 875 for the first 2 of 4 steps, 4 of 10
    "wan_a14b": lambda tiny: [GC, "model.expert=high", "model.guidance_scale_2=3.0", "sampling.window_size=2",
                              "sampling.window_range=[0,2]",
                              "model.max_sequence_length=64" if tiny else "model.max_sequence_length=512",
                              "model.frames=5" if tiny else "model.frames=33", "sampling.guidance_scale=5.0",
                              *([] if tiny else ["algorithm=flow_grpo_wan"])],
    "wan_i2v": lambda tiny: [GC, "model.max_sequence_length=64" if tiny else "model.max_sequence_length=512",
                             "model.frames=5" if tiny else "model.frames=33", "sampling.guidance_scale=5.0",
                             *([] if tiny else ["algorithm=flow_grpo_wan"])],
    "wan_ti2v": lambda tiny: [GC, "model.max_sequence_length=64" if tiny else "model.max_sequence_length=512",
                              "model.frames=5" if tiny else "model.frames=33", "sampling.guidance_scale=5.0",
                              *([] if tiny else ["algorithm=flow_grpo_wan"])],
    "z_image": lambda tiny: [GC, "model.max_sequence_length=64" if tiny else "model.max_sequence_length=512",
                             "sampling.guidance_scale=1.0", *([] if tiny else ["algorithm=flow_grpo_lora64"])],
    "hunyuan_video": lambda tiny: [GC, "model.max_sequence_length=64" if tiny else "model.max_sequence_length=256",
                                   "model.frames=5" if tiny else "model.frames=33", "sampling.guidance_scale=6.0",
                                   *([] if tiny else ["algorithm=flow_grpo_wan"])],
    "skyreels_i2v": lambda tiny: [GC, "model.max_sequence_length=64" if tiny else "model.max_sequence_length=256",
                                  "model.frames=5" if tiny else "model.frames=33", "sampling.guidance_scale=6.0",
                                  *([] if tiny else ["algorithm=flow_grpo_wan"])],
    "hunyuan_video15": lambda tiny: [GC, "model.max_sequence_length=64" if tiny else "model.max_sequence_length=1000",
                                     "model.frames=5" if tiny else "model.frames=33", "sampling.guidance_scale=6.0",
                                     *([] if tiny else ["algorithm=flow_grpo_wan"])],
    "hunyuan_video15_i2v": lambda tiny: [GC, "model.max_sequence_length=64" if tiny else "model.max_sequence_length=1000",
                                     "model.frames=5" if tiny else "model.frames=33", "sampling.guidance_scale=6.0",
                                     *([] if tiny else ["algorithm=flow_grpo_wan"])],
    "ltx_video": lambda tiny: ["model.max_sequence_length=32" if tiny else "model.max_sequence_length=128",
                               "model.frames=9" if tiny else "model.frames=65", "sampling.guidance_scale=3.0",
                               "model.decode_timestep=0.03", "model.decode_noise_scale=0.025",
                               *([] if tiny else [GC, "algorithm=flow_grpo_wan"])],
    "ltx_video_i2v": lambda tiny: ["model.max_sequence_length=32" if tiny else "model.max_sequence_length=128",
                                   "model.frames=9" if tiny else "model.frames=65", "sampling.guidance_scale=3.0",
                                   "model.decode_timestep=0.03", "model.decode_noise_scale=0.025",
                                   *([] if tiny else [GC, "algorithm=flow_grpo_wan"])],
    "ltx2": lambda tiny: [GC, "model.max_sequence_length=32" if tiny else "model.max_sequence_length=1024",
                          "model.frames=9" if tiny else "model.frames=49", "sampling.guidance_scale=3.0",
                          "model.av_guidance.stg_scale=0", "model.av_guidance.audio_stg_scale=0",
                          "model.av_guidance.modality_scale=1", "model.av_guidance.audio_modality_scale=1",
                          *([] if tiny else ["algorithm=flow_grpo_wan"])],
    "ltx2_i2v": lambda tiny: FAMILY_OVERRIDES["ltx2"](tiny),
    "mochi": lambda tiny: [GC, "model.max_sequence_length=32" if tiny else "model.max_sequence_length=256",
                           "model.frames=7" if tiny else "model.frames=19", "sampling.guidance_scale=4.5",
                           *([] if tiny else ["algorithm=flow_grpo_wan"])],
    "cogvideox": lambda tiny: [GC, "model.max_sequence_length=64" if tiny else "model.max_sequence_length=226",
                               "model.frames=9" if tiny else "model.frames=25", "sampling.guidance_scale=6.0",
                               *([] if tiny else ["algorithm=flow_grpo_wan"])],
    "cogvideox_i2v": lambda tiny: [GC, "model.max_sequence_length=64" if tiny else "model.max_sequence_length=226",
                                   "model.frames=9" if tiny else "model.frames=25", "sampling.guidance_scale=6.0",
                                   *([] if tiny else ["algorithm=flow_grpo_wan"])],
    "sd15": lambda tiny: ["algorithm=ddpo", "sampling.sde_type=ddim", "sampling.noise_level=1.0",
                          "sampling.window_size=null", "sampling.window_range=null", "sampling.timestep_fraction=1.0",
                          "sampling.guidance_scale=5.0", "algorithm.min_count=4"],
    "pixart_sigma": lambda tiny: ["model.max_sequence_length=64" if tiny else "model.max_sequence_length=300",
                                  "sampling.guidance_scale=4.5", *([] if tiny else ["algorithm=flow_grpo_lora"])],
    "sdxl": lambda tiny: [GC, "sampling.guidance_scale=5.0", *([] if tiny else ["algorithm=flow_grpo_lora"])],
    "janus_pro": lambda tiny: ["model.max_sequence_length=0", "sampling.guidance_scale=5.0", "algorithm=token_grpo"],
    "cosmos2": lambda tiny: [GC, "model.max_sequence_length=64" if tiny else "model.max_sequence_length=512",
                             "sampling.guidance_scale=8.0", "sampling.window_range=[0,3]",  # off the zero-length last step
                             *([] if tiny else ["algorithm=flow_grpo_lora64"])],
    "cosmos2_v2w": lambda tiny: [GC, "model.max_sequence_length=64" if tiny else "model.max_sequence_length=512",
                                 "model.frames=5" if tiny else "model.frames=33", "sampling.guidance_scale=8.0",
                                 "sampling.window_range=[0,3]", *([] if tiny else ["algorithm=flow_grpo_lora64"])],
    "cosmos25": lambda tiny: [GC, "model.max_sequence_length=64" if tiny else "model.max_sequence_length=512",
                              "model.frames=5" if tiny else "model.frames=33", "sampling.guidance_scale=8.0",
                              *([] if tiny else ["algorithm=flow_grpo_lora64"])],
    "glm_image": lambda tiny: [GC, "model.max_sequence_length=64" if tiny else "model.max_sequence_length=2048",
                               "sampling.guidance_scale=1.5", *([] if tiny else ["algorithm=flow_grpo_lora64"])],
    "hunyuan_image": lambda tiny: [GC, "model.max_sequence_length=64" if tiny else "model.max_sequence_length=1000",
                                   "sampling.guidance_scale=3.5",
                                   *([] if tiny else ["algorithm=flow_grpo_lora64"])],
    "glm_image_ar": lambda tiny: ["algorithm=token_grpo", "sampling.guidance_scale=1.0",
                                  "model.max_sequence_length=64" if tiny else "model.max_sequence_length=2048",
                                  "model.decoder_steps=4" if tiny else "model.decoder_steps=10"],
    "wan": lambda tiny: [GC, "model.max_sequence_length=64" if tiny else "model.max_sequence_length=226",
                         "model.frames=5" if tiny else "model.frames=33", "sampling.guidance_scale=5.0",
                         *([] if tiny else ["algorithm=flow_grpo_wan"])],
}


def build_model(out: Path, tiny: bool, resolution: int, family: str = "sd3", layers: int | None = None,
                device: str = "cpu") -> Path:
    from pixrl.models.mini.build import MiniSpec, build_random_checkpoint, save_pipeline

    if family != "sd3":
        if tiny:
            from pixrl.models.registry import get_family

            variant = VARIANTS.get(family)
            get_family(variant[0] if variant else family).write_tiny(out, **(variant[1] if variant else {}))
            return out
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from real_shapes import BUILDERS, janus_pro_1b_checkpoint

        if family == "janus_pro":  # a transformers checkpoint, not a diffusers pipeline
            return janus_pro_1b_checkpoint(layers, device, out)
        pipe = BUILDERS[family](layers, device, out.parent)
        return save_pipeline(pipe, out)
    if tiny:
        spec = MiniSpec(image_size=16, vae_channels=(8, 16), latent_channels=4, text_hidden=16, text_layers=2,
                        num_layers=1, heads=2, head_dim=16)
        return build_random_checkpoint(out, spec, seed=0)
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from real_shapes import sd35_medium_pipeline

    pipe = sd35_medium_pipeline(resolution, 0, out.parent, layers)
    pipe.to(torch.bfloat16)
    return save_pipeline(pipe, out)


def _cot(args) -> list[str]:
    """A chain of thought of `--cot` tokens (token families); a tiny model's context is too short
    for T2I-R1's reasoning prompt, so the tiny path uses a one-line template."""
    n = getattr(args, "cot", 0)
    if not n:
        return []
    return [f"sampling.cot_tokens={n}", *(['sampling.cot_template="Describe {prompt}:"'] if args.tiny else [])]


def _edits(family: str, work: Path) -> list[str]:
    """An image-conditioned family's prompt set: 8 prompts on random source images (edits, first frames)."""
    from pixrl.models.registry import get_family

    if not getattr(get_family(VARIANTS[family][0] if family in VARIANTS else family), "needs_images", False):
        return []
    from pixrl.models.flux_kontext import write_edit_prompts

    path = write_edit_prompts(work / "edits", seed=0, n=8)
    return ["dataset=edits", f"dataset.path={path}"]


def _reward_gradient(args, work: Path) -> list[str]:
    """`--srpo`: the update is SRPO's (Direct-Align through the VAE decode and a CLIP's image
    tower); `--draft K`: DRaFT-K's (the gradient through the last K sampling steps, the decode and
    the CLIP) — against a random CLIP of ViT-H/14's shapes — HPSv2's and PickScore's — at 224²
    (`--tiny`: the tiny CLIP): the memory and time of a reward-gradient update at real widths."""
    draft = getattr(args, "draft", 0)
    if not getattr(args, "srpo", False) and not draft:
        return []
    from pixrl.rewards.clip_tiny import CLIP_H, write_random_clip, write_tiny_clip

    clip = write_tiny_clip(work / "clip") if args.tiny else write_random_clip(work / "clip", 0, **CLIP_H)
    algo = ["algorithm=draft", f"algorithm.grad_steps={draft}", "algorithm.lora.enabled=false"] if draft else \
        ["algorithm=srpo"]
    return [*algo, "algorithm.reward=clip_score", "reward=clip_score",
            f"reward.options.clip_score.path={clip}", "algorithm.optimizer_steps_per_iteration=1"]


def run(args) -> dict:
    from pixrl.config.environment import apply_defaults

    apply_defaults()
    import torch
    from mlflow.tracking import MlflowClient

    from pixrl.config.loader import load_config
    from pixrl.flows.online import train

    work = Path(args.workdir or tempfile.mkdtemp(prefix="pixrl-gpu-smoke-"))
    t0 = time.perf_counter()
    family = getattr(args, "family", "sd3")
    model = build_model(work / "model", args.tiny, args.resolution, family, getattr(args, "layers", None),
                        args.device)
    build_s = time.perf_counter() - t0
    print(f"built {family}'s model in {build_s:.1f} s: {model}", flush=True)  # progress, for a check stopped at its limit
    resolution = 32 if args.tiny and family != "sd3" else None if args.tiny else args.resolution
    if family == "janus_pro":  # generates at its VQ grid's size
        resolution = None
    cfg = load_config(None, [
        f"model.family={VARIANTS[family][0] if family in VARIANTS else family}", f"model.path={model}",
        f"model.device={args.device}", f"model.dtype={args.dtype}",
        "sampling.window_size=2", "sampling.window_range=[0,4]",  # a family's own window follows
        *FAMILY_OVERRIDES[family](args.tiny), f"model.resolution={'null' if resolution is None else resolution}",
        *([f"model.width={args.width}"] if getattr(args, "width", None) and not args.tiny else []),
        f"run.workdir={work}", "run.name=gpu-smoke", "run.iterations=1", "run.eval_every=0",
        f"sampling.group_size={args.group_size}", f"sampling.prompts_per_iteration={args.prompts}",
        f"sampling.micro_batch={args.micro_batch}", f"sampling.steps={args.steps}",
        "algorithm.optimizer_steps_per_iteration=1",
        "reward=jpeg_compressibility", "dataset.categories=null", *_cot(args), *_edits(family, work),
        *_reward_gradient(args, work), *getattr(args, "set", [])])
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    t1 = time.perf_counter()
    out = train(cfg.model_dump(mode="json"), str(work))
    wall = time.perf_counter() - t1
    c = MlflowClient(out["tracking_uri"])
    metrics = c.get_run(out["run_id"]).data.metrics
    res = {"family": family, "algorithm": cfg.algorithm.name, "cot_tokens": getattr(args, "cot", 0), "device": args.device, "dtype": args.dtype, "tiny": args.tiny, "resolution": args.resolution,
           "width": getattr(args, "width", None),
           "samples": args.group_size * args.prompts, "build_s": round(build_s, 1), "flow_wall_s": round(wall, 1),
           "stage_s": {s: round(metrics[f"time/{s}_s"], 2) for s in STAGES},
           "images_per_s": round(metrics["images_per_s"], 2), "policy_version": out["policy"]["version"]}
    if args.device.startswith("cuda"):
        res["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        res["gpu"] = torch.cuda.get_device_name()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="sd3", choices=sorted(FAMILY_OVERRIDES))
    ap.add_argument("--tiny", action="store_true", help="a tiny random model instead of the family's real shapes")
    ap.add_argument("--layers", type=int, default=None, help="fewer transformer blocks than the real model's")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--resolution", type=int, default=512)
    ap.add_argument("--width", type=int, default=None, help="a non-square size: --resolution is then the height")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--cot", type=int, default=0, help="janus_pro: a chain of thought of at most N text tokens first")
    ap.add_argument("--srpo", action="store_true", help="update with SRPO against a random CLIP of ViT-H/14's shapes "
                                                         "(the reward-gradient path at real widths)")
    ap.add_argument("--draft", type=int, default=0, metavar="K", help="update with DRaFT-K (full fine-tune) against "
                                                                     "that CLIP: the gradient through the last K steps")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a further config override, last (e.g. model.offload_text_encoders=false)")
    args = ap.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            sys.exit("no CUDA device here; run with --tiny --device cpu for the CPU path")
    res = run(args)
    for s in STAGES:
        print(f"{s:>9}: {res['stage_s'][s]:8.2f} s")
    print(f"images/s: {res['images_per_s']}" + (f"  peak memory: {res['peak_memory_gib']} GiB" if "peak_memory_gib" in res else ""))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
