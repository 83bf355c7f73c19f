"""Writing random-init Qwen3.5 models (and their tokenizer and processor) for tests and demos.

`make_model(dir)` writes a tiny model that `model.load_model(dir)` reads exactly like real weights
(the same `from_pretrained` call); `config_from_file` builds one with real (e.g. 9B) dimensions.
Only transformers' public classes are used here; the decay init reaches the Gated DeltaNet modules
through `backend`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from tokenizers import pre_tokenizers
from transformers import (
    Qwen2VLImageProcessor,
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5Tokenizer,
    Qwen3VLProcessor,
    Qwen3VLVideoProcessor,
)

from .config import DEFAULT_PIXEL_BUDGET
from .kernels import linear_attention_modules
from .loader import read_config

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

# Qwen's chat template, reduced to what the memory uses: text, image and video items. The
# generation prompt follows Qwen3.5's published rule: a reasoning block opens unless the caller
# passes enable_thinking as false.
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
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- else -%}{{- '<think>\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)

TINY_TEXT = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=8,
    layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3
    + ["full_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4,
    max_position_embeddings=262144,
    rope_parameters=dict(rope_type="default", rope_theta=10_000_000, partial_rotary_factor=0.25,
                         mrope_interleaved=True, mrope_section=[2, 1, 1]),
    attn_output_gate=True, tie_word_embeddings=False,
)
TINY_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                   spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304)
TINY_VISION_START_ID = 265  # specials right after the 256 byte tokens



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


def tiny_config(text: dict | None = None, vision: dict | None = None,
                vocab_size: int = 320) -> Qwen3_5Config:
    """A Qwen3.5 small enough for CPU tests: 8 layers (6 Gated DeltaNet + 2 attention, 3:1).

    `text` / `vision` override TINY_TEXT / TINY_VISION and `vocab_size` (rounded up to a
    multiple of 16) makes room for added tokens: the trained scene model is built so.
    """
    vs = TINY_VISION_START_ID
    text = {**TINY_TEXT, **(text or {})}
    return Qwen3_5Config(
        text_config=dict(text, vocab_size=math.ceil(vocab_size / 16) * 16, eos_token_id=vs - 7),
        vision_config=dict(TINY_VISION, **(vision or {}), out_hidden_size=text["hidden_size"]),
        vision_start_token_id=vs,
        vision_end_token_id=vs + 1,
        image_token_id=vs + 3,
        video_token_id=vs + 4,
        tie_word_embeddings=False,
    )


def config_from_file(path: str | Path) -> Qwen3_5Config:
    """A Qwen3.5 config from a config.json-style file (e.g. the real 9B dimensions)."""
    return read_config(path)


@torch.no_grad()
def init_decay_like_trained(model: Qwen3_5ForConditionalGeneration, seed: int) -> None:
    """Give every Gated DeltaNet layer the decay spread of fla's init (alpha ~ 0.2-0.999).

    transformers' default init (A ~ U(0.01, 16), dt_bias = 1) makes nearly every head forget within
    a few tokens, so the state only holds the end of a chunk and drift sees nothing but scene cuts.
    fla's init: A ~ U(1, 16), dt ~ logU(1e-3, 1e-1), dt_bias = softplus^-1(dt).
    """
    gen = torch.Generator().manual_seed(seed)
    for module in linear_attention_modules(model):
        heads = module.A_log.numel()
        a = torch.empty(heads).uniform_(1.0, 16.0, generator=gen)
        log_dt = torch.empty(heads).uniform_(math.log(1e-3), math.log(1e-1), generator=gen)
        dt = log_dt.exp()
        module.A_log.copy_(a.log())
        module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))


def init_model(config: Qwen3_5Config, seed: int = 0) -> Qwen3_5ForConditionalGeneration:
    """A random-init Qwen3.5 of `config` on the CPU, with the decay spread of fla's init."""
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = Qwen3_5ForConditionalGeneration(config)
    init_decay_like_trained(model, seed)
    return model


def make_model(
    out_dir: str | Path,
    config: Qwen3_5Config | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    shards: int | None = None,
) -> Path:
    """Write a random-init Qwen3.5 model + tokenizer that `load_model` reads like real weights.

    shards: lay the directory out as a published checkpoint instead (`write_published_layout`),
    the weights split into about that many safetensors files (1: one model.safetensors), so the
    files a user downloads are what the tests load.
    """
    out_dir = Path(out_dir)
    config = config or tiny_config()
    model = init_model(config, seed).to(dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(config.vision_start_token_id)
    processor = make_processor(tokenizer, config)
    if shards is not None:
        write_published_layout(out_dir, model, processor, shards)
        return out_dir
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    return out_dir


def write_published_layout(out_dir: Path, model: Qwen3_5ForConditionalGeneration,
                           processor: Qwen3VLProcessor, shards: int) -> None:
    """The files of a published Qwen3.5 repository: config.json, generation_config.json (its
    `eos_token_id` list: <|im_end|> and <|endoftext|>), preprocessor_config.json,
    video_preprocessor_config.json, chat_template.jinja, tokenizer.json, tokenizer_config.json
    and the weights, as model-0000N-of-0000M.safetensors with model.safetensors.index.json when
    `shards` > 1 (each at most 1/shards of the whole, so a few more files when tensors do not
    divide evenly)."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(out_dir, **({"max_shard_size": math.ceil(total / shards)}
                                      if shards > 1 else {}))
    tokenizer = processor.tokenizer
    stops = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    (out_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": pad, "eos_token_id": stops, "pad_token_id": pad}, indent=2) + "\n")
    tokenizer.save_pretrained(out_dir)
    processor.image_processor.save_pretrained(out_dir)
    processor.video_processor.save_pretrained(out_dir)


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
