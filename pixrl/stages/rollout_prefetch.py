"""The next iteration's rollout, begun early (`run.staleness` ≥ 1 on an engine with rollout
workers): while iteration i scores, computes advantages and trains on the trainer ranks, the
rollout workers already generate iteration i + 1 with the policy the schedule gives it (known
N ≥ 1 iterations ahead, stages/schedule.py).

Nothing of it is visible before iteration i + 1's generate stage: the workers write uncommitted
Lance fragments, which that stage commits as one version exactly as if it had made them itself
(same rows, seeds, policy version and recipe: the rows do not depend on when they were made). A
prefetch that no stage takes (the run ends first, or a later one replaces it) has its fragments
deleted once it finishes (`discard`). A prefetch that failed re-raises in that stage, whose retry then generates in the stage as usual; a
resumed run, whose process holds no prefetch, generates in the stage. The local engine computes
in this process, where a rollout beside the update would only share the same device: it keeps the
schedule and generates in the stage.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable


class RolloutPrefetch:
    """At most one rollout running ahead, keyed by (iteration, model, version)."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pixrl-prefetch")
        self._pending: tuple[tuple, Future, Callable[[tuple], object] | None] | None = None

    def begin(self, key: tuple, work: Callable[[], tuple], discard: Callable[[tuple], object] | None = None) -> None:
        """Run `work` in the background for `key`; an earlier prefetch is dropped. `discard(result)`
        removes what a prefetch wrote if no stage takes it (its uncommitted fragments)."""
        self._drop()
        self._pending = (key, self._pool.submit(work), discard)

    def _drop(self) -> None:
        """Forget the pending prefetch; once it finishes, what it wrote is discarded."""
        if self._pending is None:
            return
        _, future, discard = self._pending
        self._pending = None
        if discard is not None:
            future.add_done_callback(lambda f: None if f.cancelled() or f.exception() else discard(f.result()))

    def pending(self, key: tuple) -> bool:
        return self._pending is not None and self._pending[0] == key

    def take(self, key: tuple) -> tuple | None:
        """The prefetched result for `key` (waiting for it; its error re-raised), or None when no
        prefetch of `key` was begun. Either way, nothing is kept."""
        if not self.pending(key):
            return None
        _, future, _ = self._pending
        self._pending = None
        return future.result()

    def close(self) -> None:
        self._drop()
        self._pool.shutdown(wait=True)
