"""The repo's recipes and TPU topology files are well-formed and consistent."""
import math
from pathlib import Path

import pytest
import yaml

from xla_tp.demo import DEFAULT_RECIPE, PLANS, load_recipe
from xla_tp.mesh import AXIS_ORDER

ROOT = Path(__file__).resolve().parents[1]
TPU_CONFIGS = sorted((ROOT / "tpu_configs").glob("*.yaml"))


@pytest.mark.parametrize("path", TPU_CONFIGS, ids=lambda p: p.stem)
def test_tpu_config_mesh_covers_the_devices(path):
    cfg = yaml.safe_load(path.read_text())
    assert {"accelerator", "devices", "hosts", "topology", "mesh"} <= cfg.keys()
    assert set(cfg["mesh"]) <= set(AXIS_ORDER)
    assert math.prod(cfg["mesh"].values()) == cfg["devices"]
    assert cfg["accelerator"] == "cpu" or math.prod(cfg["topology"]) == cfg["devices"]


def test_default_recipe_loads_and_overrides():
    recipe = load_recipe(DEFAULT_RECIPE, {"mesh": "model=8", "batch": None})
    assert recipe["plan"] in PLANS and recipe["mesh"] == {"model": 8} and recipe["batch"] == 4


def test_recipe_with_unknown_plan_is_refused(tmp_path):
    bad = tmp_path / "r.yaml"
    bad.write_text("plan: zigzag\n")
    with pytest.raises(SystemExit, match="'zigzag'"):
        load_recipe(bad, {})
