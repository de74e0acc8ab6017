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
- `--family qwen_image`: Qwen-Image — the real transformer (60 blocks, 24×128 heads; 20B), the
  real causal VAE; the Qwen2.5-VL text encoder at its real width (3584) with 2 of its 28 layers;
  LoRA r64 as VeRL-Omni trains it. `--layers N` shrinks the transformer (disk: 40 GB at 60).

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


def sd35_medium_pipeline(resolution: int, seed: int, workdir: Path):
    """A random StableDiffusion3Pipeline with SD3.5-Medium's transformer, VAE and CLIP shapes."""
    import torch
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
                           StableDiffusion3Pipeline)
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    from pixrl.models.mini.build import shapes_vocabulary
    from pixrl.models.mini.tokenizer import write_word_tokenizer

    torch.manual_seed(seed)
    tok = write_word_tokenizer(shapes_vocabulary(), workdir / "tokenizer", 77)

    def clip(hidden: int, layers: int, heads: int) -> CLIPTextModelWithProjection:
        return CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=len(tok), hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
            num_attention_heads=heads, projection_dim=hidden, max_position_embeddings=77, hidden_act="gelu",
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))

    transformer = SD3Transformer2DModel(
        sample_size=resolution // 8, patch_size=2, in_channels=16, out_channels=16, num_layers=24,
        attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
        pooled_projection_dim=2048, pos_embed_max_size=384, qk_norm="rms_norm",
        dual_attention_layers=tuple(range(13)))
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
        latent_channels=16, sample_size=resolution, scaling_factor=1.5305, shift_factor=0.0609,
        use_quant_conv=False, use_post_quant_conv=False)
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
        text_encoder=clip(768, 12, 12), tokenizer=tok, text_encoder_2=clip(1280, 32, 20), tokenizer_2=tok,
        text_encoder_3=None, tokenizer_3=None)


def flux1_dev_pipeline(layers: int | None, device: str, workdir: Path):
    """A random FluxPipeline with FLUX.1-dev's transformer and VAE shapes (T5 shortened)."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    from pixrl.models.tiny_parts import clip_text_model, clip_tokenizer, t5_encoder, t5_tokenizer

    tok, tok2 = clip_tokenizer(workdir / "tokenizer"), t5_tokenizer(workdir / "tokenizer_2", 512)
    with torch.device(device):  # 12B parameters: created where they run
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=64, num_layers=layers or 19, num_single_layers=38 if layers is None else 2 * layers,
            attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
            guidance_embeds=True, axes_dims_rope=(16, 56, 56)).to(torch.bfloat16)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512),
                        layers_per_block=2, latent_channels=16, scaling_factor=0.3611, shift_factor=0.1159,
                        use_quant_conv=False, use_post_quant_conv=False)
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                            base_image_seq_len=256, max_image_seq_len=4096)
    return FluxPipeline(scheduler=sched, vae=vae, text_encoder=clip_text_model(tok, hidden=768, layers=12),
                        tokenizer=tok, text_encoder_2=t5_encoder(tok2, d_model=4096, layers=2), tokenizer_2=tok2,
                        transformer=transformer)


def qwen_image_pipeline(layers: int | None, device: str, workdir: Path):
    """A random QwenImagePipeline with Qwen-Image's transformer and VAE shapes (text encoder shortened)."""
    import torch
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)

    from pixrl.models.tiny_parts import qwen2_tokenizer, qwen25_vl_text_encoder

    tok = qwen2_tokenizer(workdir / "tokenizer")
    with torch.device(device):  # 20B parameters: created where they run
        transformer = QwenImageTransformer2DModel(num_layers=layers or 60).to(torch.bfloat16)  # defaults: real shapes
    sched = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                                            base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
                                            time_shift_type="exponential")
    return QwenImagePipeline(scheduler=sched, vae=AutoencoderKLQwenImage(), transformer=transformer, tokenizer=tok,
                             text_encoder=qwen25_vl_text_encoder(tok, hidden=3584, layers=2))


FAMILY_OVERRIDES = {  # what each family's smoke sets beyond the common settings
    "sd3": lambda tiny: ["model.max_sequence_length=0" if tiny else "model.max_sequence_length=256"],
    "flux1": lambda tiny: ["model.max_sequence_length=64" if tiny else "model.max_sequence_length=512",
                           "sampling.guidance_scale=3.5", *([] if tiny else ["algorithm=flow_grpo_lora64"])],
    "qwen_image": lambda tiny: ["model.max_sequence_length=64" if tiny else "model.max_sequence_length=512",
                                "sampling.guidance_scale=4.0", *([] if tiny else ["algorithm=flow_grpo_lora64"])],
}


def build_model(out: Path, tiny: bool, resolution: int, family: str = "sd3", layers: int | None = None,
                device: str = "cpu") -> Path:
    from pixrl.models.mini.build import MiniSpec, build_random_checkpoint, save_pipeline

    if family != "sd3":
        if tiny:
            from pixrl.models.registry import get_family

            get_family(family).write_tiny(out)
            return out
        build = {"flux1": flux1_dev_pipeline, "qwen_image": qwen_image_pipeline}[family]
        pipe = build(layers, device, out.parent)
        return save_pipeline(pipe, out)
    if tiny:
        spec = MiniSpec(image_size=16, vae_channels=(8, 16), latent_channels=4, text_hidden=16, text_layers=2,
                        num_layers=1, heads=2, head_dim=16)
        return build_random_checkpoint(out, spec, seed=0)
    import torch

    pipe = sd35_medium_pipeline(resolution, 0, out.parent)
    pipe.to(torch.bfloat16)
    return save_pipeline(pipe, out)


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
    resolution = 32 if args.tiny and family != "sd3" else None if args.tiny else args.resolution
    cfg = load_config(None, [
        f"model.family={family}", f"model.path={model}", f"model.device={args.device}", f"model.dtype={args.dtype}",
        *FAMILY_OVERRIDES[family](args.tiny), f"model.resolution={'null' if resolution is None else resolution}",
        f"run.workdir={work}", "run.name=gpu-smoke", "run.iterations=1", "run.eval_every=0",
        f"sampling.group_size={args.group_size}", f"sampling.prompts_per_iteration={args.prompts}",
        f"sampling.micro_batch={args.micro_batch}", f"sampling.steps={args.steps}",
        "sampling.window_size=2", "sampling.window_range=[0,4]", "algorithm.optimizer_steps_per_iteration=1",
        "reward=jpeg_compressibility", "dataset.categories=null"])
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    t1 = time.perf_counter()
    out = train(cfg.model_dump(mode="json"), str(work))
    wall = time.perf_counter() - t1
    c = MlflowClient(out["tracking_uri"])
    metrics = c.get_run(out["run_id"]).data.metrics
    res = {"family": family, "device": args.device, "dtype": args.dtype, "tiny": args.tiny, "resolution": args.resolution,
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
    ap.add_argument("--layers", type=int, default=None, help="flux1/qwen_image: fewer transformer blocks")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--resolution", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--workdir", default=None)
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
