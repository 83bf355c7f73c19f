"""A model directory laid out as a published Qwen3.5 checkpoint (sharded weights with their
index, generation/preprocessor/video configs, chat template, tokenizer) loads through the
node's model_path, `deltas-ros run` and `deltas-ros plan`; its stop tokens come from
generation_config.json."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from deltas_ros.core.loader import load_model, stop_token_ids
from deltas_ros.core.model_maker import make_model
from deltas_ros.runtime import params
from deltas_ros.runtime.session import Session
from deltas_ros.tools import cli
from deltas_ros.training.synth import write_synth_bag

PUBLISHED_FILES = {"config.json", "generation_config.json", "preprocessor_config.json",
                   "video_preprocessor_config.json", "chat_template.jinja", "tokenizer.json",
                   "tokenizer_config.json", "model.safetensors.index.json"}
SMALL_ARGS = ["--pixel-budget", "4096", "--budget", "64", "--window", "24", "--quiet"]


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> Path:
    """The tiny model of conftest's seed, in the published layout with its weights in 3+
    shards."""
    return make_model(tmp_path_factory.mktemp("published") / "tiny", shards=3)


def run_cli(*args: str | Path) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main([str(a) for a in args])
    return code, out.getvalue()


def test_the_directory_holds_the_published_files_and_loads_the_same_weights(
        published, tiny_model):
    files = {p.name for p in published.iterdir()}
    shards = {name for name in files if name.startswith("model-")}
    assert files - shards == PUBLISHED_FILES and len(shards) >= 3
    index = json.loads((published / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == shards
    assert all(name.endswith(f"-of-{len(shards):05d}.safetensors") for name in shards)
    loaded = load_model(published, "cpu")
    ours, theirs = loaded.model.state_dict(), tiny_model.model.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)  # same seed, same model


def test_stop_tokens_come_from_the_generation_config(published, tmp_path):
    tokenizer = load_model(published, "cpu").tokenizer
    ids = tokenizer.convert_tokens_to_ids
    assert stop_token_ids(published, tokenizer) == {ids("<|im_end|>"), ids("<|endoftext|>")}
    assert json.loads((published / "generation_config.json").read_text())["eos_token_id"] == \
        [ids("<|im_end|>"), ids("<|endoftext|>")]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert stop_token_ids(tmp_path, tokenizer) == {7, 9}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 11}))
    assert stop_token_ids(tmp_path, tokenizer) == {11}
    (tmp_path / "generation_config.json").write_text("{}")
    assert stop_token_ids(tmp_path, tokenizer) == {ids("<|im_end|>"), ids("<|endoftext|>")}


def test_run_and_plan_load_the_published_layout(published, tmp_path):
    bag = write_synth_bag(tmp_path / "bag", duration_s=3.0, fps=10.0, width=160, height=120)
    code, out = run_cli("run", bag, "--model", published, "--out", tmp_path / "r.jsonl",
                        *SMALL_ARGS, "--ask", "What appeared?", "--max-new-tokens", "2")
    assert code == 0 and "3 chunks" in out and "Q: What appeared?" in out
    code, out = run_cli("plan", "--model", published, "--json", "--device", "cpu")
    plan = json.loads(out)
    assert code == 0 and plan["fits"] and plan["parameters"] > 0


def test_the_node_s_model_path_loads_the_published_layout(published, tmp_path):
    values = params.defaults() | {"model_path": str(published), "memory_dir": str(tmp_path),
                                  "pixel_budget": 4096, "budget_tokens": 120,
                                  "window_tokens": 40, "device": "cpu"}
    memory, problem = Session.configure(values).open_memory()
    assert problem == "" and memory.loaded.path == published
    assert memory.stop_ids == stop_token_ids(published, memory.tokenizer)


def test_make_model_writes_the_published_layout_from_the_command_line(tmp_path):
    code, out = run_cli("make-model", "--tiny", "--shards", "2", tmp_path / "m")
    files = list((tmp_path / "m").glob("model-*-of-*.safetensors"))
    assert code == 0 and f"published layout ({len(files)} weight files)" in out
    assert len(files) >= 2
    assert (tmp_path / "m" / "model.safetensors.index.json").is_file()
    code, _ = run_cli("make-model", "--tiny", "--shards", "1", tmp_path / "one")
    assert code == 0 and (tmp_path / "one" / "model.safetensors").is_file()
    assert (tmp_path / "one" / "video_preprocessor_config.json").is_file()
