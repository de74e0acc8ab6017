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
        self._remove = None

    def __enter__(self) -> "StageProgress":
        self._remove = progress.add_reporter(self)
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self._remove:
            self._remove()
            self._remove = None
        self.progress.stop()

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
            extra = f" loss={metrics.get('loss', float('nan')):+.4f} clipfrac={metrics.get('clipfrac', 0):.2f}"
        self._end(iteration, stage, f"{stage} {seconds:.1f}s{extra}")

    def _end(self, iteration: int, stage: str, text: str) -> None:
        self._line[stage] = text
        if stage == self.last_stage:
            self.progress.console.print(f"it {iteration:3d} | " + " | ".join(self._line.values()))
            self._line.clear()
            self.progress.advance(self.task)
