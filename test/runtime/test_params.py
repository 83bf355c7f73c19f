"""Parameters: one table, the YAML file and the launch file agree; bad values are refused."""

import ast
from pathlib import Path

import pytest
import yaml

from deltas_ros.core.config import MemoryConfig
from deltas_ros.core.loader import SHIPPED_MODEL, resolve_pixel_budget
from deltas_ros.runtime import params, params_doc
from deltas_ros.runtime.files import default_memory_dir

REPO = Path(__file__).resolve().parents[2]
GOOD = {"model_path": "/models/qwen"}


def launch_source() -> ast.Module:
    return ast.parse((REPO / "launch" / "deltas.launch.py").read_text())


def test_yaml_lists_every_parameter_with_its_default():
    config = yaml.safe_load((REPO / "config" / "deltas.yaml").read_text())
    values = config["/**"]["ros__parameters"]
    assert values == params.defaults()


def test_issue_named_parameters_exist_with_their_defaults():
    d = params.defaults()
    assert d["image_topic"] == "/camera/image_raw" and d["fps"] == 2.0
    assert d["frames_per_chunk"] == 2 and d["budget_tokens"] == 8192
    assert (d["sink_tokens"], d["window_tokens"], d["buckets"]) == (4, 1024, 4)
    for name in ("compressed", "reliable_qos", "pixel_budget", "model_path", "device", "dtype",
                 "policy", "max_new_tokens", "queue_chunks"):
        assert name in d
    assert params.BY_NAME["model_path"].read_only


def test_launch_file_declares_the_documented_arguments():
    declared = {
        node.args[0].value for node in ast.walk(launch_source())
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "DeclareLaunchArgument"
    }
    assert declared == {"model_path", "image_topic", "params_file", "namespace", "use_sim_time",
                        "autostart", "dashboard"}


def test_launch_file_overrides_only_real_parameters():
    tree = launch_source()
    node_call = next(n for n in ast.walk(tree)
                     if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "LifecycleNode")
    kwargs = {k.arg: k.value for k in node_call.keywords}
    assert kwargs["executable"].value == "memory_node" and kwargs["package"].value == "deltas_ros"
    overrides = next(e for e in kwargs["parameters"].elts if isinstance(e, ast.Dict))
    keys = {k.value for k in overrides.keys}
    assert keys <= set(params.defaults()) | {"use_sim_time"}
    assert "deltas.yaml" in ast.unparse(tree)


def test_defaults_with_a_model_path_are_valid():
    assert params.validate(GOOD) is None


def test_engine_limits_reach_the_memory_config():
    config = params.memory_config(params.defaults() | GOOD | {"max_question_s": 7.5})
    assert config.max_question_s == 7.5


def test_the_second_tier_reaches_the_memory_config_with_its_files_in_memory_dir(tmp_path):
    """Off by default; a disk budget needs no path: its files go under memory_dir (or the
    default memory directory when memory_dir is empty)."""
    assert (params.memory_config(params.defaults() | GOOD).host_budget_mb,
            params.memory_config(params.defaults() | GOOD).recall_tokens) == (0.0, 0)
    tiers = {"host_budget_mb": 64.0, "disk_budget_mb": 512.0, "recall_tokens": 256}
    config = params.memory_config(params.defaults() | GOOD | tiers
                                  | {"memory_dir": str(tmp_path)})
    assert (config.host_budget_mb, config.disk_budget_mb, config.recall_tokens) == (64.0, 512.0,
                                                                                   256)
    assert config.tier_dir == str(tmp_path / "tiers")
    assert params.validate(GOOD | tiers) is None
    assert params.memory_config(params.defaults() | GOOD | tiers).tier_dir == \
        str(default_memory_dir() / "tiers")


def test_empty_model_path_is_the_shipped_model_at_its_pixel_budget():
    assert params.validate({}) is None
    values = params.resolved(params.defaults())
    assert values["model_path"] == str(SHIPPED_MODEL)
    assert params.memory_config(values).pixel_budget == resolve_pixel_budget(0, "")
    assert params.memory_config(values | {"pixel_budget": 4096}).pixel_budget == 4096


@pytest.mark.parametrize("change,reason", [
    ({"pixel_budget": 100}, "pixel_budget must be 0"),
    ({"fps": 0.0}, "fps: must be within [0.1, 30], got 0.0"),
    ({"fps": 2}, "fps: must be a decimal number"),
    ({"frames_per_chunk": 3}, "even"),
    ({"policy": "oracle"}, "policy: must be one of"),
    ({"dtype": "int8"}, "dtype: must be one of"),
    ({"device": "tpu"}, "device must be"),
    ({"budget_tokens": 1000}, "budget_tokens (1000) must be at least"),
    ({"queue_chunks": 0}, "queue_chunks: must be within"),
    ({"image_topic": ""}, "image_topic"),
    ({"host_budget_mb": -1.0}, "host_budget_mb: must be within"),
    ({"disk_budget_mb": 1}, "disk_budget_mb: must be a decimal number"),
    ({"recall_tokens": -5}, "recall_tokens: must be within"),
])
def test_bad_values_are_refused_with_a_reason(change, reason):
    problem = params.validate(GOOD | change)
    assert problem is not None and reason in problem


def test_cuda_index_is_a_valid_device():
    assert params.validate(GOOD | {"device": "cuda:1"}) is None


def test_the_yaml_file_is_the_one_the_table_writes():
    """Descriptions and defaults live in runtime/params.py only: params_doc writes
    config/deltas.yaml (`python -m deltas_ros.runtime.params_doc --yaml`)."""
    assert (REPO / "config" / "deltas.yaml").read_text() == params_doc.render_yaml(), \
        "rewrite it: python -m deltas_ros.runtime.params_doc --yaml > config/deltas.yaml"


def test_the_parameters_page_holds_the_table_the_parameters_write():
    """params_doc writes the table between the page's markers."""
    page = (REPO / "docs" / "parameters.md").read_text()
    assert params_doc.written_table(page) == params_doc.render_markdown(), \
        "replace the table with: python -m deltas_ros.runtime.params_doc --markdown"
    assert all(f"`{p.name}`" in page for p in params.PARAMS)


def test_the_generator_prints_both_forms(capsys):
    assert params_doc.main(["--yaml"]) == 0
    assert capsys.readouterr().out == params_doc.render_yaml()
    assert params_doc.main(["--markdown"]) == 0
    assert capsys.readouterr().out == params_doc.render_markdown()
    assert params_doc.main([]) == 2


def test_a_memory_config_from_a_mapping_refuses_unknown_names():
    assert MemoryConfig.from_mapping({"budget_tokens": 4096}).budget_tokens == 4096
    with pytest.raises(ValueError, match="not MemoryConfig fields: budget, windw"):
        MemoryConfig.from_mapping({"budget": 4096, "windw": 8})
