"""Loading a Qwen3.5 hybrid model from a local directory; never from a hub.

The robot loads real weights with `load_model(path)`; tests, the demo and benchmarks load a tiny
random model written by `model_maker.make_model` through exactly the same
`from_pretrained(path)` call.
Only transformers' public classes are used here (the kernels are chosen in `backend`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForImageTextToText,
    AutoTokenizer,
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5Tokenizer,
)
from transformers.utils import logging as transformers_logging

from .config import DEFAULT_PIXEL_BUDGET
from .kernels import select_gated_delta_kernels

# The model shipped with the package (docs/model.md): used wherever a model path is
# optional and left empty. MODEL_INFO_FILE beside a model's weights records how it was trained.
SHIPPED_MODEL = Path(__file__).parents[1] / "models" / "scenes-tiny"
MODEL_INFO_FILE = "deltas_model.json"
# A published checkpoint lists its stop tokens here (`eos_token_id`: one id or a list).
GENERATION_CONFIG_FILE = "generation_config.json"
# What ends an answer when the model directory does not say: the chat turn's end and Qwen's
# end of text.
DEFAULT_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")
# Config entries written by save_pretrained that do not change what the model computes.
_VOLATILE_CONFIG_KEYS = {"transformers_version", "dtype", "torch_dtype", "_name_or_path"}


def resolve_model_path(path: str | Path | None) -> Path:
    """`path`, or the shipped model when it is empty or None."""
    return Path(path) if path else SHIPPED_MODEL


def resolve_pixel_budget(pixel_budget: int | None, model_path: str | Path | None) -> int:
    """`pixel_budget` if set (> 0); else the budget the model was trained at, when stored with
    it in MODEL_INFO_FILE; else DEFAULT_PIXEL_BUDGET (e.g. real Qwen3.5 weights)."""
    if pixel_budget:
        return pixel_budget
    info = resolve_model_path(model_path) / MODEL_INFO_FILE
    if info.is_file():
        return int(json.loads(info.read_text())["pixel_budget"])
    return DEFAULT_PIXEL_BUDGET


class ModelPathError(ValueError):
    """A file of a model directory, or a weight file its index names, that resolves outside
    the directory; the message names the path."""


def check_model_files(path: str | Path) -> None:
    """Refuse a model directory that would make from_pretrained read outside it.

    from_pretrained(local_path) opens what a shard index (`*.index.json`) names, joined to the
    directory, so `../outside/x.safetensors` or an absolute path loads weights from elsewhere;
    and it follows symlinks. So every entry under `path` and every file an index names must
    resolve inside `path` (a symlink only to a target within it); checked before anything is
    read. A Hugging Face cache snapshot (symlinks into `../../blobs`) is refused: download
    with `--local-dir` instead. The package's own model is exempt: a symlink install
    (`colcon build --symlink-install`, scripts/setup.sh) links its files into the source tree."""
    root = Path(path).resolve()
    if root == SHIPPED_MODEL.resolve():
        return

    def inside(file: Path) -> None:
        target = file.resolve()
        if not target.is_relative_to(root):
            raise ModelPathError(f"{file} resolves to {target}, outside the model directory "
                                 f"{root}: refused")

    for folder, dirs, files in os.walk(root):  # symlinked folders: checked, not entered
        for name in dirs + files:
            inside(Path(folder) / name)
    for index in root.glob("*.index.json"):
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        for name in sorted({str(name) for name in weight_map.values()}):
            inside(root / name)


@dataclass
class LoadedModel:
    """A model ready for streaming, with the tokenizer that belongs to it."""

    model: Qwen3_5ForConditionalGeneration
    tokenizer: Qwen3_5Tokenizer
    path: Path
    device: torch.device
    dtype: torch.dtype
    fla_kernels: bool


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on CUDA (what the paper runs), float32 on CPU (bf16 matmuls there are slow)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def resolve_device(device: str) -> torch.device:
    """"auto" (CUDA when available), "cpu", "cuda" or "cuda:N" as a device; RuntimeError when
    CUDA is asked for and missing (the loader and the memory plan agree on the device)."""
    torch_device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    )
    if torch_device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {device!r} requested but CUDA is not available")
    return torch_device


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """"auto" (`default_dtype` of the device), "float32", "bfloat16" or "float16"."""
    torch_dtype = default_dtype(device) if dtype == "auto" else getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return torch_dtype


def load_model(
    path: str | Path, device: str = "auto", dtype: str = "auto"
) -> LoadedModel:
    """Load model and tokenizer from a local directory; never from a hub, nor from outside
    the directory (`check_model_files`).

    device: "auto" (CUDA when available), "cpu", "cuda", "cuda:N".
    dtype: "auto" (bf16 on CUDA, float32 on CPU), "float32", "bfloat16", "float16".
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no model at {path}: config.json is missing")
    check_model_files(path)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    # The kernel hub's "falling back to the reference implementation" notices and the weight
    # loading progress bar are noise in a node's log; real problems still raise.
    logging.getLogger("transformers.integrations.hub_kernels").setLevel(logging.ERROR)
    transformers_logging.disable_progress_bar()
    model = AutoModelForImageTextToText.from_pretrained(
        path, dtype=torch_dtype, local_files_only=True
    )
    model.to(torch_device).eval().requires_grad_(False)
    fla = select_gated_delta_kernels(model, torch_device)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return LoadedModel(model, tokenizer, path, torch_device, torch_dtype, fla)


def read_config(path: str | Path) -> Qwen3_5Config:
    """The Qwen3.5 config of a model directory (its config.json) or of a config.json-style file
    (e.g. config/models/qwen3_5_9b.json): what sizing needs, without loading any weights."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no model config at {path}")
    raw = json.loads(file.read_text())
    raw = {k: v for k, v in raw.items() if not k.startswith("_")}
    if raw.pop("model_type", "qwen3_5") != "qwen3_5":
        raise ValueError(f"{file}: model_type must be qwen3_5")
    raw.pop("architectures", None)
    return Qwen3_5Config(**raw)


def parameter_count(config: Qwen3_5Config) -> int:
    """Parameters of the model `config` describes, counted on the meta device (no memory, no
    weights read; tied embeddings count once, as they are stored)."""
    with torch.device("meta"):
        model = Qwen3_5ForConditionalGeneration(config)
    return sum(p.numel() for p in model.parameters())


def stop_token_ids(path: str | Path, tokenizer: Qwen3_5Tokenizer) -> set[int]:
    """The tokens that end an answer: `eos_token_id` of the directory's generation config (one
    id or a list; a published checkpoint lists <|im_end|> and <|endoftext|>) when it has one,
    else DEFAULT_STOP_TOKENS."""
    file = Path(path) / GENERATION_CONFIG_FILE
    eos = json.loads(file.read_text()).get("eos_token_id") if file.is_file() else None
    if eos is None:
        return {tokenizer.convert_tokens_to_ids(token) for token in DEFAULT_STOP_TOKENS}
    return set(eos) if isinstance(eos, list) else {int(eos)}


def config_sha256(config) -> str:
    """sha256 of a model config's JSON with sorted keys, without the entries that do not change
    what the model computes (library version, dtype, where it was loaded from)."""
    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in _VOLATILE_CONFIG_KEYS}
        return value

    raw = json.loads(config.to_json_string(use_diff=False))
    return hashlib.sha256(json.dumps(strip(raw), sort_keys=True).encode()).hexdigest()
