"""Records whether a family's RL loop learns, on its tiny random checkpoint (`pixrl tiny FAMILY`)
with the JPEG-compressibility reward (DDPO's classic task: any image model can learn it, so a
flat curve means the family's path — log-probs, replay, update — is wrong, not the task hard):
the run through the real flow, then the reward of held-out prompts at fixed seeds with the ODE
sampler before and after, the train-reward curve, optimizer steps and how far the weights moved.
Writes docs/runs/<name>/ (README table, summary.json, reward_curve.csv/png, config.yaml, train.log).

    .venv/bin/python benchmarks/record_family_learning.py --family flux1 --iterations 40 [key=value ...]

What it shows is the loop at work on that family's real classes and layout, not image quality:
the checkpoint is random and 32 pixels wide.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
HELDOUT = ["a purple hexagon next to a white star", "three orange triangles", "a grey square below a green circle",
           "two yellow stars and a blue circle", "a red triangle on the left of a black square",
           "four small white circles", "a green star above an orange hexagon", "a blue triangle and a red star"]
SEEDS = range(4)


def heldout_reward(cfg_overrides: list[str], run: str | None, workdir: Path) -> float:
    """Mean reward (the run's reward set: JPEG compressibility unless --reward) of the held-out
    prompts × seeds with the eval (ODE) sampler: the base checkpoint (`run` None) or the run's
    newest published version."""
    from pixrl.algorithms.recipe import eval_recipe
    from pixrl.artifacts.media import wav_bytes
    from pixrl.config.loader import load_config
    from pixrl.datasets.shapes.evaluate import generate_images
    from pixrl.engines.policy import TrainablePolicy
    from pixrl.rewards.compose import RewardSet
    from pixrl.stages.inference import load_policy

    if run is None:
        cfg = load_config(None, cfg_overrides)
        policy = TrainablePolicy(cfg)
    else:
        policy, cfg = load_policy(None, run, str(workdir))
    recipe = eval_recipe(cfg.sampling, policy.family.semantics.step.value)
    items = heldout_items(policy.family, workdir)
    prompts = [p for p, _ in items for _ in SEEDS]
    seeds = [10_000 + s for _ in items for s in SEEDS]
    sources = [im for _, im in items for _ in SEEDS] if getattr(policy.family, "needs_images", False) else None
    sounds: list | None = [] if getattr(policy.family, "audio", False) else None
    imgs = generate_images(policy.family, prompts, seeds, recipe, images=sources, soundtracks=sounds)
    metas = [{} for _ in prompts] if sounds is None else [{"soundtrack": wav_bytes(w, r)} for w, r in sounds]
    scores = RewardSet(cfg.reward.weights, cfg.reward.options).score(imgs, prompts, metas,
                                                                     [f"h{i}" for i in range(len(prompts))])
    return float(np.mean(scores["reward"]))


def heldout_items(family, workdir: Path) -> list[tuple[str, bytes | None]]:
    """The held-out (prompt, source image) pairs: the shapes prompts above, or for an editing
    family 8 edits of its own tiny kind on source images never trained on (seed 1)."""
    if not getattr(family, "needs_images", False):
        return [(p, None) for p in HELDOUT]
    from pixrl.datasets.prompts import load_prompt_set
    from pixrl.models.flux_kontext import write_edit_prompts

    folder = workdir / "heldout_edits"
    path = folder / "edits.jsonl" if (folder / "edits.jsonl").is_file() else write_edit_prompts(folder, seed=1, n=8)
    return [(it.prompt, it.image) for it in load_prompt_set(path)]


def curve(workdir: Path, run_id: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    c = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    return sorted((int(m.step), float(m.value)) for m in c.get_metric_history(run_id, "reward/reward/mean"))


def weight_change(workdir: Path, run: str, base: dict) -> float:
    """Relative L2 distance of the last checkpoint's trained tensors from the first's starting point."""
    from safetensors.torch import load_file

    cks = sorted((workdir / "checkpoints" / run).glob("*/it_*"))
    last = load_file(str(cks[-1] / "trainable.safetensors"))
    keys = [k for k in last if k in base]
    num = sum(float((last[k].float() - base[k].float()).pow(2).sum()) for k in keys)
    den = sum(float(base[k].float().pow(2).sum()) for k in keys)
    return (num / den) ** 0.5


def reward_overrides(reward: str, work: Path) -> list[str]:
    """The overrides that score with `reward`; a model reward gets a tiny random checkpoint of its
    released layout under `work` (videoalign: `write_tiny_videoalign`, its visual-quality head —
    DanceGRPO's video reward; clap_score: `write_tiny_clap`, the soundtrack against the prompt)."""
    if reward == "jpeg_compressibility":
        return [f"reward={reward}"]
    if reward == "videoalign":
        from pixrl.rewards.videoalign_tiny import write_tiny_videoalign

        root, base = write_tiny_videoalign(work / "reward")
        return ["reward=videoalign", f"reward.options.videoalign.path={root}", f"reward.options.videoalign.base={base}",
                "reward.options.videoalign.dtype=float32", "reward.options.videoalign.dimensions=[VQ]"]
    if reward == "clap_score":
        from pixrl.rewards.clap_tiny import write_tiny_clap

        return ["reward=clap", f"reward.options.clap_score.path={write_tiny_clap(work / 'reward')}"]
    if reward == "clip_score":
        from pixrl.rewards.clip_tiny import write_tiny_clip

        return ["reward=clip_score", f"reward.options.clip_score.path={write_tiny_clip(work / 'reward', image_size=32)}"]
    sys.exit(f"--reward {reward}: the script records jpeg_compressibility, videoalign, clap_score or clip_score")


def plot(points: list[tuple[int, float]], out: Path, title: str, ylabel: str = "JPEG compressibility") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    it, r = zip(*points)
    k = max(1, len(r) // 10)
    smooth = np.convolve(r, np.ones(k) / k, mode="valid")
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(it, r, alpha=0.4, label="train reward (mean of the iteration)")
    ax.plot(it[k - 1:], smooth, label=f"moving mean of {k}")
    ax.set_xlabel("iteration")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", required=True)
    ap.add_argument("--iterations", type=int, default=40)
    ap.add_argument("--name", default=None, help="docs/runs/<name> (default: family_learning_<family>)")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--two-experts", action="store_true", help="wan: the Wan2.2-A14B layout (`pixrl tiny wan "
                                                                "--two-experts`); model.expert picks the trained one")
    ap.add_argument("--reward", default="jpeg_compressibility", help="jpeg_compressibility, videoalign (a tiny "
                                                                      "random VideoAlign, its VQ head; clips), "
                                                                      "clap_score (a tiny random CLAP; soundtracks) "
                                                                      "or clip_score (a tiny random CLIP; srpo)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    from pixrl.config.environment import apply_defaults
    from pixrl.models.registry import get_family

    apply_defaults()
    name = args.name or f"family_learning_{args.family}"
    work = Path(args.workdir or f"/tmp/pixrl-learn-{args.family}")
    shutil.rmtree(work, ignore_errors=True)
    out = ROOT / "docs" / "runs" / name
    out.mkdir(parents=True, exist_ok=True)
    tiny = get_family(args.family).write_tiny(work / "model", seed=0, **({"two_experts": True} if args.two_experts
                                                                          else {}))
    model = [f"{k}={v}" for k, v in tiny.items()]
    common = [*reward_overrides(args.reward, work), f"run.workdir={work}", "run.eval_every=0", *args.overrides]
    before = heldout_reward([*model, *common], None, work)
    t0 = time.time()
    cmd = [sys.executable, "-m", "pixrl.cli", "train", "--iterations", str(args.iterations), "--run", name, *model, *common]
    with open(out / "train.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ)).returncode
    minutes = (time.time() - t0) / 60
    if rc:
        sys.exit(f"the run failed (rc {rc}); see {out / 'train.log'}")
    summary_line = json.loads((out / "train.log").read_text().strip().splitlines()[-1])
    after = heldout_reward([*model, *common], name, work)
    from safetensors.torch import load_file

    component = get_family(args.family).trained_component({"expert": "low"} if "model.expert=low" in args.overrides
                                                          else {})
    trained = work / "model" / component
    base = load_file(str(next(trained.glob("*.safetensors")))) if trained.is_dir() else {}
    points = curve(work, summary_line["run_id"])
    with open(out / "reward_curve.csv", "w", newline="") as f:
        csv.writer(f).writerows([("iteration", "train_reward"), *points])
    label = "JPEG compressibility" if args.reward == "jpeg_compressibility" else f"{args.reward} (tiny random)"
    plot(points, out / "reward_curve.png", f"{args.family} (tiny random checkpoint), {label}", label)
    r = [v for _, v in points]
    k = max(1, len(r) // 10)
    summary = {"family": args.family, "reward": args.reward, "iterations": len(points), "minutes": round(minutes, 1), "command": cmd[2:],
               "heldout_before": round(before, 4), "heldout_after": round(after, 4),
               "train_first_10pct": round(float(np.mean(r[:k])), 4), "train_last_10pct": round(float(np.mean(r[-k:])), 4),
               "weights_moved_rel_l2": round(weight_change(work, name, base), 5) if base else None,
               "heldout": {"prompts": [p for p, _ in heldout_items(get_family(args.family), work)], "seeds": list(SEEDS)}}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "README.md").write_text(readme(name, args, summary))
    _resolved_config([*model, *common, f"run.iterations={args.iterations}", f"run.name={name}"], out)
    print(json.dumps(summary))


def readme(name: str, args, s: dict) -> str:
    cmd = shlex.join(["benchmarks/record_family_learning.py", "--family", args.family, "--iterations",
                    str(args.iterations), *(["--two-experts"] if args.two_experts else []),
                    *(["--reward", args.reward] if args.reward != "jpeg_compressibility" else []),
                    *(["--name", name] if args.name else []), *args.overrides])
    from pixrl.models.registry import get_family

    fam = get_family(args.family)
    last = {c.split("=", 1)[0]: c.split("=", 1)[1] for c in s["command"] if c.startswith("model.")}  # later wins
    side = last.get("model.resolution", "32")
    if "model.height" in last or "model.width" in last:
        side = f"{last.get('model.height', side)}×{last.get('model.width', side)}"
    swapped = next((c.split("=", 1)[1] for c in s["command"] if c.startswith("algorithm=")), None)
    algo = f"`{swapped}` (the algorithm preset)" if swapped else "Flow-GRPO"
    held = f"prompts, each with a source image (the family {fam.image_use})" if getattr(fam, "needs_images", False) \
        else "prompts"
    return f"""# {name}: does the {args.family} family's RL loop learn? (tiny random checkpoint, CPU)

```bash
.venv/bin/python {cmd}
```

`pixrl tiny {args.family}{' --two-experts' if args.two_experts else ''}` (the real diffusers classes and layout, tiny widths, random weights, {side} px),
{algo} as the default recipe sets it but for the overrides above, {reward_text(args.reward)}, {s['iterations']} iterations through the real flow (Prefect, Lance, MLflow) in {s['minutes']} minutes on
2 CPU cores, {time.strftime('%Y-%m-%d')}. Held-out: {len(s['heldout']['prompts'])} {held} never trained on × {len(SEEDS)} seeds, the eval
(ODE) sampler, the base checkpoint against the run's last published version.

| | held-out reward | train reward (mean of the first / last 10% of iterations) |
|---|---|---|
| before | {s['heldout_before']} | {s['train_first_10pct']} |
| after | **{s['heldout_after']}** | {s['train_last_10pct']} |

- Held-out change {s['heldout_after'] - s['heldout_before']:+.4f}; weights moved {s['weights_moved_rel_l2']} (relative L2 of the
  trained tensors from the checkpoint's); one optimizer update per accumulation group per iteration
  (`train.log`); `reward_curve.csv` / `.png` the train reward per iteration; `config.yaml` the
  resolved config.
- What this shows: the family's log-probs, replay and update move its policy up a reward, on its
  own classes. What it does not: anything about image quality or a real checkpoint (the Runnable
  and Validated rungs at real scale need a GPU).
"""


def reward_text(reward: str) -> str:
    if reward == "jpeg_compressibility":
        return "the JPEG-compressibility\nreward"
    if reward == "clip_score":
        return ("a tiny random CLIP (`write_tiny_clip`: a CLIPModel and its processor in the transformers layout,\n"
                "random weights) scoring each image against its prompt — cos(image, prompt)")
    if reward == "clap_score":
        return ("a tiny random CLAP (`write_tiny_clap`: a ClapModel and its processor in the released layout,\n"
                "random weights) scoring each clip's soundtrack against its prompt — the soundtrack alone")
    return ("a tiny random VideoAlign (`write_tiny_videoalign`: the released layout — a Qwen2-VL base, LoRA, the\n"
            "head at three reward tokens — random weights) scoring whole clips by its visual-quality head as\n"
            "DanceGRPO's video recipe does (`dimensions=[VQ]`, z-normalised)")


def _resolved_config(overrides: list[str], out: Path) -> Path:
    from omegaconf import OmegaConf

    from pixrl.config.loader import load_config

    path = out / "config.yaml"
    path.write_text(OmegaConf.to_yaml(load_config(None, overrides).model_dump(mode="json")))
    return path


if __name__ == "__main__":
    main()
