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
        load_config(None, ["sampling.sde_type=heun"])
    with pytest.raises(ConfigError, match="micro_batch"):
        load_config(None, ["sampling.micro_batch=7"])
    with pytest.raises(ConfigError, match="unknown model preset"):
        load_config(None, ["model=sdxl"])


def test_an_sde_window_that_does_not_fit_the_steps_is_refused_at_load():
    """Flow-GRPO-Fast's window is checked with the config, before a run opens or a model loads."""
    ok = load_config(None, ["sampling.steps=4", "sampling.window_size=2", "sampling.window_range=[0,4]"])
    assert ok.sampling.window_range == (0, 4)
    for bad in (["sampling.steps=2", "sampling.window_size=2", "sampling.window_range=[0,4]"],
                ["sampling.steps=10", "sampling.window_size=3", "sampling.window_range=[4,6]"],
                ["sampling.steps=4", "sampling.window_size=3", "sampling.window_range=null"]):  # default: [0, steps // 2]
        with pytest.raises(ConfigError, match=r"sampling.window_range=\[\d+, \d+\] cannot hold a window of \d SDE "
                                              r"steps within sampling.steps=\d+: set window_range"):
            load_config(None, bad)


def test_diffusion_dpo_loss_settings_live_in_the_algorithm_section():
    """Diffusion-DPO's loss (β, σ sampling) is its algorithm's settings; the old dpo.* keys — on a
    command line or in a recorded config — mean the same, and both places set differently is refused."""
    from pixrl.algorithms.base import build_algorithm
    from pixrl.config.schema import ExperimentConfig

    cfg = load_config("shapes_dpo", ["algorithm.beta=50"])
    assert build_algorithm(cfg.algorithm).settings.beta == 50 and "beta" not in cfg.dpo.model_dump()
    old_cli = load_config("shapes_dpo", ["dpo.beta=50", "dpo.timesteps=uniform"])
    assert old_cli.algorithm.model_extra == {**cfg.algorithm.model_extra, "timesteps": "uniform"}
    recorded = load_config("shapes_dpo", []).model_dump(mode="json")  # as a run recorded before the move
    recorded["dpo"]["beta"] = recorded["algorithm"].pop("beta") / 2
    assert ExperimentConfig.model_validate(recorded).algorithm.model_extra["beta"] == 50
    recorded["algorithm"]["beta"] = 60.0
    with pytest.raises(ValueError, match="dpo.beta=50.0 .* disagrees with algorithm.beta=60.0; set only algorithm.beta"):
        ExperimentConfig.model_validate(recorded)
    with pytest.raises(ConfigError, match="algorithm.beta: Input should be greater than 0"):
        build_algorithm(load_config("shapes_dpo", ["algorithm.beta=0"]).algorithm)


def test_a_group_swap_replaces_the_experiment_s_settings_of_that_group():
    """The default experiment narrows dataset.categories; swapping the dataset drops that (the new
    prompt file has its own categories, or none), while a dotted key after the swap still applies."""
    assert load_config().dataset.categories == ["two_object", "counting", "colors", "color_attr"]
    cfg = load_config(None, ["dataset=text_prompts", "dataset.path=/p.txt"])
    assert cfg.dataset.categories is None and cfg.dataset.path == "/p.txt"
    cfg = load_config(None, ["dataset.categories=[counting]", "dataset=shapes"])
    assert cfg.dataset.categories == ["counting"]


def test_a_scattered_window_draws_its_steps_anywhere_in_its_range():
    """UniRL's AllSDEScheduler with num_sde_steps: W distinct steps of window_range, sorted, drawn
    from the iteration's generator (the same iteration, the same steps), stochastic and stored."""
    import numpy as np

    from pixrl.algorithms.recipe import rollout_recipe

    cfg = load_config("flux2_klein_pickscore", ["model.path=/x"])
    s = cfg.sampling
    assert (s.window_size, s.window_range, s.window_shape) == (3, (0, 5), "scattered")
    draws = {rollout_recipe(s, np.random.default_rng(seed)).train_steps for seed in range(40)}
    assert all(len(set(w)) == 3 and list(w) == sorted(w) and set(w) <= set(range(5)) for w in draws)
    assert any(w[-1] - w[0] > 2 for w in draws) and len(draws) > 5  # not one contiguous window
    one = rollout_recipe(s, np.random.default_rng(7))
    assert one == rollout_recipe(s, np.random.default_rng(7)) and one.sde_steps == one.train_steps
    contiguous = load_config(None, ["sampling.steps=10", "sampling.window_size=3", "sampling.window_range=[0,5]"])
    w = rollout_recipe(contiguous.sampling, np.random.default_rng(0)).train_steps
    assert list(w) == list(range(w[0], w[0] + 3))


def test_flow_grpo_can_start_each_group_from_one_latent():
    import numpy as np

    from pixrl.algorithms.base import build_algorithm

    cfg = load_config("flux2_klein_pickscore", ["model.path=/x"])
    assert cfg.algorithm.name == "flow_grpo" and cfg.algorithm.lora.rank == 16
    recipe = build_algorithm(cfg.algorithm).rollout_recipe(cfg.sampling, np.random.default_rng(0), "denoise", 0)
    assert recipe.shared_noise and recipe.sde_type == "dance" and len(recipe.train_steps) == 3
    plain = load_config(None, [])
    assert not build_algorithm(plain.algorithm).rollout_recipe(plain.sampling, np.random.default_rng(0), "denoise",
                                                               0).shared_noise


def test_the_hunyuan_video_experiment_is_dancegrpos_video_recipe():
    """finetune_hunyuan_grpo.sh: 480² × 53 frames, 16 steps, η 0.25, shift 5, guidance 6018/1000,
    24 clips per prompt from one latent, best-of-8, timestep_fraction 0.6, clip 1e-4, lr 1e-5;
    VideoAlign's VQ on clips stored at 8 fps."""
    import numpy as np

    from pixrl.algorithms.base import build_algorithm

    cfg = load_config("hunyuan_video_dance_grpo", ["model.path=/x"])
    m, s, a = cfg.model, cfg.sampling, cfg.algorithm
    assert (m.family, m.resolution, m.frames, m.shift, m.family_options()) == ("hunyuan_video", 480, 53, 5.0,
                                                                                {"shift": 5.0})
    assert (s.steps, s.noise_level, s.sde_type, s.guidance_scale, s.group_size) == (16, 0.25, "dance", 6.0, 24)
    algo = build_algorithm(a)
    assert (algo.settings.best_of, algo.settings.train_fraction, algo.settings.clip_range, a.lr) == (8, 0.6, 1e-4, 1e-5)
    recipe = algo.rollout_recipe(s, np.random.default_rng(0), "denoise", 0)
    assert recipe.shared_noise and recipe.train_steps == tuple(range(15)) and not a.lora.enabled
    assert cfg.reward.weights == {"videoalign": 1.0}  # its VQ head: vq_coef 1, mq_coef 0; clips at --fps 8
    assert (cfg.reward.options["videoalign"]["dimensions"], cfg.reward.options["videoalign"]["clip_fps"]) == (["VQ"], 8)


def test_the_skyreels_experiment_is_dancegrpos_image_to_video_recipe():
    """finetune_skyreels_i2v.sh: 53 frames, 16 steps, η 0.3, cfg_infer 5, 8 per prompt from one latent."""
    cfg = load_config("skyreels_i2v_dance_grpo", ["model.path=/x"])
    m, s = cfg.model, cfg.sampling
    assert (m.family, m.frames, m.shift) == ("skyreels_i2v", 53, None)  # its checkpoint's shift 7
    assert (s.steps, s.noise_level, s.sde_type, s.guidance_scale, s.group_size) == (16, 0.3, "dance", 5.0, 8)
    assert cfg.algorithm.name == "dance_grpo" and cfg.dataset.name == "edits"


def test_a_negative_prompt_is_refused_where_nothing_would_read_it(tiny_flux, tmp_path):
    """Without classifier-free guidance (at load), and on a guidance-distilled family (preflight)."""
    import numpy as np

    from pixrl.algorithms.recipe import eval_recipe, rollout_recipe, with_guidance
    from pixrl.stages.preflight import PreflightError, preflight

    with pytest.raises(ConfigError, match="sampling.negative_prompt='blurry' is only used by classifier-free guidance"):
        load_config(None, ["sampling.negative_prompt=blurry"])
    with pytest.raises(ConfigError, match="sampling.cfg_truncation=0.25 truncates classifier-free guidance"):
        load_config(None, ["sampling.cfg_truncation=0.25"])
    assert load_config(None, ["sampling.negative_prompt="]).sampling.negative_prompt == ""  # null: the empty prompt
    s = load_config(None, ["sampling.negative_prompt=blurry, low quality", "sampling.guidance_scale=3"]).sampling
    assert eval_recipe(s).negative_prompt == "blurry, low quality"
    assert with_guidance(rollout_recipe(s, np.random.default_rng(0)), s).negative_prompt == "blurry, low quality"
    flux = [f"model.path={tiny_flux[0]}", *(f"{k}={v}" for k, v in tiny_flux[1].items()), f"run.workdir={tmp_path}"]
    cfg = load_config(None, [*flux, "sampling.negative_prompt=blurry", "sampling.guidance_scale=3.5"])
    with pytest.raises(PreflightError, match="sampling.negative_prompt: the flux1 family's guidance is embedded.*sd3"):
        preflight(cfg)
    cfg = load_config(None, [*flux, "sampling.cfg_truncation=0.5", "sampling.guidance_scale=3.5"])
    with pytest.raises(PreflightError, match="sampling.cfg_truncation: the flux1 family's guidance is embedded"):
        preflight(cfg)


def test_mix_grpo_flash_refuses_cfg_truncation_on_its_respaced_tail():
    """Before any work: its compressed ODE tail would not be the grid the truncation counts."""
    from pixrl.algorithms.base import build_algorithm

    cfg = load_config(None, ["algorithm=mix_grpo_flash", "sampling.guidance_scale=3", "sampling.cfg_truncation=0.5",
                             "sampling.window_size=null", "sampling.window_range=null"])
    with pytest.raises(ValueError, match="cfg_truncation=0.5 counts the grid's steps.*compress_ratio"):
        build_algorithm(cfg.algorithm).check_sampling(cfg.sampling, "denoise")
