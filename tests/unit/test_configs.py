"""tpu_configs/ and recipes/: every file loads and validates; typos and bad values are named."""
from pathlib import Path

import pytest
import yaml

from xla_tp.launch import LaunchError, load_recipe, load_topology, recipe_names, topology_names
from xla_tp.launch.model import hf_config, model_shape
from xla_tp.launch.plans import plan_input
from xla_tp.launch.recipe import apply_override, check_for_topology, parse_value

ROOT = Path(__file__).resolve().parents[2]

# The vendor's public figures per chip (HBM GiB, peak bf16 TFLOP/s, bidirectional ICI GB/s; None: not
# stated by the vendor), as the files cite them.
VENDOR = {"v4": (32, 275, None), "v5e": (16, 197, 400), "v5p": (95, 459, 1200), "v6e": (32, 918, 800)}
SLICES = {"v4-8": (4, 1), "v4-16": (8, 2), "v4-32": (16, 4), "v5e-1": (1, 1), "v5e-4": (4, 1), "v5e-8": (8, 1),
          "v5e-16": (16, 4), "v5e-256": (256, 64), "v5p-8": (4, 1), "v5p-16": (8, 2), "v5p-32": (16, 4),
          "v5p-64": (32, 8), "v6e-1": (1, 1), "v6e-4": (4, 1), "v6e-8": (8, 1), "v6e-16": (16, 4),
          "v6e-256": (256, 64), "cpu-4": (4, 1), "cpu-8": (8, 1), "v5e-256x2": (512, 128), "v5p-64x2": (64, 16)}


def test_the_slices_the_issue_lists_exist():
    assert set(topology_names()) == set(SLICES)


@pytest.mark.parametrize("name", sorted(SLICES))
def test_topology_loads_with_vendor_figures(name):
    topo = load_topology(name)
    assert (topo.chips, topo.hosts) == SLICES[name]
    if topo.is_tpu:
        assert (topo.hbm_gib_per_chip, topo.peak_bf16_tflops_per_chip, topo.ici_gbytes_per_s_per_chip) == \
            VENDOR[topo.generation]
        assert topo.source.startswith("https://cloud.google.com/tpu/docs/")
        assert topo.source.split(" ;")[0] in (ROOT / "tpu_configs" / f"{name}.yaml").read_text()  # cited in the file
    else:
        assert topo.env == {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(topo.chips)}


@pytest.mark.parametrize("name, single", [("v5e-256x2", "v5e-256"), ("v5p-64x2", "v5p-64")])
def test_a_multislice_topology_is_slices_of_one_with_data_across_them(name, single):
    multi, one = load_topology(name), load_topology(single)
    assert multi.slices == 2 and one.slices == 1
    assert (multi.chips, multi.hosts) == (2 * one.chips, 2 * one.hosts)
    assert (multi.accelerator, multi.physical_topology, multi.chips_per_host) == \
        (one.accelerator, one.physical_topology, one.chips_per_host)
    assert multi.mesh == {"data": 2, **one.mesh}


def test_topology_typo_names_file_and_field(tmp_path):
    data = yaml.safe_load((ROOT / "tpu_configs" / "v5e-8.yaml").read_text())
    data["hbm_gb_per_chip"] = data.pop("hbm_gib_per_chip")
    bad = tmp_path / "mine.yaml"
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(LaunchError, match=r"mine\.yaml: unknown key 'hbm_gb_per_chip' \(did you mean 'hbm_gib_per_chip'\?\)"):
        load_topology(bad)


@pytest.mark.parametrize("change, message", [
    ({"chips": 6}, "hosts x chips_per_host = 1 x 8 != chips = 6"),
    ({"mesh": {"model": 4}}, "multiplies to 4, but the slice has 8 chips"),
    ({"mesh": {"tensr": 8}}, "unknown axis 'tensr'"),
    ({"physical_topology": "2x2"}, "physical_topology 2x2 has 4 chips, not 8"),
    ({"chips_per_host": "8"}, "chips_per_host: expected int, got '8'"),
    ({"slices": 2}, "slices=2 must be >= 1 and divide hosts=1"),
    ({"slices": 2, "chips": 16, "hosts": 2, "physical_topology": "4x4", "mesh": {"data": 2, "model": 8}},
     "physical_topology 4x4 has 16 chips, not 8 per slice"),
    ({"slices": 2, "chips": 16, "hosts": 2, "physical_topology": "2x4", "mesh": {"fsdp": 2, "model": 8}},
     "data=1 must be a multiple of the 2 slices"),
])
def test_topology_inconsistency_is_named(tmp_path, change, message):
    data = {**yaml.safe_load((ROOT / "tpu_configs" / "v5e-8.yaml").read_text()), **change}
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(LaunchError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_topology(bad)


def test_unknown_topology_and_recipe_list_what_exists():
    with pytest.raises(LaunchError, match=r"unknown topology 'v5p-65' \(did you mean 'v5p-64'\?\); known: cpu-4, cpu-8"):
        load_topology("v5p-65")
    with pytest.raises(LaunchError, match=r"unknown recipe 'llama3-80b'.*known: .*llama3-70b.*tiny-llama-cpu"):
        load_recipe("llama3-80b")


def test_the_recipes_the_issue_lists_exist():
    assert {"tiny-llama-cpu", "llama3-8b", "llama3-8b-v5e", "llama3-70b", "gpt2", "bert", "qwen3"} <= set(recipe_names())


@pytest.mark.parametrize("name", recipe_names())
def test_recipe_loads_and_validates(name):
    recipe = load_recipe(name)
    topo = load_topology(recipe.topology)
    mesh = check_for_topology(recipe, topo)
    config = hf_config(recipe.model, recipe.path)   # every model key is a real field of its config
    shape = model_shape(config)
    assert shape.heads % mesh.get("model", 1) == 0, "the model axis must divide the attention heads"
    assert plan_input(recipe) in ("auto", "hf") or isinstance(plan_input(recipe), dict)
    assert shape.max_positions is None or recipe.seq_len <= shape.max_positions


def test_topologies_the_issue_names_for_the_big_recipes():
    assert load_recipe("llama3-8b").topology == "v6e-8" and load_recipe("llama3-8b-v5e").topology == "v5e-8"
    assert load_recipe("llama3-70b").topology == "v5p-64"
    assert load_recipe("llama3-8b-v5e").model.overrides == load_recipe("llama3-8b").model.overrides  # extends


def test_overrides_are_typed_and_dotted():
    recipe = load_recipe("tiny-llama-cpu", ["steps=7", "optimizer.lr=1e-3", "mesh={data: 4, model: 2}",
                                            "activation_checkpointing=true", "model.overrides.num_hidden_layers=1"])
    assert recipe.steps == 7 and recipe.optimizer.lr == 0.001 and recipe.mesh == {"data": 4, "model": 2}
    assert recipe.activation_checkpointing is True and recipe.model.overrides["num_hidden_layers"] == 1
    assert parse_value("1e-3") == 0.001 and parse_value("8") == 8 and parse_value("bf16") == "bf16"


@pytest.mark.parametrize("overrides, message", [
    (["optimiser.lr=1"], r"unknown key 'optimiser' \(did you mean 'optimizer'\?\)"),
    (["optimizer.learning_rate=1"], r"optimizer: unknown key 'learning_rate'"),
    (["precision=fp16"], r"precision: 'fp16' is not one of fp32, bf16"),
    (["steps=ten"], r"steps: expected int, got 'ten'"),
    (["batch=0"], r"batch: must be > 0, got 0"),
    (["data.kind=text", "data.path=null"], r"data.kind 'text' needs data.path"),
    (["checkpoint.interval=10"], r"checkpoint.interval=10 needs checkpoint.dir"),
    (["plan=megatron"], r"plan 'megatron' is not 'auto', 'hf', a mapping of rules, or an existing YAML plan file"),
    (["steps"], r"override 'steps': write key=value"),
])
def test_bad_recipe_values_are_named(overrides, message):
    with pytest.raises(LaunchError, match=message):
        load_recipe("tiny-llama-cpu", overrides)


def test_recipe_file_typo_names_the_file(tmp_path):
    bad = tmp_path / "mine.yaml"
    bad.write_text("extends: tiny-llama-cpu\nseq_lenght: 64\n")
    with pytest.raises(LaunchError, match=r"mine\.yaml: unknown key 'seq_lenght' \(did you mean 'seq_len'\?\)"):
        load_recipe(bad)


def test_mesh_and_batch_are_checked_against_the_slice():
    topo = load_topology("cpu-8")
    with pytest.raises(LaunchError, match=r"multiplies to 4, but the slice has 8 chips"):
        check_for_topology(load_recipe("tiny-llama-cpu", ["mesh={model: 4}"]), topo)
    with pytest.raises(LaunchError, match=r"batch=6 does not divide over data x fsdp = 4"):
        check_for_topology(load_recipe("tiny-llama-cpu", ["mesh={data: 4, model: 2}", "batch=6"]), topo)
    with pytest.raises(LaunchError, match=r"seq_len=62 does not divide over context = 4 .*use a multiple of 4"):
        check_for_topology(load_recipe("tiny-llama-cpu", ["mesh={context: 4, model: 2}", "seq_len=62"]), topo)
    assert check_for_topology(load_recipe("tiny-llama-cpu", ["mesh={context: 4, model: 2}", "seq_len=64"]),
                              topo) == {"context": 4, "model": 2}


def test_model_typos_are_named():
    with pytest.raises(LaunchError, match=r"LlamaConfig has no field 'hiden_size' \(did you mean 'hidden_size'\?\)"):
        hf_config(load_recipe("tiny-llama-cpu", ["model.overrides.hiden_size=64"]).model, "r.yaml")
    with pytest.raises(LaunchError, match=r"'LlamaConfg' is not a transformers config class \(did you mean 'LlamaConfig'\?\)"):
        hf_config(load_recipe("tiny-llama-cpu", ["model.config=LlamaConfg"]).model, "r.yaml")
    with pytest.raises(LaunchError, match=r"needs a known model_type"):
        hf_config(load_recipe("qwen3", ["model.config.model_type=qwen99"]).model, "r.yaml")


def test_extends_merges_and_override_replaces_a_mapping():
    data = {"mesh": {"data": 2, "model": 4}}
    apply_override(data, "mesh={fsdp: 8}")
    assert data["mesh"] == {"fsdp": 8}
    assert load_recipe("llama3-8b-v5e").checkpoint.interval == load_recipe("llama3-8b").checkpoint.interval
