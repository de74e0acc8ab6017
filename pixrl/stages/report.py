"""What a finished iteration shows: reward statistics per component and per prompt category (the
Prefect UI's reward table) and its sample grid in MLflow."""

from __future__ import annotations

import json

import numpy as np

from ..artifacts.media import animated_png, clip_grid, decode_media, image_grid, png_bytes
from ..artifacts.trajectories import TrajectoryStore


def _row(group: str, name: str, v: np.ndarray) -> dict:
    return {"group": group, "name": name, "n": int(v.size), "mean": round(float(v.mean()), 4),
            "std": round(float(v.std()), 4), "min": round(float(v.min()), 4), "max": round(float(v.max()), 4)}


def reward_report(table: TrajectoryStore, run_id: str, iteration: int) -> list[dict]:
    t = table.dataset().to_table(columns=["rewards", "reward", "prompt_meta"],
                                 filter=f"run_id = '{run_id}' AND iteration = {int(iteration)}")
    comps: dict[str, list[float]] = {}
    for items in t["rewards"].to_pylist():
        for item in items or []:
            comps.setdefault(item["name"], []).append(item["value"])
    total = t["reward"].to_numpy(zero_copy_only=False)
    rows = [_row("component", name, np.asarray(vals, np.float64))
            for name, vals in [("reward (total)", total), *sorted(comps.items())]]
    cats = np.array([json.loads(m).get("category") or "—" for m in t["prompt_meta"].to_pylist()])
    rows += [_row("category", cat, total[cats == cat].astype(np.float64)) for cat in sorted(set(cats))]
    return rows


def grid_path(iteration: int) -> str:
    return f"samples/it_{iteration:04d}.png"


def sound_dir(iteration: int) -> str:
    """Where the grid's soundtracks go: r<row>_c<col>.wav for the cell of prompt row, member col."""
    return f"samples/it_{iteration:04d}_sound"


def log_sample_grid(stores, run_id: str, iteration: int, group_size: int) -> bool:
    """The decoded iteration's sample grid in MLflow — one row per prompt (the first 8), one
    column per group member — in the per-step image viewer (key `samples`) and at
    samples/it_NNNN.png (what the Prefect artifact links to). Clips make an animated grid (APNG at
    the same path, which browsers and MLflow's artifact view play; the image viewer shows its
    first frame). The viewer's copy is at the samples' own resolution (MLflow encodes it at PNG
    level 6 plus a WebP thumbnail: 0.09 s per iteration for the 2× upscaled grid); the file at
    samples/it_NNNN.png is upscaled to ≥ 64 px per sample. Sounding clips' soundtracks go beside it,
    one WAV per cell (`sound_dir`), before the grid. Logged once: False when it already is
    (`RunStores.logged_sample_grids`: one listing per process). Not part of the decode stage's commit:
    the iteration's report logs it after publish, so a resumed run logs a missing grid again."""
    path = grid_path(iteration)
    if path in stores.logged_sample_grids:
        return False
    ref = stores.latest()
    sound = "soundtrack" in stores.table.dataset(ref.version).schema.names
    t = stores.table.read(ref, run_id, iteration, ["image"] + ["soundtrack"] * sound)
    pngs, g = t["image"].to_pylist(), group_size
    shown = min(8, len(pngs) // g) * g
    samples = np.stack([decode_media(b) for b in pngs[:shown]])
    if sound:  # a sounding clip's soundtrack beside the grid, one WAV per cell
        wavs = {f"r{i // g}_c{i % g}.wav": w for i, w in enumerate(t["soundtrack"].to_pylist()[:shown]) if w}
        stores.tracker.log_folder_bytes(run_id, wavs, sound_dir(iteration))
    if samples.ndim == 5:  # clips [N, F, H, W, 3]
        frames = clip_grid(samples, cols=g, scale=max(1, 64 // samples.shape[2]))
        stores.tracker.log_image(run_id, image_grid(samples[:, 0], cols=g), key="samples", step=iteration)
        stores.tracker.log_file_bytes(run_id, animated_png(frames, compress_level=1), path)  # last: the "logged" mark
    else:
        grid = image_grid(samples, cols=g)
        stores.tracker.log_image(run_id, grid, key="samples", step=iteration)
        scaled = image_grid(samples, cols=g, scale=max(1, 64 // samples.shape[1]))
        stores.tracker.log_file_bytes(run_id, png_bytes(scaled, compress_level=1), path)  # last: the "logged" mark
    stores.logged_sample_grids.add(path)
    return True
