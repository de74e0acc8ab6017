"""`pixrl setup-mediapipe` and `pixrl setup-vllm` make an environment beside pixrl's: they refuse
pixrl's own environment as the target, and `--dry-run` prints the steps and creates nothing."""

import sys

import pytest
from typer.testing import CliRunner

from pixrl.cli import app


@pytest.mark.parametrize("command", ["setup-mediapipe", "setup-vllm"])
def test_pixrls_own_environment_is_refused(command):
    res = CliRunner().invoke(app, [command, "--venv", sys.prefix])
    assert res.exit_code != 0
    assert "pixrl's own environment" in res.output and "choose another folder" in res.output


@pytest.mark.parametrize("command, package", [("setup-mediapipe", "mediapipe==0.10.21"), ("setup-vllm", "vllm==")])
def test_a_dry_run_prints_the_steps_and_creates_nothing(tmp_path, command, package):
    target = tmp_path / "side"
    res = CliRunner().invoke(app, [command, "--venv", str(target), "--dry-run"])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert f"-m venv {target}" in text and "pip install" in text and package in text
    assert "would be" in text and not target.exists()
