"""Rich live view of the RL loop: one line per iteration with each stage's seconds and reward."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .stages import progress


class StageProgress:
    def __init__(self, console: Console, iterations: int, last_stage: str = "publish"):
        """`last_stage` ends an iteration's line: publish for training, score for `pixrl rollouts`."""
        self.console = console
        self.last_stage = last_stage
        self.progress = Progress(TextColumn("[bold blue]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[stage]}"), TimeElapsedColumn(), console=console,
                                 refresh_per_second=2)  # a redraw wakes a thread: keep it rare beside the compute
        self.task = self.progress.add_task("iterations", total=iterations, stage="")
        self._line: dict[str, str] = {}
        self._rewards: list[float] = []
        self._evals: dict[int, dict] = {}
        self._remove = None

    def __enter__(self) -> "StageProgress":
        self._remove = progress.add_reporter(self)
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """End the live view (once) and print the held-out summary if the run evaluated."""
        if self._remove is None:
            return
        self._remove()
        self._remove = None
        self.progress.stop()
        self.print_summary()

    def stage_started(self, iteration: int, stage: str) -> None:
        self.progress.update(self.task, stage=f"it {iteration}: {stage}…")

    def stage_skipped(self, iteration: int, stage: str) -> None:
        self._end(iteration, stage, f"{stage} (done before)")

    def stage_finished(self, iteration: int, stage: str, seconds: float, metrics: dict) -> None:
        extra = ""
        if stage == "score":
            r = metrics.get("reward/reward/mean", float("nan"))
            self._rewards.append(r)
            recent = self._rewards[-10:]
            extra = f" reward={r:.3f} (mean of last {len(recent)}: {sum(recent) / len(recent):.3f})"
        elif stage == "update":
            extra = " " + update_summary(metrics)
        self._end(iteration, stage, f"{stage} {seconds:.1f}s{extra}")

    def _end(self, iteration: int, stage: str, text: str) -> None:
        self._line[stage] = text
        if stage == self.last_stage:
            self.progress.console.print(f"it {iteration:3d} | " + " | ".join(self._line.values()))
            self._line.clear()
            self.progress.advance(self.task)

    def evaluated(self, after: int, metrics: dict) -> None:
        """A line per held-out evaluation; kept for the before → best → last summary at the end."""
        self._evals[after] = metrics
        acc = metrics.get("heldout/accuracy")
        if acc is None:
            return
        cats = "  ".join(f"{k.split('/', 1)[1]} {v:.3f}" for k, v in sorted(metrics.items())
                         if k.startswith("heldout/") and k not in _NOT_CATEGORIES)
        champ = "  (new champion)" if "heldout/champion_version" in metrics else ""
        self.progress.console.print(f"held-out after {after:3d} iterations: accuracy [bold]{acc:.3f}[/]  {cats}{champ}")

    def print_summary(self) -> None:
        """Held-out accuracy before → best → last, overall and per category, and the champion."""
        evals = {a: m for a, m in sorted(self._evals.items()) if "heldout/accuracy" in m}
        if len(evals) < 2:
            return
        first, last = evals[min(evals)], evals[max(evals)]
        best_after = max(evals, key=lambda a: (evals[a]["heldout/accuracy"], -a))
        keys = ["heldout/accuracy", *sorted(k for k in last if k.startswith("heldout/") and k not in _NOT_CATEGORIES)]
        self.console.print(f"\n[bold]held-out[/] (after iterations {min(evals)} → best {best_after} → last {max(evals)})")
        for k in keys:
            if k in first:
                self.console.print(f"  {k.split('/', 1)[1]:<12} {first[k]:.3f} → {evals[best_after].get(k, float('nan')):.3f}"
                                   f" → {last.get(k, float('nan')):.3f}")
        champs = [(a, m["heldout/champion_version"]) for a, m in evals.items() if "heldout/champion_version" in m]
        if champs:
            a, v = champs[-1]
            self.console.print(f"  champion     version {int(v)} (after {a} iterations): alias `champion`")


_NOT_CATEGORIES = {"heldout/accuracy", "heldout/champion_version", "heldout/n", "heldout/sample_accuracy",
                   "heldout/partial", "heldout/accuracy_ci_low", "heldout/accuracy_ci_high"}


def update_summary(metrics: dict) -> str:
    """What the update did, in quantities that move: GRPO's loss sits near 0 at ratio 1 by
    construction, so the gradient norm, the ratio range and the clipped fraction come first."""
    parts = []
    if "grad_norm" in metrics:
        parts.append(f"|g|={metrics['grad_norm']:.3g}")
    if "ratio_min" in metrics and "ratio_max" in metrics:
        parts.append(f"ratio∈[{metrics['ratio_min']:.4f},{metrics['ratio_max']:.4f}]")
    if "clipfrac" in metrics:
        parts.append(f"clip={metrics['clipfrac']:.2f}")
    if "kl" in metrics:
        parts.append(f"kl={metrics['kl']:.2e}")
    parts.append(f"loss={metrics.get('loss', float('nan')):+.2e}")
    return " ".join(parts)
