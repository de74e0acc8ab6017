"""Stable Diffusion 1.x / 2.x family: diffusers UNet2DConditionModel (ε- or v-prediction) +
AutoencoderKL + a DDPM noise schedule + one CLIP text encoder (StableDiffusionPipeline).

The model is a variance-preserving diffusion model, x_t = √ᾱ_t·x0 + √(1 − ᾱ_t)·ε, which every
stage of pixrl steps as the flow it is equivalent to: σ = √(1 − ᾱ)/(√ᾱ + √(1 − ᾱ)) and the flow
latent n(σ)·x_t (`flow_sde.vp_norm`), whose velocity ε − x0 comes from the model's own ε and
x̂0 (exact algebra, `velocity`). The Euler ODE step on that grid is the DDIM step (η = 0), so
evaluation equals StableDiffusionPipeline with a DDIMScheduler; the `ddim` kernel is DDPO's
DDIM-η step with its log-prob in the model's own coordinates (algorithms.md §10); and the flow
kernels (Flow-GRPO's SDE, CPS) apply as on any flow. The sampler draws ε for x_T and hands the
decoder x_vp at the grid's end (`variance_preserving`), so rollouts are the pipeline's latents.

The grid is the one DDIMScheduler (built from the checkpoint's scheduler config, as ddpo-pytorch
does; SD1.5 ships a PNDMScheduler) steps: its timesteps, then ᾱ of the last step's target — 1
with `set_alpha_to_one`, else ᾱ_0 (SD: the final σ is ≈ 0.028, as the pipeline's output is).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .base import ModelLoadError
from .pipelines import PipelineFamily, encodes_text
from .registry import register_family
from .taxonomy import Action, PolicySemantics, PolicyStep, Regime

__all__ = ["SDConditioning", "SD15Family"]


@dataclass
class SDConditioning:
    """The CLIP text encoder's per-token embeddings [B, 77, D] (SD has no pooled input)."""

    prompt_embeds: torch.Tensor

    def select(self, idx) -> "SDConditioning":
        return SDConditioning(self.prompt_embeds[idx])

    def expand(self, n: int) -> "SDConditioning":
        return SDConditioning(self.prompt_embeds.expand(n, -1, -1))


def sigma_of_alpha_bar(alpha_bar: torch.Tensor) -> torch.Tensor:
    """The flow noise level of ᾱ: √(1 − ᾱ)/(√ᾱ + √(1 − ᾱ)) (float64 in, as the schedule keeps it)."""
    a, b = alpha_bar.sqrt(), (1 - alpha_bar).sqrt()
    return b / (a + b)


@register_family("sd15")
class SD15Family(PipelineFamily):
    """A loaded StableDiffusionPipeline checkpoint (SD1.4/1.5, SD2.x with v-prediction)."""

    name = "sd15"
    pipeline_class = "StableDiffusionPipeline"
    semantics = PolicySemantics(regime=Regime.full_sequence, step=PolicyStep.denoise, action=Action.continuous)
    denoiser = "unet"
    # the attention projections (diffusers' LoRA training scripts; DDPO's LoRAAttnProcessor)
    lora_targets = ["to_k", "to_q", "to_v", "to_out.0"]
    guidance = "cfg"
    text_tokens = (0, 77)  # CLIP always reads its 77 tokens; model.max_sequence_length is not used
    variance_preserving = True  # the sampler enters with n(σ0)·ε and hands the decoder x/n(σ_T)

    #: the DDIM class whose ᾱ table and grid rollouts step (CogVideoX's own shifts its SNR)
    ddim_class = "DDIMScheduler"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        import diffusers

        config = self.scheduler.config
        if config.get("thresholding"):
            raise ModelLoadError(f"{self.path!r}: its scheduler thresholds x̂0 (thresholding: true), which no "
                                 f"Gaussian step with a log-prob can follow; set it false in "
                                 f"scheduler/scheduler_config.json (SD1.x/2.x ship it false)")
        # no clipping of x̂0: StableDiffusionPipeline itself resets a clip_sample of its scheduler to
        # false, and PNDM (SD1.5's shipped scheduler) has none
        self.ddim = getattr(diffusers, self.ddim_class).from_config(config, clip_sample=False)
        table = self.ddim.alphas_cumprod.double()
        self._alpha_bar = table
        self._log_snr = (table / (1 - table)).log()  # decreasing in t
        self._on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self.prediction_type = self.ddim.config.prediction_type
        if self.prediction_type not in ("epsilon", "v_prediction", "sample"):
            raise ModelLoadError(f"{self.path!r}: scheduler prediction_type {self.prediction_type!r} is not one the "
                                 f"sd15 family converts (epsilon, v_prediction, sample)")

    @classmethod
    def load(cls, path: str | Path, dtype: str = "float32", device: str = "cpu", max_sequence_length: int = 77,
             resolution: int | tuple | None = None, frames: int | None = None, trainable_device: str | None = None,
             text_towers: bool = True, **options) -> "SD15Family":
        return super().load(path, dtype, device, max_sequence_length, resolution, frames, trainable_device,
                            text_towers, **options)

    @classmethod
    def check_options(cls, path: Path, options: dict, sampling) -> None:
        """Preflight: DDPO's DDIM-η stored onto the grid's last step, when the checkpoint's table
        ends at ᾱ = 1 (σ = 0: `set_alpha_to_one`, CogVideoX) — a deterministic step without a
        log-prob, refused before anything runs rather than at the first rollout."""
        import diffusers

        from ..algorithms.recipe import trained_step_count, window_bounds

        if sampling.sde_type != "ddim":
            return
        config = getattr(diffusers, cls.ddim_class).load_config(str(Path(path) / "scheduler"))
        ddim = getattr(diffusers, cls.ddim_class).from_config(config)
        if float(ddim.final_alpha_cumprod) < 1.0:
            return
        last = sampling.steps - 1
        reaches = window_bounds(sampling)[1] > last if sampling.window_size else trained_step_count(sampling) > last
        if reaches:
            raise ModelLoadError(f"sampling.sde_type=ddim: the scheduler of {str(path)!r} ends its grid at ᾱ = 1 "
                                 f"(σ = 0), where step {last}'s DDIM-η transition is deterministic and has no "
                                 f"log-prob; store fewer steps (sampling.timestep_fraction < 1, e.g. "
                                 f"{last / sampling.steps:.2f}, or a window_range ending before {last})")

    @staticmethod
    def default_resolution(pipe) -> int:
        return pipe.unet.config.sample_size * pipe.vae_scale_factor

    @staticmethod
    def resolution_multiple(pipe) -> int:
        return pipe.vae_scale_factor

    def describe(self) -> dict:
        return {"resolution": [self.height, self.width], "guidance": self.guidance,
                "prediction_type": self.prediction_type, "timestep_spacing": self.ddim.config.timestep_spacing,
                "final_alpha_bar": float(self.ddim.final_alpha_cumprod)}

    # --- conditioning -------------------------------------------------------------------------
    @encodes_text
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> SDConditioning:
        embeds, _ = self.pipe.encode_prompt(prompts, self.device, 1, False)
        return SDConditioning(embeds)

    # --- the DDPM schedule as a flow grid -----------------------------------------------------
    def schedule(self, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(σ [T+1], DDPM timesteps [T]) of the DDIM steps: σ_k of ᾱ at each timestep, then of the
        last step's target ᾱ (the scheduler's final_alpha_cumprod)."""
        from copy import deepcopy

        sched = deepcopy(self.ddim)
        sched.set_timesteps(steps)
        ts = sched.timesteps.long()
        jump = sched.config.num_train_timesteps // steps
        targets = ts - jump
        if any(int(t) != int(n) for t, n in zip(targets[:-1], ts[1:])):
            raise ValueError(f"the DDIM grid of {steps} steps ({sched.config.timestep_spacing!r} spacing) steps "
                             f"from each timestep to t − {jump}, which is not the next timestep of its grid; "
                             f"choose a step count that divides {sched.config.num_train_timesteps}")
        final = torch.tensor([float(sched.final_alpha_cumprod)], dtype=torch.float64)
        alpha_bar = torch.cat([self._alpha_bar[ts], final])
        sigmas = sigma_of_alpha_bar(alpha_bar).float()
        return sigmas.to(self.device), ts.float().to(self.device)

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(ᾱ, log-SNR) over the training timesteps (float64) on `device`: the per-step lookups
        of `velocity` stay on the model's device, with no copy to host in a rollout's loop."""
        if device not in self._on_device:
            self._on_device[device] = (self._alpha_bar.to(device), self._log_snr.to(device))
        return self._on_device[device]

    def alpha_bar_at(self, t: torch.Tensor) -> torch.Tensor:
        """ᾱ at DDPM timesteps t (float64, on t's device): the table at integers, log-SNR linear between them."""
        alpha_bar, log_snr = self._tables(t.device)
        t = t.double().clamp(0, len(log_snr) - 1)
        lo = t.floor().long()
        hi = torch.clamp(lo + 1, max=len(log_snr) - 1)
        w = t - lo
        between = torch.sigmoid(log_snr[lo] * (1 - w) + log_snr[hi] * w)
        return torch.where(w == 0, alpha_bar[lo], between)

    def timesteps_at(self, sigma: torch.Tensor) -> torch.Tensor:
        """The continuous DDPM timestep of flow noise levels σ (the inverse of `alpha_bar_at`):
        log-SNR 2·log((1 − σ)/σ) located in the table. A zero-terminal-SNR table (CogVideoX) ends
        at log-SNR −∞: σ = 1 is its last timestep, and between its last two the earlier one."""
        s = sigma.double().cpu()
        target = 2 * ((1 - s) / s).log()
        desc = -self._log_snr  # increasing in t
        hi = torch.searchsorted(desc, -target).clamp(1, len(desc) - 1)
        lo = hi - 1
        w = torch.nan_to_num(((-target) - desc[lo]) / (desc[hi] - desc[lo]), nan=1.0)  # ∞/∞: σ = 1 at the end
        return (lo.double() + w.clamp(0, 1)).float().to(sigma.device)

    def training_noise_levels(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """σ of t drawn uniform over the training timesteps, as DiffusionDPO draws them
        (`torch.randint(0, num_train_timesteps)`): DPO's and SFT's `timesteps=ddpm`."""
        t = torch.randint(0, len(self._alpha_bar), (n,), generator=generator, device=generator.device)
        return sigma_of_alpha_bar(self._alpha_bar[t.cpu()]).float().to(generator.device)

    def prediction_error_weight(self, sigma: torch.Tensor) -> torch.Tensor:
        """The factor that turns a squared velocity error at x_σ into the model's own: ε − ε̂ =
        (1 − σ)(v − v̂); v-prediction's v_t − v̂_t = n(σ)(v − v̂); x0's x̂0 − x0 = σ(v − v̂)."""
        from ..algorithms.flow_sde import vp_norm

        s = sigma.float()
        factor = {"epsilon": 1 - s, "v_prediction": vp_norm(s), "sample": s}[self.prediction_type]
        return factor**2

    def latent_shape(self) -> tuple[int, int, int]:
        h, w = self.latent_grid(self.pipe.vae_scale_factor)
        return self.transformer.config.in_channels, h, w

    # --- the flow velocity of the UNet's prediction -------------------------------------------
    def velocity(self, x: torch.Tensor, timestep: torch.Tensor, cond: SDConditioning,
                 guidance_scale: float = 1.0, neg: SDConditioning | None = None) -> torch.Tensor:
        """v = ε̂ − x̂0 at the flow latent x = n(σ)·x_t, from the UNet's output at x_t (with the
        pipeline's CFG on one [neg; pos] batch: the conversion is affine, so guiding the output
        guides v)."""
        b = x.shape[0]
        t = timestep.reshape(-1).to(x.device)
        t = t.expand(b) if t.numel() == 1 else t
        alpha_bar = self.alpha_bar_at(t).to(x.device)
        per_row = (-1,) + (1,) * (x.dim() - 1)  # images [B, C, H, W], clips one axis more
        a = alpha_bar.sqrt().float().reshape(per_row)
        s = (1 - alpha_bar).sqrt().float().reshape(per_row)
        x_t = (x.float() * (a + s)).to(self.dtype)
        if guidance_scale > 1.0:
            if neg is None:
                raise ValueError("guidance_scale > 1 needs the negative-prompt conditioning")
            out_u, out_c = self.unet_output(torch.cat([x_t, x_t]), torch.cat([t, t]), neg, cond).chunk(2)
            out = out_u + guidance_scale * (out_c - out_u)
        else:
            out = self.unet_output(x_t, t, cond)
        xf = x_t.float()
        if self.prediction_type == "epsilon":
            eps = out
            x0 = (xf - s * eps) / a
        elif self.prediction_type == "v_prediction":
            eps, x0 = a * out + s * xf, a * xf - s * out
        else:  # "sample"
            x0 = out
            eps = (xf - a * x0) / s
        return (eps - x0).to(x.dtype)

    def unet_output(self, x_t: torch.Tensor, t: torch.Tensor, *conds: SDConditioning) -> torch.Tensor:
        """The UNet's raw prediction (fp32) for x_t, the rows of `conds` stacked in order."""
        embeds = torch.cat([c.prompt_embeds for c in conds])
        return self.transformer(x_t, t, encoder_hidden_states=embeds, return_dict=False)[0].float()

    # --- a tiny random checkpoint in the real layout --------------------------------------------
    @classmethod
    def write_tiny(cls, out_dir: Path, seed: int = 0) -> dict:
        """A random SD1.5-shaped pipeline (cross-attention UNet, CLIP text tower, a VAE with quant
        convs, SD1.5's own PNDMScheduler config) with tiny widths, saved with `save_pretrained`."""
        import shutil

        from diffusers import AutoencoderKL, PNDMScheduler, StableDiffusionPipeline, UNet2DConditionModel

        from .tiny_parts import clip_text_model, clip_tokenizer

        torch.manual_seed(seed)
        build = out_dir.parent / (out_dir.name + "_build")
        tok = clip_tokenizer(build / "tokenizer")
        text = clip_text_model(tok)
        unet = UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
                                    block_out_channels=(16, 32), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
                                    attention_head_dim=4, norm_num_groups=8)
        vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                            up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
                            latent_channels=4, norm_num_groups=8, scaling_factor=0.18215)
        sched = PNDMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000,
                              set_alpha_to_one=False, skip_prk_steps=True, steps_offset=1)
        sched.register_to_config(clip_sample=False)  # as SD1.5's scheduler_config.json lists it
        pipe = StableDiffusionPipeline(vae=vae, text_encoder=text, tokenizer=tok, unet=unet, scheduler=sched,
                                       safety_checker=None, feature_extractor=None, requires_safety_checker=False)
        pipe.save_pretrained(str(out_dir), safe_serialization=True)
        shutil.rmtree(build, ignore_errors=True)
        return {"model.family": cls.name, "model.path": str(out_dir), "model.resolution": 16}
