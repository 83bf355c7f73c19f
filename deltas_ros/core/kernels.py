"""Which gated delta kernels each Gated DeltaNet module runs, and the write-strength recording.

transformers binds flash-linear-attention's Triton kernels at import time whenever `fla.ops`
imports, without checking for a GPU, and they crash on a CPU-only machine. Its forward calls
the kernels as module globals (`torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`,
wrapped by `use_kernel_func_from_hub_with_fallback`), so there is no per-instance attribute to
set; the registered alternative (`use_kernelized_func`, `kernelize`) goes through the `kernels`
package, which loads kernels from the Hub, and a robot has no Hub. So each module instance gets
a forward built from the original's code over a copy of its globals with our kernel bindings:
nothing process-wide is patched, and test_backend pins every name it relies on.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from transformers.models.qwen3_5 import modeling_qwen3_5

KERNEL_NAMES = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")

# (sink, strength function) of the recording in progress in this thread, or None.
_RECORDING: ContextVar[tuple[list[torch.Tensor], Callable] | None] = ContextVar(
    "deltas_write_strength", default=None)


def fla_available() -> bool:
    """Whether flash-linear-attention's gated delta kernels import (what transformers binds)."""
    try:
        ops = importlib.import_module("fla.ops.gated_delta_rule")
    except Exception:  # noqa: BLE001 - any import failure means: not usable
        return False
    return all(hasattr(ops, n) for n in ("chunk_gated_delta_rule",
                                         "fused_recurrent_gated_delta_rule"))


def select_gated_delta_kernels(model: torch.nn.Module, device: torch.device,
                               chunk: Callable | None = None) -> bool:
    """Give each Gated DeltaNet module of `model` its kernels: fla's on CUDA, torch elsewhere
    (`chunk`, when given, in place of torch's chunked kernel: training's, whose backward is
    linear in the chunks).

    transformers binds fla's Triton kernels at import time whenever `fla.ops` imports, without
    checking for a GPU, and they crash on a CPU-only machine. Instead of rebinding the module's
    functions for the whole process, each module instance gets a forward with its own bindings.
    Returns whether fla's kernels are in use.
    """
    use_fla = device.type == "cuda" and fla_available()
    forward = gated_delta_forward(use_fla, None if use_fla else chunk)
    for module in model.modules():
        if isinstance(module, modeling_qwen3_5.Qwen3_5GatedDeltaNet):
            module.forward = types.MethodType(forward, module)
    return use_fla


@functools.cache
def gated_delta_forward(use_fla: bool, chunk_kernel: Callable | None = None
                        ) -> types.FunctionType:
    """Qwen3_5GatedDeltaNet.forward's code over a copy of its globals with our kernels."""
    raw = inspect.unwrap(modeling_qwen3_5.Qwen3_5GatedDeltaNet.forward)
    chunk, recurrent = (getattr(modeling_qwen3_5, name) for name in KERNEL_NAMES)
    if not use_fla:
        chunk, recurrent = inspect.unwrap(chunk), inspect.unwrap(recurrent)
    chunk = chunk_kernel or chunk

    def recording_chunk(query, key, value, g, beta, initial_state=None, **kwargs):
        recording = _RECORDING.get()
        if recording is not None:
            sink, strength = recording
            sink.append(strength(key, value, g, beta, initial_state,
                                 kwargs.get("use_qk_l2norm_in_kernel", False)))
        return chunk(query, key, value, g=g, beta=beta, initial_state=initial_state, **kwargs)

    scope = dict(raw.__globals__)
    scope.update({KERNEL_NAMES[0]: recording_chunk, KERNEL_NAMES[1]: recurrent})
    forward = types.FunctionType(raw.__code__, scope, raw.__name__, raw.__defaults__,
                                 raw.__closure__)
    forward.__kwdefaults__ = raw.__kwdefaults__
    return forward


def linear_attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The Gated DeltaNet modules of `model` (for the model_maker's decay init)."""
    return [m for m in model.modules() if isinstance(m, modeling_qwen3_5.Qwen3_5GatedDeltaNet)]


@contextmanager
def recording_write_strength(strength_fn: Callable,
                             enabled: bool = True) -> Iterator[list[torch.Tensor]]:
    """While active, each chunked gated delta prefill in this thread appends
    strength_fn(key, value, g, beta, initial state, l2norm), a per-token signal (B, n) (the
    beta*||e|| replay or the state surprise), to the yielded list."""
    sink: list[torch.Tensor] = []
    token = _RECORDING.set((sink, strength_fn) if enabled else None)
    try:
        yield sink
    finally:
        _RECORDING.reset(token)
