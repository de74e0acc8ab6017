"""`run.profile`: torch.profiler over the compute of chosen iterations' stages, so a user can see
where a stage's time goes (which kernels of the denoiser, the VAE, the text towers, the
optimizer) without another tool. Per profiled stage: a Chrome / Perfetto trace (gzipped JSON,
open it in ui.perfetto.dev or chrome://tracing) and the operators with the most self time as a
table, written under the run's records (`profiles/it_<N>/<stage>/`) and logged to its MLflow run
at the same path under `profile/`. A stage the stores show complete (a resumed run) computes
nothing and writes no profile; an existing profile is never overwritten.
"""

from __future__ import annotations

import gzip
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..config.schema import ProfileConfig


@dataclass
class ProfiledStage:
    """Set `keep=False` when the stage computed nothing (found complete): no profile is written."""

    keep: bool = True


class StageProfiler:
    def __init__(self, settings: ProfileConfig, records: Path, log_artifacts=None):
        """`log_artifacts(local_dir, artifact_path)`: where a written profile is also sent (MLflow)."""
        self.settings, self.root, self.log_artifacts = settings, Path(records) / "profiles", log_artifacts

    def wants(self, stage: str, iteration: int) -> bool:
        return iteration in self.settings.iterations and stage.split(".")[0] in self.settings.stages

    @contextmanager
    def stage(self, stage: str, iteration: int):
        """Profile the block when (stage, iteration) is asked for; yields a ProfiledStage."""
        handle = ProfiledStage()
        out = self.root / f"it_{iteration:04d}" / stage
        if not self.wants(stage, iteration) or out.exists():
            yield handle
            return
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=activities, record_shapes=True, profile_memory=True) as prof:
            yield handle
        if handle.keep:
            self._write(prof, out, torch.cuda.is_available())

    def _write(self, prof, out: Path, cuda: bool) -> None:
        """trace.json.gz and operators.txt, written under a temporary name and renamed: complete or absent."""
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
        try:
            raw = staging / "trace.json"
            prof.export_chrome_trace(str(raw))
            with raw.open("rb") as src, gzip.open(staging / "trace.json.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            raw.unlink()
            sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
            (staging / "operators.txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=self.settings.rows))
            staging.rename(out)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        if self.log_artifacts is not None:
            self.log_artifacts(str(out), f"profile/{out.parent.name}/{out.name}")
