"""A fresh MLflow store is a copy of the machine's pre-migrated one (artifacts/mlflow_store.py):
the same schema and revision as a migrated store, experiment 0 made for the current directory,
WAL mode, usable for runs and the registry; a template that is not a store, or one of another
schema revision, is not copied: the store is migrated and the template replaced."""

import sqlite3

import mlflow.store.db.utils as db_utils
import pytest

from pixrl.artifacts import mlflow_store
from pixrl.artifacts.tracking import Tracker


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PIXRL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    migrations = []
    real = db_utils._initialize_tables
    monkeypatch.setattr(db_utils, "_initialize_tables", lambda engine: (migrations.append(engine.url), real(engine)))
    return migrations


def _rows(db, sql):
    con = sqlite3.connect(db)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def _schema(db):
    return sorted(_rows(db, "SELECT type, name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"))


def _store(tmp_path, name):
    db = tmp_path / name / "mlflow.db"
    return db, Tracker(f"sqlite:///{db}")


def test_a_fresh_store_is_a_copy_of_the_first_one_migrated(tmp_path, cache):
    first, _ = _store(tmp_path, "a")
    assert len(cache) == 1  # migrated, and saved as the template
    template = mlflow_store.template_path()
    assert template.is_file() and template.parent == tmp_path / "cache"
    assert _rows(template, "SELECT COUNT(*) FROM experiments") == [(0,)]  # experiment 0 is the directory's

    second, tracker = _store(tmp_path, "b")
    assert len(cache) == 1  # a copy: no migration ran
    assert _schema(second) == _schema(first)
    assert _rows(second, "SELECT version_num FROM alembic_version") == _rows(first, "SELECT version_num FROM alembic_version")
    assert _rows(second, "SELECT experiment_id, name, artifact_location FROM experiments") == \
        _rows(first, "SELECT experiment_id, name, artifact_location FROM experiments") == \
        [(0, "Default", str(tmp_path / "mlruns" / "0"))]
    assert _rows(second, "PRAGMA journal_mode") == [("wal",)]

    run_id = tracker.start_run("exp", "r", {"k": "v"})
    tracker.log_metrics(run_id, {"m": 1.5}, step=3)
    tracker.client.create_registered_model("exp-policy")
    assert tracker.client.get_metric_history(run_id, "m")[0].value == 1.5
    assert [m.name for m in tracker.client.search_registered_models()] == ["exp-policy"]
    assert _rows(template, "SELECT COUNT(*) FROM experiments") == [(0,)]  # the template is untouched


def test_a_template_that_is_not_a_store_is_replaced(tmp_path, cache):
    template = mlflow_store.template_path()
    template.parent.mkdir(parents=True)
    template.write_bytes(b"not a database")
    db, tracker = _store(tmp_path, "a")
    assert len(cache) == 1
    assert tracker.client.search_experiments()[0].name == "Default"
    assert _rows(template, "SELECT COUNT(*) FROM experiments") == [(0,)]


def test_a_template_of_another_schema_revision_is_not_copied_and_is_replaced(tmp_path, cache, caplog):
    _store(tmp_path, "a")
    template = mlflow_store.template_path()
    con = sqlite3.connect(template)
    con.execute("UPDATE alembic_version SET version_num = 'deadbeef0000'")
    con.commit()
    con.close()
    with caplog.at_level("WARNING", logger="pixrl.artifacts.mlflow_store"):
        db, tracker = _store(tmp_path, "b")
    assert "not usable" in caplog.text and "deadbeef0000" in caplog.text
    assert len(cache) == 2  # migrated instead
    assert tracker.start_run("exp", "r", {})
    assert _rows(template, "SELECT version_num FROM alembic_version") == _rows(db, "SELECT version_num FROM alembic_version")
