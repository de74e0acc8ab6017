"""Shared fixtures: a tiny random SD3 checkpoint in the real diffusers layout, and a Prefect
test harness (temporary SQLite API server) for the flows."""

from pixrl.config.environment import apply_defaults

apply_defaults()

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

TINY_SPEC = dict(image_size=16, vae_channels=(8, 16), latent_channels=4, text_hidden=16, text_layers=2,
                 num_layers=1, heads=2, head_dim=16)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    from pixrl.models.mini.build import MiniSpec, build_random_checkpoint

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("ckpt") / "tiny-sd3"
    return build_random_checkpoint(out, MiniSpec(**TINY_SPEC), seed=0)


@pytest.fixture(scope="session")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def tiny_overrides(ckpt: Path, workdir: Path, **extra) -> list[str]:
    base = {"model.path": str(ckpt), "run.workdir": str(workdir), "sampling.group_size": 4,
            "sampling.prompts_per_iteration": 2, "sampling.micro_batch": 4, "sampling.steps": 4,
            "sampling.eval_steps": 4, "run.eval_every": 0, "sampling.window_size": 2, "sampling.window_range": "[0,2]"}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


@pytest.fixture(scope="session")
def tiny_flux(tmp_path_factory) -> tuple[Path, dict]:
    """A tiny random FLUX.1-dev-shaped checkpoint (`pixrl tiny flux1`) and the overrides that run it."""
    from pixrl.models.flux import FluxFamily

    out = tmp_path_factory.mktemp("ckpt") / "tiny-flux1"
    return out, FluxFamily.write_tiny(out, seed=0)


@pytest.fixture(scope="session")
def tiny_qwen_image(tmp_path_factory) -> tuple[Path, dict]:
    """A tiny random Qwen-Image-shaped checkpoint (`pixrl tiny qwen_image`) and its overrides."""
    from pixrl.models.qwen_image import QwenImageFamily

    out = tmp_path_factory.mktemp("ckpt") / "tiny-qwen-image"
    return out, QwenImageFamily.write_tiny(out, seed=0)
