"""A model directory is operator input: its files must stay inside it, and its chat template
must render in bounded time and memory, or the model is refused at configure with the reason."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from safetensors import safe_open

from deltas_ros.core import loader, prompt
from deltas_ros.core.loader import ModelPathError, load_model
from deltas_ros.core.memory import StreamingMemory
from deltas_ros.core.prompt import QUESTION_MARKER, VIDEO_MARKER, ChatLayout, render_bounded
from deltas_ros.runtime import params
from deltas_ros.runtime.session import Session

WEIGHTS = "model.safetensors"
# Loops 99999 x 99999 times, within jinja2's sandbox (its range() allows 100000).
TEMPLATE_BOMB = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"


@pytest.fixture
def model_copy(tiny_model_dir, tmp_path) -> Path:
    """A copy of the tiny model to alter, beside an `outside` folder."""
    (tmp_path / "outside").mkdir()
    return Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))


def write_index(model: Path, weights: Path, named: str) -> None:
    """model's sharded index, mapping every tensor in the file `weights` to the name `named`."""
    with safe_open(str(weights), "pt") as tensors:
        index = {"metadata": {}, "weight_map": dict.fromkeys(tensors.keys(), named)}
    (model / f"{WEIGHTS}.index.json").write_text(json.dumps(index))


def test_an_index_naming_weights_outside_the_directory_is_refused_with_the_path(model_copy,
                                                                                monkeypatch):
    outside = model_copy.parent / "outside" / WEIGHTS
    shutil.move(model_copy / WEIGHTS, outside)
    write_index(model_copy, outside, f"../outside/{WEIGHTS}")
    # What the check is for: from_pretrained reads the weights from where the index points.
    with monkeypatch.context() as patch:
        patch.setattr(loader, "check_model_files", lambda path: None)
        assert load_model(model_copy, device="cpu").model is not None
    with pytest.raises(ModelPathError, match=f"{model_copy / '..' / 'outside' / WEIGHTS}"):
        load_model(model_copy, device="cpu")
    write_index(model_copy, outside, str(outside))  # an absolute path: refused alike
    with pytest.raises(ModelPathError, match="outside the model directory"):
        load_model(model_copy, device="cpu")


@pytest.mark.parametrize("name", [WEIGHTS, "tokenizer.json", "chat_template.jinja"])
def test_a_symlink_leading_out_of_the_directory_is_refused_at_configure(model_copy, tmp_path,
                                                                        name):
    """Weights, tokenizer or template: refused before anything is read, by load_model and by
    the session's configure (before the memory plan reads config.json)."""
    outside = tmp_path / "outside" / name
    shutil.move(model_copy / name, outside)
    (model_copy / name).symlink_to(outside)
    with pytest.raises(ModelPathError, match=f"{model_copy / name} resolves to {outside}"):
        load_model(model_copy, device="cpu")
    values = params.defaults() | {"model_path": str(model_copy),
                                  "memory_dir": str(tmp_path / "memory")}
    with pytest.raises(ValueError, match=f"{model_copy / name} resolves to {outside}"):
        Session.configure(values)


def test_symlinks_inside_the_directory_are_followed(model_copy):
    """A weight file linked within the directory, and an index naming a file in a subfolder."""
    (model_copy / "weights").mkdir()
    shutil.move(model_copy / WEIGHTS, model_copy / "weights" / WEIGHTS)
    (model_copy / WEIGHTS).symlink_to(Path("weights") / WEIGHTS)
    assert load_model(model_copy, device="cpu").model is not None
    (model_copy / WEIGHTS).unlink()
    write_index(model_copy, model_copy / "weights" / WEIGHTS, f"weights/{WEIGHTS}")
    assert load_model(model_copy, device="cpu").model is not None


def test_a_template_bomb_is_refused_at_configure_in_bounded_time(model_copy, tmp_path):
    """The session's configure and open_memory, as the lifecycle configure runs them: the
    render is stopped after RENDER_TIMEOUT_S and the model refused with the reason (it kept
    the node configuring for good)."""
    template = model_copy / "chat_template.jinja"
    template.write_text(TEMPLATE_BOMB + template.read_text())
    values = params.defaults() | {"model_path": str(model_copy), "memory_dir": str(tmp_path),
                                  "pixel_budget": 4096, "budget_tokens": 120,
                                  "window_tokens": 40}
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=f"cannot load the model from {model_copy}: the "
                       f"chat template did not render within {prompt.RENDER_TIMEOUT_S:g} s"):
        Session.configure(values).open_memory()
    assert time.monotonic() - started < prompt.RENDER_TIMEOUT_S + 60  # generous: a loaded CI


def test_a_template_that_fails_or_runs_out_of_memory_is_refused_with_the_reason(tiny_model):
    def failing() -> str:
        raise ValueError("no video here")

    with pytest.raises(ValueError, match="does not render: ValueError: no video here"):
        render_bounded(failing)
    with pytest.raises(ValueError, match="does not render: MemoryError"):
        render_bounded(lambda: "x" * (prompt.RENDER_MEMORY_BYTES * 2))


def test_the_bounded_render_is_the_tokenizers_own(tiny_model):
    """The layout comes from the child's render: the same text as apply_chat_template here."""
    tokenizer = tiny_model.tokenizer
    for thinking in (False, True):
        layout = ChatLayout.from_tokenizer(tokenizer, thinking)
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": "video"},
                                          {"type": "text", "text": QUESTION_MARKER}]}],
            tokenize=False, add_generation_prompt=True, enable_thinking=thinking)
        assert (layout.prefix + VIDEO_MARKER + layout.before_question + QUESTION_MARKER
                + layout.after_question) == rendered
    assert StreamingMemory(tiny_model).layout == ChatLayout.from_tokenizer(tokenizer)
