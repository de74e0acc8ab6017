"""Config layering, presets and error messages."""

import pytest

from pixrl.config.loader import GROUPS, ConfigError, available_presets, compose, flatten, load_config


def test_every_preset_composes_and_validates():
    for exp in available_presets("experiment"):
        raw = compose(exp)
        assert set(GROUPS) - {"dpo"} <= set(raw)  # dpo only in the offline experiments
    for group in GROUPS:
        for name in available_presets(group):
            if name == "sd35_medium":  # needs model.path
                cfg = load_config(None, [f"{group}={name}", "model.path=/somewhere"])
            else:
                cfg = load_config(None, [f"{group}={name}"])
            assert cfg


def test_default_recipe_values():
    cfg = load_config()
    assert cfg.model.path == "builtin:mini_shapes" and cfg.algorithm.name == "flow_grpo"
    assert cfg.reward.weights == {"shapes": 1.0}
    assert cfg.dataset.categories == ["two_object", "counting", "colors", "color_attr"]  # position is unreadable
    flat = flatten(cfg)
    assert flat["sampling.noise_level"] == "0.7" and flat["algorithm.lora.enabled"] == "False"


def test_override_order_and_nested_keys():
    cfg = load_config(None, ["algorithm.lora.rank=4", "algorithm=flow_grpo_lora", "run.seed=3"])
    assert cfg.algorithm.lora.enabled and cfg.algorithm.lora.rank == 4 and cfg.run.seed == 3


def test_yaml_file_experiment(tmp_path):
    f = tmp_path / "exp.yaml"
    f.write_text("defaults:\n  model: mini_shapes\n  sampling: flow_cps_fast\n  algorithm: flow_grpo\n"
                 "  reward: shapes\n  dataset: shapes\n  run: cpu\nrun:\n  iterations: 3\n")
    cfg = load_config(str(f))
    assert cfg.sampling.sde_type == "cps" and cfg.sampling.window_size == 3 and cfg.run.iterations == 3
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.yaml"))


def test_errors_name_key_and_choices():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["sampling.noise_levle=0.5"])
    assert "sampling.noise_levle" in str(e.value) and "sampling.noise_level" in str(e.value)
    with pytest.raises(ConfigError, match="sde_type"):
        load_config(None, ["sampling.sde_type=ddim"])
    with pytest.raises(ConfigError, match="micro_batch"):
        load_config(None, ["sampling.micro_batch=7"])
    with pytest.raises(ConfigError, match="unknown model preset"):
        load_config(None, ["model=sdxl"])
