"""The one door to transformers: the private names it relies on, no process-wide patching,
per-instance kernels, and the sliced evidence attention equal to eager attention's weights."""

import copy
import functools
import inspect
import re
from pathlib import Path

import pytest
import torch
import transformers
from engine_helpers import TINY_FRAMES, feed, frames_for
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from transformers import AutoModelForImageTextToText
from transformers.cache_utils import DynamicCache
from transformers.models.qwen3_5 import modeling_qwen3_5

from deltas_ros.core import kernels, kv_ops, kv_ops_reference, rope
from deltas_ros.core.loader import LoadedModel
from deltas_ros.core.memory import MemoryConfig, StreamingMemory

REPO = Path(__file__).resolve().parents[2]
MODULE_NAMES = ["Qwen3_5GatedDeltaNet", "Qwen3_5Attention", "Qwen3_5TextRotaryEmbedding",
                "apply_rotary_pos_emb", "rotate_half", *kernels.KERNEL_NAMES]


@pytest.mark.parametrize("name", MODULE_NAMES)
def test_private_module_names_the_backend_uses_exist(name):
    assert hasattr(modeling_qwen3_5, name), f"transformers moved modeling_qwen3_5.{name}"


@pytest.mark.parametrize("name", kernels.KERNEL_NAMES)
def test_gated_delta_forward_calls_the_kernels_by_their_global_names(name):
    forward = inspect.unwrap(modeling_qwen3_5.Qwen3_5GatedDeltaNet.forward)
    assert name in forward.__code__.co_names, f"GatedDeltaNet.forward no longer calls {name}"
    kernel = getattr(modeling_qwen3_5, name)
    assert inspect.unwrap(kernel).__module__ == modeling_qwen3_5.__name__, \
        f"{name}.__wrapped__ is no longer transformers' torch reference"


def test_attention_and_cache_attributes_the_backend_uses_exist(tiny_model):
    model = tiny_model.model
    attention = next(m for m in model.modules()
                     if isinstance(m, modeling_qwen3_5.Qwen3_5Attention))
    for name in ("q_proj", "q_norm", "head_dim", "scaling", "num_key_value_groups", "layer_idx"):
        assert hasattr(attention, name), f"Qwen3_5Attention.{name} moved"
    signature = inspect.signature(inspect.unwrap(modeling_qwen3_5.Qwen3_5Attention.forward))
    for name in ("hidden_states", "position_embeddings"):
        assert name in signature.parameters, f"Qwen3_5Attention.forward lost {name}="
    rotary = model.model.language_model.rotary_emb
    for name in ("recomposition_frequencies", "inv_freq"):
        assert hasattr(rotary, name), f"Qwen3_5TextRotaryEmbedding.{name} moved"
    cache = DynamicCache(config=model.config.text_config)
    full = model.config.text_config.layer_types.index("full_attention")
    linear = model.config.text_config.layer_types.index("linear_attention")
    assert hasattr(cache.layers[full], "get_seq_length"), "DynamicCache layer API moved"
    for name in ("recurrent_states", "conv_states"):
        assert hasattr(cache.layers[linear], name), f"linear-attention cache layer lost {name}"
    # What repeat_cache (training) sets on them.
    for name in ("conv_kernel_size", "dtype", "device", "is_conv_states_initialized",
                 "is_recurrent_states_initialized", "has_previous_state", "record_past",
                 "update_recurrent_state"):
        assert hasattr(cache.layers[linear], name), f"linear-attention cache layer lost {name}"
    assert "state_idx" in inspect.signature(cache.layers[linear].update_recurrent_state).parameters
    assert hasattr(cache.layers[full], "lazy_initialization"), "DynamicLayer API moved"


def test_rope_rotate_half_is_transformers_pairing():
    x = torch.randn(2, 3, 16)
    assert torch.equal(rope.rotate_half(x), modeling_qwen3_5.rotate_half(x))


def test_supported_transformers_range_agrees_with_the_pin():
    """setup.py allows only the transformers minor release the backend's private names are pinned
    against (above); requirements-core.txt pins a version inside that range, and it is
    installed."""
    setup = (REPO / "setup.py").read_text()
    allowed = SpecifierSet(re.search(r'"transformers([^"]+)"', setup).group(1))
    pinned = re.search(r"^transformers==(\S+)$", (REPO / "requirements-core.txt").read_text(),
                       re.MULTILINE).group(1)
    assert pinned in allowed and transformers.__version__ in allowed
    next_minor = Version(pinned).release[:2][0], Version(pinned).release[1] + 1
    assert f"{next_minor[0]}.{next_minor[1]}.0" not in allowed  # an untested release is refused


def test_no_process_wide_rebinding(tiny_model):
    """Kernels are chosen per module instance; the module's own bindings and the attention
    implementation stay as transformers set them, also while recording write strength."""
    bound = {name: getattr(modeling_qwen3_5, name) for name in kernels.KERNEL_NAMES}
    implementation = tiny_model.model.config.text_config._attn_implementation
    memory = StreamingMemory(tiny_model, MemoryConfig(policy="write_strength", budget_tokens=150,
                                                      window_tokens=40, max_new_tokens=2,
                                                      **TINY_FRAMES))
    feed(memory, range(8))
    memory.ask("What is on the table?")
    assert {name: getattr(modeling_qwen3_5, name) for name in bound} == bound
    assert all(hasattr(kernel, "__wrapped__") for kernel in bound.values())  # still the wrapper
    assert tiny_model.model.config.text_config._attn_implementation == implementation
    deltanets = kernels.linear_attention_modules(tiny_model.model)
    assert deltanets and all("forward" in vars(m) for m in deltanets)  # per instance
    scope = vars(deltanets[0])["forward"].__func__.__globals__
    assert scope is not vars(modeling_qwen3_5)
    assert scope[kernels.KERNEL_NAMES[1]] is inspect.unwrap(bound[kernels.KERNEL_NAMES[1]])


def test_write_strength_is_recorded_only_inside_the_call(tiny_model):
    memory = StreamingMemory(tiny_model, MemoryConfig(**TINY_FRAMES))
    chunk = memory.builder.build(*_frames(), memory.next_position)
    twin = copy.deepcopy(memory)
    with torch.inference_mode():
        with memory.backend.recording_write_strength() as strengths:
            memory.backend.prefill_chunk(chunk)
        with twin.backend.recording_write_strength(enabled=False) as nothing:
            twin.backend.prefill_chunk(chunk)
    assert len(strengths) == 6 and nothing == []  # one per Gated DeltaNet layer
    assert all(s.shape == (1, chunk.num_tokens) and torch.isfinite(s).all() for s in strengths)
    for a, b in zip(memory.backend.recurrent_states(), twin.backend.recurrent_states()):
        assert torch.equal(a, b)  # recording does not change what the model computes


def _frames():
    return frames_for(0), [0.0, 0.5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("length", "slice_rows"), [(37, 1), (37, 3), (37, 1000), (1, 1)])
def test_sliced_attention_mass_equals_the_one_shot_reference(length, slice_rows, dtype):
    """Every slicing, a decoded token's single query (length 1) and the model's dtypes."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, total, dim = 6, 2, 120, 32
    queries = torch.randn(1, heads, length, dim, generator=gen).to(dtype)
    keys = torch.randn(1, kv_heads, total, dim, generator=gen).to(dtype)
    slots = total - 37
    one_shot = kv_ops_reference.attention_mass_reference(queries, keys, 0.17, 3, slots)
    sliced = kv_ops.attention_mass_of(queries, keys, 0.17, 3, slots,
                                       slice_elements=slice_rows * heads * total)
    torch.testing.assert_close(sliced, one_shot, rtol=1e-6, atol=1e-6)


def test_evidence_mass_equals_eager_attention_weights(tiny_model_dir, tiny_model):
    """The evidence the memory computes from queries and cached keys, in slices, is the mass
    eager attention's own weights give (what the memory used before the backend)."""
    model = AutoModelForImageTextToText.from_pretrained(
        tiny_model_dir, dtype=torch.float32, local_files_only=True, attn_implementation="eager")
    model.eval().requires_grad_(False)
    loaded = LoadedModel(model, tiny_model.tokenizer, tiny_model_dir, torch.device("cpu"),
                         torch.float32, False)
    memory = StreamingMemory(loaded, MemoryConfig(budget_tokens=150, window_tokens=40,
                                                  **TINY_FRAMES))
    feed(memory, range(10))
    ids = memory.layout.question_ids(memory.tokenizer, "Where was the red ball? " * 5)
    start, kv_before = memory.next_position, memory.kv_tokens
    weights = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: weights.append(out[1]))
             for m in model.modules() if isinstance(m, modeling_qwen3_5.Qwen3_5Attention)]
    try:
        with torch.inference_mode(), memory.backend.attention_mass(kv_before) as mass:
            memory.backend.prefill_text(torch.tensor([ids]),
                                        torch.arange(start, start + len(ids)).expand(3, 1, -1))
    finally:
        for hook in hooks:
            hook.remove()
    eager = torch.stack([w[0, :, :, :kv_before].float().sum((0, 1)) for w in weights]).sum(0)
    assert len(weights) == 2 and mass.shape == (kv_before,)
    torch.testing.assert_close(mass, eager, rtol=1e-5, atol=1e-5)


def test_gather_slots_equals_index_select_on_the_slot_dimension():
    cache = torch.randn(2, 3, 50, 8)
    keep = torch.tensor([0, 1, 7, 8, 9, 30, 49])
    assert torch.equal(kv_ops.gather_slots(cache, keep), cache.index_select(-2, keep))


def test_the_states_live_in_the_stacked_buffers_and_the_model_updates_them_in_place(
        tiny_model):
    """The snapshot and the drift read the states where the model writes them: after chunks
    and a question every layer's recurrent and conv state is still a view of the backend's
    buffers (transformers' cache copies into its state tensors; an upgrade that reassigns them
    fails here), holding what the model computed."""
    memory = StreamingMemory(tiny_model, MemoryConfig(**TINY_FRAMES))
    feed(memory, range(3))
    memory.ask("What is on the table?")
    feed(memory, range(3, 5))
    states = memory.backend.buffers
    bases = {t.untyped_storage().data_ptr() for t in states.buffers}
    live = memory.backend.recurrent_states() + memory.backend.conv_states()
    assert all(s.untyped_storage().data_ptr() in bases for s in live)
    assert all(a is b for a, b in zip(live, states.live))
    twin = StreamingMemory(tiny_model, MemoryConfig(**TINY_FRAMES))
    twin.import_state(memory.export_state())  # a fresh backend's states from the tensors
    for a, b in zip(live, twin.backend.recurrent_states() + twin.backend.conv_states()):
        assert torch.equal(a, b)


def test_a_state_the_model_replaced_is_refused_not_read_stale(tiny_model):
    memory = StreamingMemory(tiny_model, MemoryConfig(**TINY_FRAMES))
    with torch.inference_mode():
        snapshot = memory.backend.snapshot()
        layer = memory.backend.cache.layers[memory.backend.linear[0]]
        layer.recurrent_states[0] = layer.recurrent_states[0].clone()
        with pytest.raises(RuntimeError, match="replaced"):
            memory.backend.drift(snapshot)
        with pytest.raises(RuntimeError, match="replaced"):
            memory.backend.restore(snapshot)


def test_a_reset_moves_the_new_cache_s_states_into_the_buffers(tiny_model):
    memory = StreamingMemory(tiny_model, MemoryConfig(**TINY_FRAMES))
    feed(memory, range(2))
    old = memory.backend.buffers
    memory.reset()
    first = feed(memory, range(1))[0]
    assert memory.backend.buffers is not old
    fresh = StreamingMemory(tiny_model, MemoryConfig(**TINY_FRAMES))
    assert feed(fresh, range(1))[0].layer_drift == first.layer_drift


@pytest.fixture
def stand_in_kernels(monkeypatch):
    """Recording stand-ins for the gated delta kernels transformers binds when fla imports:
    each records its call and runs transformers' torch reference (what fla's kernels compute),
    and fla counts as importable. The backend's cached forwards are rebuilt around them, and
    again afterwards."""
    calls: list[str] = []

    def stand_in(name: str):
        reference = inspect.unwrap(getattr(modeling_qwen3_5, name))

        @functools.wraps(reference)  # __wrapped__, as transformers' own wrappers have
        def kernel(*args, **kwargs):
            calls.append(name)
            return reference(*args, **kwargs)
        return kernel

    for name in kernels.KERNEL_NAMES:
        monkeypatch.setattr(modeling_qwen3_5, name, stand_in(name))
    monkeypatch.setattr(kernels, "fla_available", lambda: True)
    kernels.gated_delta_forward.cache_clear()
    yield calls
    kernels.gated_delta_forward.cache_clear()


def _fresh_model(tiny_model_dir) -> LoadedModel:
    """A model of its own: kernel routing is per module instance, and the session's tiny model
    is shared by other tests."""
    from deltas_ros.core.loader import load_model

    return load_model(tiny_model_dir, "cpu")


def test_a_cuda_backend_routes_prefill_decode_and_recording_through_fla(tiny_model_dir,
                                                                         stand_in_kernels):
    """Without a GPU: the routing a CUDA-configured backend chooses (fla's bindings) sends
    chunked prefill, one-token decoding and the write-strength recording through the kernels
    transformers bound; the CPU routing uses the torch references even with fla importable."""
    chunk, recurrent = kernels.KERNEL_NAMES
    loaded = _fresh_model(tiny_model_dir)
    memory = StreamingMemory(loaded, MemoryConfig(**TINY_FRAMES))
    assert not memory.backend.fla_kernels  # on the CPU
    feed(memory, range(1))
    memory.ask("What is on the table?")
    assert stand_in_kernels == []
    assert kernels.select_gated_delta_kernels(loaded.model, torch.device("cuda")) is True
    layers = len(memory.backend.linear)
    with torch.inference_mode():
        memory.backend.prefill_text(torch.tensor([[1, 2, 3]]), torch.arange(3).expand(3, 1, -1))
        assert stand_in_kernels == [chunk] * layers
        memory.backend.step(4, 3)
        assert stand_in_kernels == [chunk] * layers + [recurrent] * layers
        stand_in_kernels.clear()
        with memory.backend.recording_write_strength() as strengths:
            memory.backend.prefill_chunk(memory.builder.build(frames_for(2), [2.0, 2.5], 10))
    assert stand_in_kernels == [chunk] * layers and len(strengths) == layers


def test_the_rebuilt_forward_equals_transformers_own_with_the_same_kernels(tiny_model_dir,
                                                                           stand_in_kernels):
    """The per-instance forward (the class forward's code over our bindings) computes what
    Qwen3_5GatedDeltaNet.forward computes through transformers' own module globals, here the
    stand-ins over the torch references: same hidden states and states, bit for bit, for a
    multi-token prefill and a one-token step."""
    rebuilt, original = _fresh_model(tiny_model_dir).model, _fresh_model(tiny_model_dir).model
    kernels.select_gated_delta_kernels(rebuilt, torch.device("cuda"))
    for module in kernels.linear_attention_modules(original):
        del module.forward  # back to the class's forward and the module's globals
    text = rebuilt.config.text_config
    outputs = []
    for model in (rebuilt, original):
        cache, calls = DynamicCache(config=text), len(stand_in_kernels)
        with torch.inference_mode():
            first = model.model(input_ids=torch.tensor([[5, 6, 7, 8, 9]]), cache=cache,
                                position_ids=torch.arange(5).expand(3, 1, -1), use_cache=True)
            second = model.model(input_ids=torch.tensor([[10]]), cache=cache,
                                 position_ids=torch.full((3, 1, 1), 5), use_cache=True)
        states = [layer.recurrent_states[0].clone() for layer in cache.layers
                  if hasattr(layer, "recurrent_states")]
        outputs.append((first.last_hidden_state, second.last_hidden_state, states))
        assert len(stand_in_kernels) - calls == 2 * len(states)  # both went through them
    for ours, theirs in zip(outputs[0][:2], outputs[1][:2]):
        assert torch.equal(ours, theirs)
    assert all(torch.equal(a, b) for a, b in zip(outputs[0][2], outputs[1][2]))


@pytest.mark.parametrize("window", [False, True])
def test_a_decoding_step_equals_the_same_token_prefilled(tiny_model, window):
    """`step` gives the full-attention layers an explicit all-visible mask on the CPU (SDPA's
    faster path for one query); the hidden state is the one the plain prefill computes, also
    while a question's window has gathered the slots it may see."""
    memory = StreamingMemory(tiny_model, MemoryConfig(**TINY_FRAMES))
    feed(memory, range(6))
    backend, position = memory.backend, memory.next_position
    visible = torch.arange(0, backend.kv_tokens, 2) if window else None
    with torch.inference_mode():  # as the memory runs its forwards
        with backend.visible_slots(visible), backend.undone():
            stepped = backend.step(7, position)
            length = backend.kv_tokens
        with backend.visible_slots(visible), backend.undone():
            prefilled = backend.prefill_text(torch.tensor([[7]]),
                                             torch.full((3, 1, 1), position))
            assert backend.kv_tokens == length
    torch.testing.assert_close(stepped, prefilled, rtol=1e-5, atol=1e-5)
