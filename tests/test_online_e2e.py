"""End to end: 2 iterations of the real Prefect flow on a tiny random SD3 checkpoint with DDPO's
JPEG-compressibility reward; real Lance, real MLflow (sqlite), real Prefect (test server)."""

import json

import duckdb
import lance
import lancedb
import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401
import pytest
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file
from typer.testing import CliRunner

from conftest import tiny_overrides
from pixrl.cli import app


@pytest.fixture(scope="module")
def trained(tiny_checkpoint, tmp_path_factory, prefect_harness):
    wd = tmp_path_factory.mktemp("e2e")
    args = ["train", "--iterations", "2", "--run", "e2e", "reward=jpeg_compressibility",
            *tiny_overrides(tiny_checkpoint, wd), "sampling.window_size=null", "sampling.window_range=null",  # every step SDE
            "dataset.categories=[counting,colors]"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output + repr(res.exception)
    out = json.loads(res.stdout.strip().splitlines()[-1])
    return wd, out


def test_lance_rows_complete(trained):
    wd, out = trained
    ds = lance.dataset(out["table_uri"])
    t = ds.to_table()
    assert t.num_rows == 2 * 4 * 2  # iterations × G × P
    for it in (0, 1):
        assert ds.count_rows(filter=f"iteration = {it}") == 8
    for name in t.column_names:
        assert t[name].null_count == 0, f"column {name} has nulls"
    assert set(t["policy_version"].to_pylist()) == {0, 1}
    lat = t["latents"].combine_chunks().to_numpy_ndarray()
    assert lat.shape == (16, 3, 4, 8, 8)  # 3 stored steps of 4 (timestep_fraction 0.99)
    # dataset.categories: only those categories' prompts were drawn, and both of them
    assert {json.loads(m)["category"] for m in t["prompt_meta"].to_pylist()} == {"counting", "colors"}
    rewards = {r["name"] for r in t["rewards"][0].as_py()}
    assert rewards == {"jpeg_compressibility"}
    assert np.allclose(t["reward"].to_numpy(), [r[0]["value"] for r in t["rewards"].to_pylist()])
    # readable without pixrl: duckdb scans the Lance dataset directly
    n = duckdb.sql(f"SELECT count(*) FROM ds WHERE run_id = '{out['run_id']}'").fetchall()[0][0]
    assert n == 16


def test_lancedb_opens_the_run_table_and_its_iteration_tags(trained):
    """LanceDB, the query layer users reach for, sees the run's folder as a database whose
    `trajectories` table is pixrl's; a tag checks out the rows as generate wrote them."""
    wd, out = trained
    uri = out["table_uri"]
    db = lancedb.connect(uri.rsplit("/", 1)[0])
    assert "trajectories" in db.list_tables().tables
    table = db.open_table("trajectories")
    rows = table.search().where("iteration = 1 AND reward IS NOT NULL").select(["sample_id", "reward"]).to_arrow()
    assert rows.num_rows == 8
    assert sorted(rows["reward"].to_pylist()) == sorted(
        lance.dataset(uri).to_table(columns=["reward"], filter="iteration = 1")["reward"].to_pylist())
    table.checkout("e2e-it1-generate")  # the run is named e2e
    at_generate = table.to_arrow()
    assert at_generate.num_rows == 16 and "image" in at_generate.column_names
    assert at_generate.filter(pa.compute.equal(at_generate["iteration"], 1))["image"].null_count == 8  # decode came later


def test_mlflow_run_versions_alias_and_config(trained):
    wd, out = trained
    client = MlflowClient(f"sqlite:///{wd / 'mlflow.db'}")
    run = client.get_run(out["run_id"])
    assert run.info.status == "FINISHED"
    for key in ("reward/reward/mean", "reward/jpeg_compressibility/std", "zero_std_ratio", "loss", "approx_kl",
                "clipfrac", "ratio_mean", "ratio_min", "ratio_max", "grad_norm", "lr", "time/generate_s",
                "time/update_s", "images_per_s", "advantage/std", "orchestration_overhead"):
        hist = client.get_metric_history(out["run_id"], key)
        assert sorted(m.step for m in hist) == [0, 1], key
    onpolicy = client.get_metric_history(out["run_id"], "onpolicy_ratio_dev")
    assert all(m.value == 0.0 for m in onpolicy)  # ratio exactly 1 before the first optimizer step
    assert run.data.params["sampling.group_size"] == "4"
    assert run.data.tags["pixrl.family"] == "sd3" and run.data.tags["prefect.flow_run_id"]
    arts = {a.path for a in client.list_artifacts(out["run_id"], "config")}
    assert "config/resolved.yaml" in arts
    versions = client.search_model_versions(f"name='{out['model_name']}'")
    assert sorted(int(v.version) for v in versions) == [1, 2]
    assert int(client.get_model_version_by_alias(out["model_name"], "rollout").version) == 2
    grids = [a.path for a in client.list_artifacts(out["run_id"], "images")]
    assert grids, "sample grids logged"


def test_weights_changed_and_checkpoint_complete(trained, tiny_checkpoint):
    wd, out = trained
    ck = wd / "checkpoints" / "e2e" / out["run_id"] / "it_0001"
    assert {p.name for p in ck.iterdir()} == {"trainable.safetensors", "optimizer.pt", "rng.pt", "counters.json",
                                              "config.json", "manifest.json"}
    new = load_file(str(ck / "trainable.safetensors"))
    base = load_file(str(tiny_checkpoint / "transformer" / "diffusion_pytorch_model.safetensors"))
    changed = [k for k in new if not np.array_equal(new[k].numpy(), base[k].numpy())]
    assert changed, "the update changed no weight"


def test_lora_with_kl_trains_only_the_adapter(tiny_checkpoint, tmp_path, prefect_harness):
    """LoRA via peft: the checkpoint holds adapter tensors only, and the KL to the reference
    (the same transformer with adapters disabled) is computed and logged."""
    wd = tmp_path / "lora"
    res = CliRunner().invoke(app, ["train", "--iterations", "1", "--run", "lora", "algorithm=flow_grpo_lora",
                                   "algorithm.lora.rank=4", "reward=jpeg_compressibility",
                                   *tiny_overrides(tiny_checkpoint, wd)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    out = json.loads(res.stdout.strip().splitlines()[-1])
    ck = wd / "checkpoints" / "lora" / out["run_id"] / "it_0000"
    keys = list(load_file(str(ck / "trainable.safetensors")))
    assert keys and all("lora_" in k for k in keys)
    client = MlflowClient(f"sqlite:///{wd / 'mlflow.db'}")
    kl = client.get_metric_history(out["run_id"], "kl")
    assert len(kl) == 1 and np.isfinite(kl[0].value) and kl[0].value >= 0
    # the run's published version, exported as a diffusers LoRA file (tests/test_model_export.py loads them)
    res = CliRunner().invoke(app, ["export-model", "--run", "lora", "--workdir", str(wd), "--out", str(wd / "lora-v1")])
    assert res.exit_code == 0, res.output
    manifest = json.loads(res.stdout.strip().splitlines()[-1])
    assert manifest["format"] == "diffusers-lora" and manifest["source"]["version"] == 1
    exported = load_file(str(wd / "lora-v1" / "pytorch_lora_weights.safetensors"))
    assert len(exported) == len(keys) and all(k.startswith("transformer.") for k in exported)


def test_prefect_recorded_six_tasks_per_iteration_in_the_train_flow_run(trained):
    """Each iteration is six completed task runs of the train flow run, named by stage and
    iteration (no per-iteration subflow: its bookkeeping cost 1.2 s per iteration)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId, TaskRunFilter
    from prefect.client.schemas.filters import TaskRunFilterFlowRunId

    wd, out = trained
    with get_client(sync_client=True) as client:
        parent = client.read_flow_run(out["flow_run_id"])
        assert parent.state.is_completed()
        subs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent.id])))
        assert subs == []
        tasks = client.read_task_runs(task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[parent.id])))
        stages = ["generate", "decode", "score", "replay", "update", "publish"]
        for it in (0, 1):  # readable in the UI: generate[it=0], ...
            runs = {t.name: t for t in tasks if t.name.endswith(f"[it={it}]") and t.name.split("[")[0] in stages}
            assert sorted(runs) == sorted(f"{s}[it={it}]" for s in stages)
            assert all(t.state.is_completed() for t in runs.values())
        order = [t.name for t in sorted(tasks, key=lambda t: t.start_time) if t.name.split("[")[0] in stages]
        assert order == [f"{s}[it={it}]" for it in (0, 1) for s in stages]


def test_periodic_heldout_evaluation_and_champion_alias(tiny_checkpoint, tmp_path, prefect_harness):
    """run.eval_every: held-out accuracy of the base (step 0) and after every N iterations, with
    the shared evaluation; alias `champion` on the best published version."""
    res = CliRunner().invoke(app, ["train", "-n", "2", "--run", "ev", "reward=jpeg_compressibility",
                                   *tiny_overrides(tiny_checkpoint, tmp_path, **{"run.eval_every": 1,
                                                                                 "run.eval_per_category": 2})])
    assert res.exit_code == 0, res.output
    run_id = json.loads(res.stdout.strip().splitlines()[-1])["run_id"]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    acc = {m.step: m.value for m in client.get_metric_history(run_id, "heldout/accuracy")}
    out = " ".join(res.output.split())  # the terminal shows each evaluation and a before → best → last summary
    for after in (0, 1, 2):
        assert f"held-out after {after} iterations: accuracy {acc[after]:.3f}" in out, res.output
    assert f"held-out (after iterations 0 → best" in out and "→ last 2)" in out
    assert f"accuracy {acc[0]:.3f} → {max(acc.values()):.3f} → {acc[2]:.3f}" in out
    assert "|g|=" in out and "ratio∈[" in out  # the update shows quantities that move, not only GRPO's ~0 loss
    assert sorted(acc) == [0, 1, 2] and all(0.0 <= v <= 1.0 for v in acc.values())
    for cat in ("counting", "position", "color_attr"):
        assert len(client.get_metric_history(run_id, f"heldout/{cat}")) == 3
    champion = int(client.get_model_version_by_alias("pixrl-policy", "champion").version)
    best = max((1, 2), key=lambda v: (acc[v], -v))  # first of the best published versions
    assert champion == best
    for v in (1, 2):  # each evaluated version carries its accuracy, the basis of the comparison
        assert float(client.get_model_version("pixrl-policy", str(v)).tags["heldout_accuracy"]) == acc[v]
    res = CliRunner().invoke(app, ["export-model", "--run", "ev", "--best", "--workdir", str(tmp_path),
                                   "--out", str(tmp_path / "champion")])
    assert res.exit_code == 0, res.output
    manifest = json.loads(res.stdout.strip().splitlines()[-1])
    assert manifest["source"]["version"] == champion and manifest["source"]["alias"] == "champion"
    assert manifest["format"] == "diffusers-pipeline" and (tmp_path / "champion" / "model_index.json").is_file()


def test_prefect_artifacts_per_iteration(trained):
    """The UI shows a reward table (per component, per category), a link to the sample grid
    (logged at that path in MLflow) and a progress bar at 100%."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    wd, out = trained
    with get_client(sync_client=True) as client:
        def latest(key):
            arts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
            return max(arts, key=lambda a: a.created)

        table = latest("e2e-rewards")
        rows = json.loads(table.data) if isinstance(table.data, str) else table.data
        assert {r["group"] for r in rows} == {"component", "category"}
        assert {r["name"] for r in rows if r["group"] == "component"} == {"reward (total)", "jpeg_compressibility"}
        assert "samples/it_0001.png" in latest("e2e-samples").data
        progress = latest("e2e-progress")
        assert float(progress.data) == 100.0
    client = MlflowClient(f"sqlite:///{wd / 'mlflow.db'}")
    assert {a.path for a in client.list_artifacts(out["run_id"], "samples")} == {"samples/it_0000.png",
                                                                               "samples/it_0001.png"}


def test_sample_grid_logged_once_per_iteration(trained):
    """The grid is logged by the iteration's report (after publish), once: a report
    run again (a resumed rollouts run re-reports its iterations) logs nothing twice."""
    from pixrl.artifacts.tracking import Tracker
    from pixrl.config.schema import ExperimentConfig
    from pixrl.run import run_spec
    from pixrl.stages.completion import RunStores
    from pixrl.stages.report import log_sample_grid

    wd, out = trained
    tracker = Tracker(f"sqlite:///{wd / 'mlflow.db'}")
    cfg = ExperimentConfig.model_validate(tracker.read_config(out["run_id"]))
    spec = run_spec(cfg, wd, out["run_id"], out["model_name"])
    assert spec.table_uri == out["table_uri"]
    stores = RunStores(spec, tracker)  # a new process's stores: what it holds is listed from MLflow
    client = MlflowClient(f"sqlite:///{wd / 'mlflow.db'}")
    before = sorted(a.path for a in client.list_artifacts(out["run_id"], "images"))
    assert log_sample_grid(stores, out["run_id"], 1, 4) is False
    assert sorted(a.path for a in client.list_artifacts(out["run_id"], "images")) == before


def test_a_time_budget_ends_the_run_normally_after_the_iteration_it_expires_in(tiny_checkpoint, tmp_path,
                                                                               prefect_harness):
    """run.time_budget_minutes: no iteration starts once the budget is spent; the run then ends
    FINISHED with its last policy evaluated, and the MLflow run says where it stopped."""
    args = ["train", "--iterations", "5", "--run", "budget", "reward=jpeg_compressibility",
            *tiny_overrides(tiny_checkpoint, tmp_path), "run.time_budget_minutes=0.0001", "run.eval_every=3",
            "run.eval_per_category=1"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output + repr(res.exception)
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(lance.dataset(out["table_uri"]).to_table()["iteration"].to_pylist()) == {0}
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.get_run(out["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["pixrl.stopped_by_budget"] == "1"
    assert sorted(m.step for m in client.get_metric_history(out["run_id"], "heldout/accuracy")) == [0, 1]


def test_run_profile_traces_the_chosen_stages(tiny_checkpoint, tmp_path, prefect_harness):
    """run.profile: iteration 1's generate and update leave a Chrome trace and an operator table in
    the run's records and its MLflow artifacts; other iterations and stages leave none."""
    import gzip

    res = CliRunner().invoke(app, ["train", "-n", "2", "--run", "prof", "reward=jpeg_compressibility",
                                   "run.profile.iterations=[1]", *tiny_overrides(tiny_checkpoint, tmp_path)])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    profiles = next((tmp_path / "records" / "prof").glob("*/profiles"))
    assert sorted(p.relative_to(profiles).as_posix() for p in profiles.glob("*/*")) == ["it_0001/generate",
                                                                                         "it_0001/update"]
    trace = json.loads(gzip.decompress((profiles / "it_0001" / "update" / "trace.json.gz").read_bytes()))
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any(n.startswith("aten::") for n in names) and any("Optimizer.step" in n for n in names)
    assert "Self CPU" in (profiles / "it_0001" / "generate" / "operators.txt").read_text()
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    logged = {a.path for a in client.list_artifacts(out["run_id"], "profile/it_0001/update")}
    assert logged == {"profile/it_0001/update/operators.txt", "profile/it_0001/update/trace.json.gz"}
    res = CliRunner().invoke(app, ["train", "-n", "1", "--run", "bad", "run.engine=ray", "run.profile.iterations=[0]",
                                   *tiny_overrides(tiny_checkpoint, tmp_path)])
    assert res.exit_code == 2 and "profile with run.engine=local" in res.output
