"""The comparison table of docs/algorithms/README.md, from the recorded runs' summary.json.

Every row is one algorithm's `benchmarks/record_validation.py --minutes 45 --per-category 96`
run of its `shapes_<name>` preset under docs/runs/<run>/ — same reward, prompts, evaluation
seeds and wall-clock budget. A run that is not recorded yet is listed as such, never filled in.

    .venv/bin/python benchmarks/algorithm_table.py            # prints the markdown table
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: algorithm → its recorded run under docs/runs/
ROWS = {
    "flow_grpo": "cmp_flow_grpo",
    "dance_grpo": "cmp_dance_grpo",
    "mix_grpo": "cmp_mix_grpo",
    "mix_grpo_flash": "cmp_mix_grpo_flash",
    "grpo_guard": "cmp_grpo_guard",
    "gardo": "cmp_gardo",
    "flow_dppo": "cmp_flow_dppo",
    "diffusion_nft": "cmp_diffusion_nft",
    "awm": "cmp_awm",
    "dgpo": "cmp_dgpo",
    "v_grpo": "cmp_v_grpo",
    "crd": "cmp_crd",
    "online_dpo": "cmp_online_dpo",
    "ddpo": "cmp_ddpo",
    "tempflow_grpo": "cmp_tempflow_grpo",
    "online_sft": "cmp_online_sft",
}

HEADER = ("| algorithm | held-out before → after (95% CI of after) | rose? | best in-run held-out, 24 per category (iteration) | "
          "train lift | images/s | s/iteration | iterations in budget | machine probe, s (before/after) | recorded | run |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")


def _probe(s: dict) -> str:
    """The machine-speed probe beside the run (benchmarks/machine_probe.py); rows recorded before
    the probe existed show a dash."""
    b, a = s.get("machine_probe_before"), s.get("machine_probe_after")
    if not b and not a:
        return "—"
    return " / ".join(f"{p['probe_s_per_iteration']:.2f}" if p else "—" for p in (b, a))


def row(name: str, run: str) -> str:
    path = ROOT / "docs" / "runs" / run / "summary.json"
    if not path.is_file():
        return f"| {name} | not recorded yet | | | | | | | | | `docs/runs/{run}/` |"
    s = json.loads(path.read_text())
    lo, hi = s.get("heldout_after_ci", [float("nan"), float("nan")])
    rose = "yes" if s.get("heldout_rose") else "**no** (see the run's README)"
    best = (f"{s['heldout_best']:.3f} ({s['heldout_best_iteration']})" if "heldout_best" in s else "—")
    return (f"| {name} | {s['heldout_before']:.3f} → {s['heldout_after']:.3f} ({lo:.3f}–{hi:.3f}) | {rose} | {best} | "
            f"{s['train_lift']:+.3f} | {s.get('images_per_s', float('nan')):.1f} | "
            f"{s.get('seconds_per_iteration', float('nan')):.1f} | {s.get('iterations_done', '—')} | "
            f"{_probe(s)} | {s.get('recorded', '—')} | [{run}](../runs/{run}/) |")


def table() -> str:
    return "\n".join([HEADER, *(row(n, r) for n, r in ROWS.items())])


if __name__ == "__main__":
    print(table())
