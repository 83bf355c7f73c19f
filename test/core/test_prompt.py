"""Qwen3.5's reasoning block: the chat template's `enable_thinking`, rendered off by default and
on by choice, with the reasoning returned apart from the answer.

The tiny models' template (model_maker.CHAT_TEMPLATE) follows the published generation-prompt rule
(a reasoning block opens unless `enable_thinking` is false), so the layout is checked against
that behaviour, not against the shipped model's template, which hard-codes the closed block.
"""

from __future__ import annotations

import shutil

import pytest
from engine_helpers import TINY_FRAMES, feed

from deltas_ros.core import asking
from deltas_ros.core.loader import SHIPPED_MODEL, load_model
from deltas_ros.core.memory import MemoryConfig, StreamingMemory
from deltas_ros.core.model_maker import CHAT_TEMPLATE
from deltas_ros.core.prompt import ChatLayout
from deltas_ros.tools.cli import main
from deltas_ros.training.scenes import SceneOptions
from deltas_ros.training.synth import write_synth_bag

CLOSED = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
OPEN = "<|im_start|>assistant\n<think>\n"


def test_the_layout_renders_thinking_off_unless_asked(tiny_model):
    tokenizer = tiny_model.tokenizer
    assert tokenizer.chat_template == CHAT_TEMPLATE
    off, on = ChatLayout.from_tokenizer(tokenizer), ChatLayout.from_tokenizer(tokenizer, True)
    assert off.after_question == "<|im_end|>\n" + CLOSED and not off.opens_reasoning
    assert on.after_question == "<|im_end|>\n" + OPEN and on.opens_reasoning
    assert (off.prefix, off.before_question) == (on.prefix, on.before_question)  # same sinks


def test_a_template_without_the_rule_renders_as_before():
    """The shipped model's template writes the closed block whatever the flag."""
    tokenizer = load_model(SHIPPED_MODEL, "cpu").tokenizer
    for thinking in (False, True):
        layout = ChatLayout.from_tokenizer(tokenizer, thinking)
        assert layout.after_question.endswith(CLOSED) and not layout.opens_reasoning


@pytest.mark.parametrize("written,answer,reasoning", [
    ("the red cube is on the left</think>\n\nred", "red", "the red cube is on the left"),
    ("still looking at the", "", "still looking at the"),  # the block never closed
])
def test_the_reasoning_comes_apart_from_the_answer(tiny_model, monkeypatch, written, answer,
                                                   reasoning):
    memory = StreamingMemory(tiny_model, MemoryConfig(thinking=True, evidence_candidates=0,
                                                      **TINY_FRAMES))
    feed(memory, range(3))
    ids = memory.tokenizer.encode(written, add_special_tokens=False)

    def scripted(backend, hidden, position, limit, stop_ids, deadline, on_token=None,
                 cancelled=None):
        """What a reasoning model writes, token by token (the model here is random)."""
        for k in range(1, len(ids) + 1):
            on_token(ids[:k])
        return ids, "end"

    monkeypatch.setattr(asking, "decode", scripted)
    streamed = []
    reply = memory.ask("what is on the left?", on_token=lambda *fields: streamed.append(fields))
    assert (reply.text, reply.reasoning) == (answer, reasoning)
    assert streamed[-1] == (answer, len(ids), reasoning)
    assert all(text == "" for text, _, _ in streamed[:-3])  # no answer while it reasons


def test_run_answers_the_same_with_a_thinking_template_and_splits_with_thinking(tmp_path,
                                                                                 capsys):
    """The shipped model with a thinking-by-default template: `run` answers the demo question
    as with its own template; `--thinking` opens the block, and what the model writes in it
    (this model never learned to reason, so it answers inside it) is printed as reasoning."""
    model = tmp_path / "thinking-template"
    shutil.copytree(SHIPPED_MODEL, model)
    (model / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    bag = write_synth_bag(tmp_path / "bag", duration_s=20, fps=4.0, width=128, height=96,
                          seed=0, scenes=SceneOptions())
    question = "What color was the triangle?"

    def run(*extra: str) -> list[str]:
        assert main(["run", str(bag), "--ask", question, "--quiet",
                     "--out", str(tmp_path / "results.jsonl"), *extra]) == 0
        return capsys.readouterr().out.splitlines()

    today = next(line for line in run() if line.startswith("A: "))
    lines = run("--model", str(model))
    assert next(line for line in lines if line.startswith("A: ")) == today
    assert not any("reasoning:" in line for line in lines)
    thinking = run("--model", str(model), "--thinking")
    assert "A: " in thinking and any(line.startswith("   reasoning: ") for line in thinking)
