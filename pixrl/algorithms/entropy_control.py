"""The adaptive entropy coefficient of ReasonGen-R1's Janus recipe: the entropy weight α is
learned so that the policy's token entropy H tracks a target.

α = sinh(ψ) (so α can turn negative — an entropy penalty — when H is above the target), ψ
stepped by Adam on the loss α·(H − H_target) once per optimizer step of the policy, so that α
rises while H < H_target and falls while H > H_target (the sign of SAC's temperature update);
α is clamped to [min, max] after each step (ψ = asinh of the clamped α). The policy's loss adds
−α·H: a bonus while α > 0. ψ and its Adam moments are training
state: they are saved with the optimizer state, so a resumed run continues them exactly.
"""

from __future__ import annotations

import copy
import math

import torch


class AdaptiveEntropyCoefficient:
    def __init__(self, initial: float, target: float, lr: float, min_coeff: float, max_coeff: float):
        self.target, self.min_coeff, self.max_coeff = target, min_coeff, max_coeff
        self.psi = torch.nn.Parameter(torch.tensor(math.asinh(initial), dtype=torch.float64))
        self.opt = torch.optim.Adam([self.psi], lr=lr)

    @property
    def alpha(self) -> float:
        return float(torch.sinh(self.psi.detach()).clamp(self.min_coeff, self.max_coeff))

    def update(self, entropy: float) -> float:
        """One Adam step of ψ on α·(H − target) for the measured mean token entropy H; the new α."""
        self.opt.zero_grad()
        loss = torch.sinh(self.psi) * (float(entropy) - self.target)
        loss.backward()
        self.opt.step()
        with torch.no_grad():
            self.psi.copy_(torch.asinh(torch.sinh(self.psi).clamp(self.min_coeff, self.max_coeff)))
        return self.alpha

    def state_dict(self) -> dict:
        """A snapshot (Adam's state_dict shares its moment tensors with the live optimizer)."""
        return copy.deepcopy({"psi": self.psi.detach(), "optimizer": self.opt.state_dict()})

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            self.psi.copy_(state["psi"])
        self.opt.load_state_dict(copy.deepcopy(state["optimizer"]))
