"""Loading a Qwen3.5 hybrid model from a local directory, and writing random-init ones for tests.

The robot loads real weights with `load_model(path)`; tests, the demo and benchmarks load a tiny
random model written by `make_model` through exactly the same `from_pretrained(path)` call. Nothing
here ever contacts a model hub.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import pre_tokenizers
from transformers import (
    AutoModelForImageTextToText,
    AutoTokenizer,
    Qwen2VLImageProcessor,
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5Tokenizer,
    Qwen3VLProcessor,
    Qwen3VLVideoProcessor,
)
from transformers.models.qwen3_5 import modeling_qwen3_5
from transformers.utils import logging as transformers_logging

from .chunks import DEFAULT_PIXEL_BUDGET

# Offsets of Qwen's special tokens from <|vision_start|>, as in Qwen2.5/3/3.5's vocabularies.
SPECIAL_TOKEN_OFFSETS = {
    "<|endoftext|>": -9,
    "<|im_start|>": -8,
    "<|im_end|>": -7,
    "<|object_ref_start|>": -6,
    "<|object_ref_end|>": -5,
    "<|box_start|>": -4,
    "<|box_end|>": -3,
    "<|quad_start|>": -2,
    "<|quad_end|>": -1,
    "<|vision_start|>": 0,
    "<|vision_end|>": 1,
    "<|vision_pad|>": 2,
    "<|image_pad|>": 3,
    "<|video_pad|>": 4,
}
THINK_TOKENS = ("<think>", "</think>")

# Qwen's chat template, reduced to what the memory uses: text, image and video items.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'video' -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif item['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif item['type'] == 'text' -%}{{- item['text'] -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
)

TINY_TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3
    + ["full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    max_position_embeddings=262144,
    rope_parameters=dict(
        rope_type="default",
        rope_theta=10_000_000,
        partial_rotary_factor=0.25,
        mrope_interleaved=True,
        mrope_section=[2, 1, 1],
    ),
    attn_output_gate=True,
    tie_word_embeddings=False,
)
TINY_VISION = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=2304,
)
TINY_VISION_START_ID = 265  # specials right after the 256 byte tokens

# transformers' own bindings of the gated delta rule (fla's kernels when fla imports), kept before
# select_gated_delta_kernels rebinds them.
_KERNEL_BINDINGS = {
    name: getattr(modeling_qwen3_5, name)
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
}


# The model shipped with the package (README "The shipped model"): used wherever a model path is
# optional and left empty. MODEL_INFO_FILE beside a model's weights records how it was trained.
SHIPPED_MODEL = Path(__file__).parent / "models" / "scenes-tiny"
MODEL_INFO_FILE = "deltas_model.json"


def default_model_path() -> Path:
    """The shipped model: a tiny Qwen3.5 trained on generated scene streams."""
    return SHIPPED_MODEL


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


def select_gated_delta_kernels(device: torch.device) -> bool:
    """Use flash-linear-attention's kernels on CUDA, the pure-torch recurrence elsewhere.

    transformers binds fla's Triton kernels at import time whenever `fla.ops` imports, without
    checking for a GPU, and they crash on a CPU-only machine. The torch reference functions stay
    reachable through `__wrapped__`, so on CPU the module's bindings are pointed back at them.
    Returns whether fla's kernels are in use.
    """
    use_fla = device.type == "cuda" and all(map(_binds_external_kernel, _KERNEL_BINDINGS.values()))
    for name, bound in _KERNEL_BINDINGS.items():
        setattr(modeling_qwen3_5, name, bound if use_fla else inspect.unwrap(bound))
    return use_fla


def _binds_external_kernel(wrapper) -> bool:
    """Whether transformers' kernel wrapper resolved to a package implementation, not torch."""
    closure = dict(zip(wrapper.__code__.co_freevars, wrapper.__closure__ or ()))
    cell = closure.get("is_new_implementation")
    return bool(cell.cell_contents) if cell is not None else False


def load_model(
    path: str | Path, device: str = "auto", dtype: str = "auto"
) -> LoadedModel:
    """Load model and tokenizer from a local directory; never from a hub.

    device: "auto" (CUDA when available), "cpu", "cuda", "cuda:N".
    dtype: "auto" (bf16 on CUDA, float32 on CPU), "float32", "bfloat16", "float16".
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no model at {path}: config.json is missing")
    torch_device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    )
    if torch_device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {device!r} requested but CUDA is not available")
    torch_dtype = default_dtype(torch_device) if dtype == "auto" else getattr(torch, dtype)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    fla = select_gated_delta_kernels(torch_device)
    # The kernel hub's "falling back to the reference implementation" notices and the weight
    # loading progress bar are noise in a node's log; real problems still raise.
    logging.getLogger("transformers.integrations.hub_kernels").setLevel(logging.ERROR)
    transformers_logging.disable_progress_bar()
    model = AutoModelForImageTextToText.from_pretrained(
        path, dtype=torch_dtype, local_files_only=True
    )
    model.to(torch_device).eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return LoadedModel(model, tokenizer, path, torch_device, torch_dtype, fla)


def make_tokenizer(vision_start_id: int) -> Qwen3_5Tokenizer:
    """A byte-level Qwen3.5 tokenizer: the 256 byte symbols, no merges, Qwen's special tokens.

    Special tokens sit at the same offsets from <|vision_start|> as in Qwen's vocabulary, so a
    config with the real token ids (the 9B one) gets a tokenizer that agrees with it.
    """
    vocab = {symbol: i for i, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    specials = {tok: vision_start_id + off for tok, off in SPECIAL_TOKEN_OFFSETS.items()}
    top = max(specials.values())
    specials.update({tok: top + 1 + i for i, tok in enumerate(THINK_TOKENS)})
    if min(specials.values()) < len(vocab):
        raise ValueError("vision_start_token_id leaves no room for the byte vocabulary")
    tokenizer = Qwen3_5Tokenizer(
        vocab={**vocab, **specials},
        merges=[],
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [t for t in specials if t not in THINK_TOKENS]}
    )
    tokenizer.add_tokens(list(THINK_TOKENS))
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_config() -> Qwen3_5Config:
    """A Qwen3.5 small enough for CPU tests: 8 layers (6 Gated DeltaNet + 2 attention, 3:1)."""
    vs = TINY_VISION_START_ID
    return Qwen3_5Config(
        text_config=dict(TINY_TEXT, vocab_size=320, eos_token_id=vs - 7),
        vision_config=dict(TINY_VISION, out_hidden_size=TINY_TEXT["hidden_size"]),
        vision_start_token_id=vs,
        vision_end_token_id=vs + 1,
        image_token_id=vs + 3,
        video_token_id=vs + 4,
        tie_word_embeddings=False,
    )


def config_from_file(path: str | Path) -> Qwen3_5Config:
    """A Qwen3.5 config from a config.json-style file (e.g. the real 9B dimensions)."""
    raw = json.loads(Path(path).read_text())
    raw = {k: v for k, v in raw.items() if not k.startswith("_")}
    if raw.pop("model_type", "qwen3_5") != "qwen3_5":
        raise ValueError(f"{path}: model_type must be qwen3_5")
    raw.pop("architectures", None)
    return Qwen3_5Config(**raw)


@torch.no_grad()
def init_decay_like_trained(model: Qwen3_5ForConditionalGeneration, seed: int) -> None:
    """Give every Gated DeltaNet layer the decay spread of fla's init (alpha ~ 0.2-0.999).

    transformers' default init (A ~ U(0.01, 16), dt_bias = 1) makes nearly every head forget within
    a few tokens, so the state only holds the end of a chunk and drift sees nothing but scene cuts.
    fla's init: A ~ U(1, 16), dt ~ logU(1e-3, 1e-1), dt_bias = softplus^-1(dt).
    """
    gen = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, modeling_qwen3_5.Qwen3_5GatedDeltaNet):
            heads = module.A_log.numel()
            a = torch.empty(heads).uniform_(1.0, 16.0, generator=gen)
            log_dt = torch.empty(heads).uniform_(math.log(1e-3), math.log(1e-1), generator=gen)
            dt = log_dt.exp()
            module.A_log.copy_(a.log())
            module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))


def make_model(
    out_dir: str | Path,
    config: Qwen3_5Config | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a random-init Qwen3.5 model + tokenizer that `load_model` reads like real weights."""
    out_dir = Path(out_dir)
    config = config or tiny_config()
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = Qwen3_5ForConditionalGeneration(config).to(dtype)
    init_decay_like_trained(model, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer = make_tokenizer(config.vision_start_token_id)
    tokenizer.save_pretrained(out_dir)
    make_processor(tokenizer, config).save_pretrained(out_dir)
    return out_dir


def make_processor(
    tokenizer: Qwen3_5Tokenizer, config: Qwen3_5Config, pixel_budget: int = DEFAULT_PIXEL_BUDGET
) -> Qwen3VLProcessor:
    """Qwen3-VL's official processor for this model, sized to `pixel_budget` pixels per frame."""
    vision = config.vision_config
    geometry = dict(patch_size=vision.patch_size, merge_size=vision.spatial_merge_size,
                    temporal_patch_size=vision.temporal_patch_size,
                    image_mean=[0.5] * 3, image_std=[0.5] * 3)
    video = Qwen3VLVideoProcessor(
        size={"shortest_edge": 32 * 32, "longest_edge": pixel_budget * vision.temporal_patch_size},
        fps=2, do_sample_frames=False, cap_pixels_per_frame=False, **geometry,
    )
    return Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(**geometry),
                            tokenizer=tokenizer, video_processor=video)
