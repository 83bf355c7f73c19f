"""Every released dense Qwen3.5 size as a known configuration, and the memory plan: its terms
against hand-computed values and against the bytes the engine really holds, the command, and
the node's configure refusing what cannot fit."""

from __future__ import annotations

import contextlib
import io
import json
import math
from dataclasses import replace
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from engine_helpers import TINY_FRAMES, feed, frames_for
from transformers import Qwen3_5ForConditionalGeneration

from deltas_ros.core import evidence_forward
from deltas_ros.core import plan as plan_module
from deltas_ros.core.loader import read_config
from deltas_ros.core.memory import MemoryConfig, StreamingMemory
from deltas_ros.core.model_maker import tiny_config
from deltas_ros.core.plan import PlanInputs, make_plan, mib
from deltas_ros.runtime import params
from deltas_ros.runtime.session import Session
from deltas_ros.tools import cli

MODELS = Path(__file__).resolve().parents[2] / "config" / "models"
MIB = 2**20
# Hand-computed from the published dimensions (docs/robot.md): layers (linear, full),
# tied embeddings, parameters, KV bytes per token in bf16 (full layers x K,V x KV heads x
# head_dim x 2 bytes) and recurrent state bytes (linear layers x value heads x 128 x 128 x 4).
SIZES = {
    "qwen3_5_0_8b": (18, 6, True, 852_985_920, 6 * 2 * 2 * 256 * 2, 18 * 16 * 128 * 128 * 4),
    "qwen3_5_2b": (18, 6, True, 2_213_241_664, 6 * 2 * 2 * 256 * 2, 18 * 16 * 128 * 128 * 4),
    "qwen3_5_4b": (24, 8, True, 4_539_265_536, 8 * 2 * 4 * 256 * 2, 24 * 32 * 128 * 128 * 4),
    "qwen3_5_9b": (24, 8, False, 9_409_813_744, 8 * 2 * 4 * 256 * 2, 24 * 32 * 128 * 128 * 4),
}


def expected_parameters(config: dict) -> int:
    """Parameters of a Qwen3.5 from its config.json, term by term (no bias but the vision
    tower's): the text model's embeddings (and output layer unless tied), per layer two norms
    and a SwiGLU MLP, a gated attention (q and its gate, k, v, o, q/k norms) or a Gated
    DeltaNet (qkv, z, b, a projections, conv, dt_bias, A_log, gated norm, out); the vision
    tower's patch conv, position table, blocks and 2x2 merger."""
    t, v = config["text_config"], config["vision_config"]
    h, i, heads, kv, d = (t["hidden_size"], t["intermediate_size"], t["num_attention_heads"],
                          t["num_key_value_heads"], t["head_dim"])
    hk, hv, dk, dv = (t["linear_num_key_heads"], t["linear_num_value_heads"],
                      t["linear_key_head_dim"], t["linear_value_head_dim"])
    conv = 2 * hk * dk + hv * dv
    attention = h * heads * d * 2 + 2 * h * kv * d + heads * d * h + 2 * d
    deltanet = (h * conv + h * hv * dv + 2 * h * hv + conv * t["linear_conv_kernel_dim"]
                + 2 * hv + dv + hv * dv * h)
    text = t["vocab_size"] * h * (1 if config["tie_word_embeddings"] else 2) + h
    text += sum(2 * h + 3 * h * i + (attention if kind == "full_attention" else deltanet)
                for kind in t["layer_types"])
    w, wi, out = v["hidden_size"], v["intermediate_size"], v["out_hidden_size"]
    block = 4 * w + 4 * w * w + 4 * w + 2 * w * wi + wi + w
    patch = 3 * v["temporal_patch_size"] * v["patch_size"] ** 2 * w + w
    merger = 2 * w + 16 * w * w + 4 * w + 4 * w * out + out
    return text + patch + v["num_position_embeddings"] * w + v["depth"] * block + merger


@pytest.mark.parametrize("name", sorted(SIZES))
def test_each_released_size_has_its_published_dimensions(name):
    linear, full, tied, parameters, kv_per_token, states = SIZES[name]
    raw = json.loads((MODELS / f"{name}.json").read_text())
    config = read_config(MODELS / f"{name}.json")
    with torch.device("meta"):
        model = Qwen3_5ForConditionalGeneration(config)
    assert sum(p.numel() for p in model.parameters()) == parameters == expected_parameters(raw)
    kinds = config.text_config.layer_types
    assert (kinds.count("linear_attention"), kinds.count("full_attention")) == (linear, full)
    assert all((kind == "full_attention") == (i % 4 == 3) for i, kind in enumerate(kinds))
    assert config.tie_word_embeddings is tied
    assert (model.lm_head.weight is model.model.language_model.embed_tokens.weight) is tied
    plan = make_plan(config, PlanInputs(), torch.device("cpu"), torch.bfloat16, available=0)
    assert plan.kv_bytes_per_token == kv_per_token and plan.state_bytes == states
    assert plan.weights_bytes == 2 * parameters and not plan.fits


def run_cli(*args: str | Path) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main([str(a) for a in args])
    return code, out.getvalue()


def test_plan_command_gives_the_9b_kv_cache_and_states():
    code, out = run_cli("plan", "--json", "--config", MODELS / "qwen3_5_9b.json",
                        "--budget", "8192", "--dtype", "bfloat16", "--available-gib", "80")
    plan = json.loads(out)
    assert code == 0 and plan["fits"] is True
    assert plan["kv_bytes"] == 256 * MIB == 8192 * 8 * 2 * 4 * 256 * 2
    assert plan["state_bytes"] == 24 * 32 * 128 * 128 * 4 == 48 * MIB
    assert plan["tokens_per_chunk"] == 88 + plan_module.CHUNK_TEXT_TOKENS  # 640x480 at 320x320
    assert plan["peak_bytes"] > plan["weights_bytes"] + plan["kv_bytes"] + plan["state_bytes"]
    code, out = run_cli("plan", "--config", MODELS / "qwen3_5_9b.json", "--dtype", "bfloat16",
                        "--device", "cuda", "--available-gib", "16")
    assert code == 1 and "does NOT fit" in out and "KV cache" in out
    code, out = run_cli("plan", "--markdown", "--config", *sorted(MODELS.glob("*.json")),
                        "--budget", "8192", "16384", "--dtype", "bfloat16", "--available-gib",
                        "16")
    rows = out.strip().splitlines()[2:]
    assert code == 1 and len(rows) == 8  # the 9B does not fit in 16 GiB
    assert rows[-1].startswith("| qwen3_5_9b | 9.41 B | 16384 |") and "| no (16.00 GiB) |" in out


def test_the_evidence_term_counts_the_estimate_only_where_it_runs():
    """A short answer's evidence search peaks at its drop estimate (every layer's activations
    held for the backward); a long answer's estimate is past its bound and not run, so only
    the batched test counts."""
    config = read_config(MODELS / "qwen3_5_9b.json")
    text, bf16, cuda = config.text_config, torch.bfloat16, torch.device("cuda")
    short = PlanInputs(budget_tokens=8192, question_tokens=24, answer_tokens=16)
    estimate = evidence_forward.gate_pass_bytes(text, 8192, 40, 16, bf16, "cuda")
    assert estimate <= evidence_forward.GATE_PASS_BYTES
    assert plan_module.evidence_search_bytes(config, short, bf16, cuda) == estimate
    long = replace(short, answer_tokens=4096)
    assert evidence_forward.gate_pass_bytes(text, 8192, 4120, 4096, bf16,
                                            "cuda") > evidence_forward.GATE_PASS_BYTES
    rows = evidence_forward.evidence_rows(evidence_forward.EVIDENCE_BATCH_BYTES, text, 8192,
                                          4120, 4096, bf16, long.evidence_candidates + 1)
    assert plan_module.evidence_search_bytes(config, long, bf16, cuda) == \
        evidence_forward.evidence_batch_bytes(text, rows, 8192, 4120, 4096, bf16)


def test_the_estimate_counts_float32_work_on_the_cpu():
    """On the CPU the estimate keeps float32 copies for its backward whatever the dtype, so
    its bound in bfloat16 is float32's there; on a GPU it is the dtype's, and smaller."""
    text = read_config(MODELS / "qwen3_5_0_8b.json").text_config
    bound = partial(evidence_forward.gate_pass_bytes, text, 2048, 128, 64)
    assert bound(torch.bfloat16, "cpu") == bound(torch.float32, "cpu")
    assert bound(torch.bfloat16, "cuda") < bound(torch.float32, "cuda") == \
        bound(torch.float32, "cpu")


def test_the_plan_counts_what_the_engine_holds(tiny_model):
    """KV cache, states and their snapshot buffers as the backend really allocates them, after
    a stream that filled M; the plan's video tokens as the chunk builder makes them."""
    config = MemoryConfig(budget_tokens=150, window_tokens=40, **TINY_FRAMES)
    memory = StreamingMemory(tiny_model, config)
    feed(memory, range(12))
    assert memory.kv_tokens == config.budget_tokens
    inputs = PlanInputs(budget_tokens=config.budget_tokens, pixel_budget=config.pixel_budget,
                        frame=frames_for(0)[0].shape[:2])
    plan = make_plan(tiny_model.model.config, inputs, torch.device("cpu"), torch.float32,
                     available=2**40)
    kv, states = memory.backend.nbytes()
    assert (plan.kv_bytes, plan.state_bytes + plan.conv_state_bytes) == (kv, states)
    buffers = sum(b.nbytes for b in memory.backend.buffers.buffers)
    assert buffers == 3 * states == states + plan.snapshot_bytes
    chunk = memory.builder.build(frames_for(0), [0.0, 0.5], 0)
    video = int((chunk.input_ids == tiny_model.model.config.video_token_id).sum())
    assert plan.video_tokens_per_chunk == video
    assert plan.parameters == sum(p.numel() for p in tiny_model.model.parameters())


def test_configure_refuses_a_model_that_cannot_fit_with_the_plan_s_figures(
        tiny_model_dir, tmp_path, monkeypatch):
    values = params.defaults() | {"model_path": str(tiny_model_dir), "memory_dir": str(tmp_path),
                                  "device": "cpu", "budget_tokens": 4096}
    monkeypatch.setattr(plan_module, "available_bytes", lambda device: 4 * MIB)
    session = Session.configure(values)
    with pytest.raises(RuntimeError, match="do not fit on cpu") as refused:
        session.open_memory()
    message = str(refused.value)
    plan = plan_module.plan_for_path(tiny_model_dir, PlanInputs(budget_tokens=4096),
                                     torch.device("cpu"), torch.float32, available=4 * MIB)
    figures = [f"need {mib(plan.peak_bytes)}", "4 MiB is available", "M = 4096",
               f"weights {mib(plan.weights_bytes)}", f"KV cache {mib(plan.kv_bytes)}"]
    assert all(figure in message for figure in figures), message
    monkeypatch.setattr(plan_module, "available_bytes", lambda device: 2**40)
    memory, problem = session.open_memory()
    assert problem == "" and memory.config.budget_tokens == 4096


def test_frame_sizes_are_width_by_height():
    assert cli.parse_frame("640x480") == (480, 640)
    with pytest.raises(ValueError, match="WIDTHxHEIGHT"):
        cli.parse_frame("640")
    assert make_plan(tiny_config(), PlanInputs(frame=(480, 640)), torch.device("cpu"),
                     torch.float32, available=0).video_tokens_per_chunk == 88


def test_recall_plans_the_question_over_its_view_and_counts_the_view_the_engine_builds(
        tiny_model, monkeypatch):
    """With recall_tokens, the question and the evidence search are planned over M + recall
    slots, plus `recall_bytes`: each layer's cache joined with the recalled K/V (the originals
    kept) and the recalled K/V on the device, as backend.appended_slots makes them."""
    config = MemoryConfig(budget_tokens=40, sink_tokens=4, window_tokens=8, buckets=1,
                          policy="recency", evidence_candidates=0, max_new_tokens=4,
                          host_budget_mb=64.0, recall_tokens=64, **TINY_FRAMES)
    memory = StreamingMemory(tiny_model, config)
    feed(memory, range(8))
    assert memory.tiers.flush(10.0)
    built = []
    appended = memory.backend.appended_slots

    @contextlib.contextmanager
    def measured(keys, values):
        with appended(keys, values):
            layers = [memory.backend.cache.layers[i] for i in memory.backend.full]
            built.append((keys.shape[2], sum(layer.keys.nbytes + layer.values.nbytes
                                             for layer in layers)
                          + keys.nbytes + values.nbytes))
            yield

    monkeypatch.setattr(memory.backend, "appended_slots", measured)
    assert memory.ask("What did you see?").recalled_chunks >= 1
    recalled, view_bytes = built[0]
    base = PlanInputs(budget_tokens=config.budget_tokens, pixel_budget=config.pixel_budget,
                      evidence_candidates=0, answer_tokens=4)
    with_recall = replace(base, recall_tokens=recalled)
    plan, plain = (make_plan(tiny_model.model.config, inputs, torch.device("cpu"),
                             torch.float32, available=2**40) for inputs in (with_recall, base))
    assert (plain.recall_tokens, plain.recall_bytes) == (0, 0)
    assert plan.recall_bytes == view_bytes  # memory is full: M cached slots
    over_view = make_plan(tiny_model.model.config,
                          replace(base, budget_tokens=config.budget_tokens + recalled),
                          torch.device("cpu"), torch.float32, available=2**40)
    assert plan.question_bytes == over_view.question_bytes + plan.recall_bytes
    assert plan.peak_bytes > plain.peak_bytes and "recall view" in plan.summary()
    assert "recall view" not in plain.summary()


def test_the_node_plans_recall_only_with_a_second_tier(tiny_model_dir, monkeypatch):
    seen = []
    monkeypatch.setattr(plan_module, "plan_for_path",
                        lambda path, inputs, *rest: seen.append(inputs)
                        or make_plan(read_config(path), inputs, *rest, available=2**40))
    for tiers in ({}, {"host_budget_mb": 1.0, "disk_budget_mb": 2.0, "tier_dir": "tiers"}):
        plan_module.require_fit(tiny_model_dir, MemoryConfig(recall_tokens=256, **tiers), "cpu",
                                "float32")
    assert [(i.recall_tokens, i.host_tier_bytes, i.disk_tier_bytes) for i in seen] == [
        (0, 0, 0), (256, 2**20, 2 * 2**20)]
    monkeypatch.undo()
    code, out = run_cli("plan", "--json", "--config", MODELS / "qwen3_5_9b.json",
                        "--recall-tokens", "2048", "--dtype", "bfloat16", "--available-gib", "80",
                        "--device", "cuda", "--disk-budget-mb", "1024")
    plan = json.loads(out)
    assert code == 0 and plan["recall_bytes"] == (8192 + 2 * 2048) * 32 * 1024
    assert plan["tier_summary_bytes"] == 0  # a discrete GPU: the summaries are in host RAM
    code, out = run_cli("plan", "--json", "--config", MODELS / "qwen3_5_9b.json",
                        "--device", "cpu", "--available-gib", "80", "--disk-budget-mb", "1024")
    assert code == 0 and json.loads(out)["tier_summary_bytes"] > 0


def test_the_host_tier_counts_where_the_device_shares_the_hosts_memory(monkeypatch):
    """The host budget, and the key summaries of the chunks both tiers hold (8 KiB each at
    0.8B: 2 KV heads x 4 keys x 256 float32), count where the device shares the host's
    memory; a discrete GPU's plan leaves both to host RAM."""
    config = read_config(MODELS / "qwen3_5_0_8b.json")
    inputs = PlanInputs(host_tier_bytes=512 * 2**20, disk_tier_bytes=4096 * 2**20)
    cpu = make_plan(config, inputs, torch.device("cpu"), torch.bfloat16, available=2**40)
    plain = make_plan(config, PlanInputs(), torch.device("cpu"), torch.bfloat16, available=2**40)
    chunks = math.ceil(4608 * 2**20 / (cpu.tokens_per_chunk * cpu.kv_bytes_per_token))
    assert cpu.tier_summary_bytes == chunks * 8 * 2**10
    assert cpu.resident_bytes - plain.resident_bytes == 512 * 2**20 + cpu.tier_summary_bytes
    assert cpu.host_tier_bytes == 512 * 2**20
    assert "host tier" in cpu.summary() and "host tier" not in plain.summary()
    assert "tier key summaries" in cpu.summary() and "summaries" not in plain.summary()
    monkeypatch.setattr(plan_module.torch.cuda, "is_available", lambda: True)
    for integrated, counted in ((True, cpu.resident_bytes - plain.resident_bytes), (False, 0)):
        monkeypatch.setattr(plan_module.torch.cuda, "get_device_properties",
                            lambda _, shared=integrated: SimpleNamespace(is_integrated=shared))
        gpu = make_plan(config, inputs, torch.device("cuda"), torch.bfloat16, available=2**40)
        assert gpu.host_tier_bytes + gpu.tier_summary_bytes == counted
