"""`pixrl list`: every registered family, algorithm and reward and every preset, each with its
one-line description (a class's own docstring, else its module's; a preset's header comment)."""

import json

from typer.testing import CliRunner

from pixrl.algorithms.base import ALGORITHMS
from pixrl.cli import app
from pixrl.config.loader import available_presets
from pixrl.models.registry import registered_families
from pixrl.rewards.base import REWARDS


def _list(*args):
    res = CliRunner().invoke(app, ["list", *args])
    assert res.exit_code == 0, res.output
    return res


def test_each_kind_lists_every_registered_name_with_its_description():
    for kind, names in (("families", registered_families()), ("algorithms", ALGORITHMS.names()),
                        ("rewards", REWARDS.names()), ("experiments", available_presets("experiment"))):
        items = json.loads(_list(kind, "--json").stdout)
        assert sorted(items) == sorted(names) and all(items.values()), kind
    fams = json.loads(_list("families", "--json").stdout)
    assert fams["flux2_klein"].startswith("FLUX.2 [klein] family") and fams["lumina2"].startswith("Lumina-Image 2.0")
    assert json.loads(_list("algorithms", "--json").stdout)["tempflow_grpo"].startswith("TempFlow-GRPO")
    exps = json.loads(_list("--json").stdout)  # experiments by default
    assert exps["shapes_flow_grpo"].startswith("The default recipe")
    presets = json.loads(_list("presets", "--json").stdout)
    assert "sampling/tempflow_sde" in presets and "model/lumina2" in presets


def test_the_table_keeps_bracketed_names_and_a_bad_kind_is_refused():
    assert "FLUX.2 [klein] family" in " ".join(_list("families").stdout.split())
    res = CliRunner().invoke(app, ["list", "famlies"])
    assert res.exit_code == 2 and "choose one of families, algorithms, rewards" in " ".join(res.output.split())
