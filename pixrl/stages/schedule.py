"""Which policy samples each iteration (`run.staleness`).

On-policy (N = 0) iteration i samples and updates from the same version: the weights after i
updates. With N > 0 iteration i samples with the weights N updates older — the version iteration
i − N's update started from — while its update still starts from the newest weights. One-step-off
(N = 1, the one-step-off trainers of verl, MM-GRPO and VeRL-Omni) lets the rollout of iteration
i + 1 run on the rollout workers while iteration i scores and trains (stages/rollout_prefetch.py).

The rule is a function of the iteration alone, so a resumed run, a fork and `pixrl replay` sample
from exactly the versions the uninterrupted run did. Since the rows then come from an older
policy than the update's, a log-prob algorithm's old log-probs are recomputed under the update's
weights before its first optimizer step (engines/proximal.py): the clip range bounds the move
from the weights the update starts from, as in an on-policy update.
"""

from __future__ import annotations


class PolicySchedule:
    """The policies the loop's iterations start their updates from, as far back as the sampling
    rule reaches (iteration → PolicyRef dict)."""

    def __init__(self, staleness: int, start: int, start_policy: dict, earlier: dict[int, dict] | None = None):
        self.staleness = staleness
        self._updated_from = {int(k): v for k, v in (earlier or {}).items()}
        self._updated_from[start] = start_policy
        self.start = start

    def published(self, iteration: int, policy: dict) -> None:
        """`iteration` published `policy`: the version iteration + 1's update starts from."""
        self._updated_from[iteration + 1] = policy
        for k in [k for k in self._updated_from if k < iteration + 1 - self.staleness]:
            del self._updated_from[k]  # no later iteration samples with it

    def sampling(self, iteration: int) -> dict:
        """The policy iteration `iteration` samples with: the one iteration − N started from (the
        base weights for the first N iterations)."""
        at = max(0, iteration - self.staleness)
        if at not in self._updated_from:
            raise RuntimeError(f"iteration {iteration} samples with the policy iteration {at}'s update started from "
                               f"(run.staleness={self.staleness}), and this run does not know it; a fork must carry "
                               f"the parent's policies of iterations {at}..{self.start - 1}")
        return self._updated_from[at]
