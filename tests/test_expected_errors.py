"""Expected errors (pixrl.errors.ExpectedError) reach the terminal as one line without a traceback,
wherever they are raised — in the CLI or inside a real Prefect flow — unless `pixrl --debug`;
anything else keeps its traceback. `--verbose` turns the libraries' INFO logging back on."""

import logging
import os

import pytest
from prefect import flow, task
from typer.testing import CliRunner

from pixrl.artifacts.archive import ArchiveError
from pixrl.artifacts.tracking import Tracker, default_tracking_uri
from pixrl.cli import app
from pixrl.cli import logs
from pixrl.config.loader import ConfigError
from pixrl.errors import ExpectedError, expected_in_chain


@pytest.fixture
def options(monkeypatch):
    """Restore the CLI's global switches, the environment switches and the library logger levels
    a test changes (later tests start CLI subprocesses that inherit the environment)."""
    saved = (logs.OPTIONS.verbose, logs.OPTIONS.debug)
    levels = {n: logging.getLogger(n).level for n in logs.VERBOSE_LOGGERS}
    for key in logs.VERBOSE_ENV:
        if key in os.environ:
            monkeypatch.setenv(key, os.environ[key])  # restored at teardown, whatever configure() does
        else:  # recorded as absent, then removed: teardown removes whatever configure() sets
            monkeypatch.setenv(key, "")
            monkeypatch.delenv(key)
    yield logs.OPTIONS
    logs.OPTIONS.verbose, logs.OPTIONS.debug = saved
    for n, level in levels.items():
        logging.getLogger(n).setLevel(level)


def _lines(output: str) -> list[str]:
    return [ln for ln in output.splitlines() if ln.strip()]


def test_dpo_from_an_unknown_run_is_one_line_and_exit_2(tmp_path, options):
    wd = tmp_path / "wd"
    Tracker(default_tracking_uri(wd))  # a work directory with an MLflow store but no such run
    res = CliRunner().invoke(app, ["dpo", "--from", "nosuchrun", "--workdir", str(wd)])
    assert res.exit_code == 2, res.output
    assert _lines(res.output) == ["error: no run named 'nosuchrun'; pass run names, experiment:NAME or "
                                  "PATH.lance[@version]"], res.output
    assert not (wd / "locks").exists() and not (wd / "checkpoints").exists()  # nothing started


def test_dpo_from_a_run_in_a_missing_workdir_writes_nothing(tmp_path, options):
    res = CliRunner().invoke(app, ["dpo", "--from", "r1", "--workdir", str(tmp_path / "nowhere")])
    assert res.exit_code == 2 and len(_lines(res.output)) == 1, res.output
    assert "no pixrl work directory" in res.output and "--workdir" in res.output
    assert not (tmp_path / "nowhere").exists()


def test_debug_shows_the_traceback_of_an_expected_error(tmp_path, options):
    wd = tmp_path / "wd"
    Tracker(default_tracking_uri(wd))
    res = CliRunner().invoke(app, ["--debug", "dpo", "--from", "nosuchrun", "--workdir", str(wd)])
    assert res.exit_code == 2
    assert "Traceback" in res.output and "resolve_sources" in res.output and "no run named 'nosuchrun'" in res.output


def test_expected_in_chain_follows_causes_and_contexts():
    try:
        try:
            raise ArchiveError("bad source")
        except ArchiveError as inner:
            raise RuntimeError("task failed") from inner
    except RuntimeError as outer:
        assert isinstance(expected_in_chain(outer), ArchiveError)
    assert expected_in_chain(RuntimeError("plain")) is None and expected_in_chain(None) is None
    assert issubclass(ConfigError, ExpectedError) and issubclass(ConfigError, ValueError)


@task(name="fails-as-told", retries=0, persist_result=False)
def _fails(kind: str) -> None:
    raise ConfigError("run.iterations must be ≥ 1 (got 0); pass --iterations N") if kind == "expected" \
        else ZeroDivisionError("a bug")


@flow(name="pixrl-test-expected-errors", persist_result=False)
def _flow(kind: str) -> None:
    _fails(kind)


@pytest.mark.parametrize("debug", [False, True])
def test_prefect_console_drops_expected_failures_only(prefect_harness, monkeypatch, options, debug):
    """A real flow whose task raises: Prefect's console handler logs each failure with its traceback;
    the CLI's filter drops the records of an expected error (the CLI prints its one line), keeps
    every other failure's traceback, and keeps everything with --debug."""
    import io

    from prefect.logging.handlers import PrefectConsoleHandler

    options.debug = debug
    logs.quiet_expected_failures()
    consoles = [h for h in logging.getLogger().handlers if isinstance(h, PrefectConsoleHandler)]
    assert consoles, "Prefect's console handler is on the root logger"
    buf = io.StringIO()
    for h in consoles:
        monkeypatch.setattr(h.console, "file", buf)
    with pytest.raises(ConfigError):
        _flow("expected")
    out = buf.getvalue()
    if debug:
        assert "Traceback" in out and "ConfigError" in out
    else:
        assert "ConfigError" not in out and "Traceback" not in out, out
    buf.truncate(0)
    with pytest.raises(ZeroDivisionError):
        _flow("bug")
    assert "Traceback" in buf.getvalue() and "ZeroDivisionError: a bug" in buf.getvalue()


def test_verbose_turns_library_info_logging_on(options):
    logs.configure(verbose=True, debug=False)
    assert options.verbose and not options.debug and os.environ["MLFLOW_LOGGING_LEVEL"] == "INFO"
    assert all(logging.getLogger(n).level == logging.INFO for n in ("mlflow", "alembic", "prefect"))
    logs.configure(verbose=False, debug=True)
    assert options.verbose and options.debug  # --debug implies --verbose
