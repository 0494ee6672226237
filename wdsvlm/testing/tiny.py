"""Tiny, randomly initialised Hugging Face processors and models of the VLM families wdsvlm
supports, built offline.

Tests, the demo training script and benchmarks need a real processor (the family's chat
template, special tokens, image preprocessing and placeholder expansion) and a real model
class to run forward, but must not download checkpoints. Everything here is made from the
byte-level BPE tokenizer shipped in ``shards_example/tokenizer``, the family's published chat
template (written out below) and config classes shrunk to a few thousand parameters per layer.
Images are made small (a few dozen image tokens) so that a forward pass takes milliseconds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoTokenizer,
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    Idefics3ImageProcessorPil,
    Idefics3Processor,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    ProcessorMixin,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessorPil,
    Qwen2VLProcessor,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLProcessor,
    SmolVLMConfig,
    SmolVLMForConditionalGeneration,
    SmolVLMImageProcessorPil,
    SmolVLMProcessor,
)
from transformers.image_utils import (
    IMAGENET_STANDARD_MEAN,
    IMAGENET_STANDARD_STD,
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    PILImageResampling,
)
from transformers.video_processing_utils import VideoProcessorMixin

__all__ = ["FAMILIES", "ImagesOnlyVideoProcessor", "tiny_model", "tiny_processor"]

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "smolvlm", "idefics3")

TOKENIZER_DIR = Path(__file__).parents[2] / "shards_example" / "tokenizer"

# The text model of every family: big enough to have GQA (4 query heads, 2 key/value heads) and
# two layers (so packing bugs that only show after a layer are visible), small enough to be free.
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS  # 16: 8 rotary frequencies to share out between M-RoPE's t, h, w
INTERMEDIATE = 128
LAYERS = 2
# Vision towers: 2 layers of width 32.
VISION_HIDDEN = 32
VISION_HEADS = 2
VISION_LAYERS = 2

# SmolVLM / Idefics3 tiles: 64 px with 16 px patches (SmolVLM-256M/500M and SmolVLM2 use
# 16 px patches too) is 4x4 patches, and pixel shuffle by 2 leaves 2x2 = 4 tokens a tile.
SMOL_TILE = 64
SMOL_PATCH = 16
SMOL_SCALE = 2

_QWEN_TOKENS = [
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
_SMOL_TOKENS = [
    "<|im_start|>",
    "<end_of_utterance>",
    "<fake_token_around_image>",
    "<global-img>",
    "<image>",
    *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)),
]

# Qwen2-VL-*-Instruct's published template, which Qwen2.5-VL-*-Instruct ships unchanged: a
# default system turn, images and videos as pad tokens between vision markers.
QWEN2_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen3-VL-*-Instruct's published template without its tool-calling parts: no default system
# turn; a first system message is the header; user (and later system) turns render images,
# videos and text; assistant turns render their text only.
QWEN3_VL_TEMPLATE = """\
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].content is string %}
        {{- messages[0].content }}
    {%- else %}
        {%- for content in messages[0].content %}
            {%- if 'text' in content %}
                {{- content.text }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
    {{- '<|im_end|>\\n' }}
{%- endif %}
{%- set image_count = namespace(value=0) %}
{%- set video_count = namespace(value=0) %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content in message.content %}
                {%- if content.type == 'image' or 'image' in content or 'image_url' in content %}
                    {%- set image_count.value = image_count.value + 1 %}
                    {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}
                    <|vision_start|><|image_pad|><|vision_end|>
                {%- elif content.type == 'video' or 'video' in content %}
                    {%- set video_count.value = video_count.value + 1 %}
                    {%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}
                    <|vision_start|><|video_pad|><|vision_end|>
                {%- elif 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>' + message.role + '\\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content_item in message.content %}
                {%- if 'text' in content_item %}
                    {{- content_item.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# SmolVLM-Instruct's published template. It reads list content only: a plain string content
# renders nothing (its characters are iterated and none has a 'type').
_SMOL_BODY = (
    "{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
SMOLVLM_TEMPLATE = "<|im_start|>" + _SMOL_BODY
# Idefics3-8B-Llama3's published template: the same, after Llama 3's begin-of-text token.
IDEFICS3_TEMPLATE = "<|begin_of_text|>" + _SMOL_BODY


class ImagesOnlyVideoProcessor(VideoProcessorMixin):
    """Stands in for the video processor of an images-only processor.

    Qwen2/2.5/3-VL and SmolVLM processors take a video processor, and every real one subclasses
    ``BaseVideoProcessor``, which needs torchvision. This one has the attributes the processors
    read outside the video path (SmolVLM's ``apply_chat_template`` reads ``num_frames`` and
    ``fps`` for every conversation) and refuses videos with a clear error.
    """

    def __call__(self, videos: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("tiny processors handle images only (no video processor)")


class _ImagesOnly:
    """Lets a processor be built with an ``ImagesOnlyVideoProcessor`` without torchvision.

    ``ProcessorMixin.__init__`` checks each sub-processor's class by looking its base class's
    name up in the top-level ``transformers`` namespace, which exports ``VideoProcessorMixin``
    only when torchvision imports (transformers 5.24); otherwise the check fails with an
    AttributeError whatever is passed, ``None`` included. This does the same isinstance check
    against the class itself.
    """

    def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
        if argument_name == "video_processor":
            if not isinstance(argument, VideoProcessorMixin):
                raise TypeError(
                    f"Received a {type(argument).__name__} for argument video_processor, "
                    "but a VideoProcessorMixin was expected."
                )
            return VideoProcessorMixin
        return super().check_argument_for_proper_class(argument_name, argument)  # type: ignore[misc]


class TinyQwen2VLProcessor(_ImagesOnly, Qwen2VLProcessor):
    """``Qwen2VLProcessor`` that builds without torchvision (images only)."""


class TinyQwen2_5_VLProcessor(_ImagesOnly, Qwen2_5_VLProcessor):
    """``Qwen2_5_VLProcessor`` that builds without torchvision (images only)."""


class TinyQwen3VLProcessor(_ImagesOnly, Qwen3VLProcessor):
    """``Qwen3VLProcessor`` that builds without torchvision (images only)."""


class TinySmolVLMProcessor(_ImagesOnly, SmolVLMProcessor):
    """``SmolVLMProcessor`` that builds without torchvision (images only)."""


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {', '.join(FAMILIES)}")


def _tokenizer(family: str, chat_template: str) -> PreTrainedTokenizerBase:
    """A fresh copy of the shipped tokenizer with the family's special tokens (one id each)."""
    if not (TOKENIZER_DIR / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"wdsvlm.tiny needs the tokenizer shipped in the source tree at {TOKENIZER_DIR}, "
            "which this installation lacks; use a source checkout (pip install -e .)"
        )
    tok = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    if family.startswith("qwen"):
        specials, eos, pad, bos = _QWEN_TOKENS, "<|im_end|>", "<|endoftext|>", None
    elif family == "smolvlm":
        # SmolVLM pads with <|im_end|> and ends a turn with <end_of_utterance>.
        specials, eos, pad, bos = _SMOL_TOKENS, "<end_of_utterance>", "<|im_end|>", "<|im_start|>"
    else:
        specials = ["<|begin_of_text|>", *_SMOL_TOKENS]
        eos, pad, bos = "<end_of_utterance>", "<|pad|>", "<|begin_of_text|>"
    # Keep the shipped extra special tokens (replace=False): they stay special when decoding.
    tok.add_special_tokens(
        {"additional_special_tokens": specials}, replace_extra_special_tokens=False
    )
    tok.eos_token, tok.pad_token = eos, pad
    if bos is not None:
        tok.bos_token = bos
    # The published checkpoints ship the template with the tokenizer too: text-only code that
    # calls tokenizer.apply_chat_template sees the same rendering as the processor.
    tok.chat_template = chat_template
    return tok


def tiny_processor(family: str, **image_kwargs: Any) -> ProcessorMixin:
    """The family's processor over a small tokenizer and small images.

    ``image_kwargs`` override the image processor's settings (e.g. ``max_pixels`` for Qwen,
    ``max_image_size={"longest_edge": 128}`` and ``size={"longest_edge": 512}`` for SmolVLM).
    """
    _check_family(family)
    if family.startswith("qwen"):
        if family == "qwen3_vl":
            # Qwen3-VL: 16 px patches and mean/std 0.5 as published. Its published minimum
            # (256x256 px) would make every image 64+ tokens; 64x64 is 2x2 merged tokens,
            # the same minimum Qwen2-VL's 56x56 is with its 14 px patches.
            patch, mean, std, template = 16, [0.5] * 3, [0.5] * 3, QWEN3_VL_TEMPLATE
            cls: type[ProcessorMixin] = TinyQwen3VLProcessor
        else:
            patch, mean, std, template = 14, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, QWEN2_VL_TEMPLATE
            cls = TinyQwen2VLProcessor if family == "qwen2_vl" else TinyQwen2_5_VLProcessor
        factor = patch * 2
        settings: dict[str, Any] = {
            # At most 64 merged tokens (256 patches) an image; at least 2x2 merged tokens.
            "size": {"shortest_edge": 4 * factor * factor, "longest_edge": 64 * factor * factor},
            "patch_size": patch,
            "merge_size": 2,
            "temporal_patch_size": 2,
            "image_mean": list(mean),
            "image_std": list(std),
            "resample": PILImageResampling.BICUBIC,
        }
        image_processor = Qwen2VLImageProcessorPil(**{**settings, **image_kwargs})
        tokenizer = _tokenizer(family, template)
        video = ImagesOnlyVideoProcessor(
            patch_size=image_processor.patch_size,
            merge_size=image_processor.merge_size,
            temporal_patch_size=image_processor.temporal_patch_size,
        )
        return cls(image_processor, tokenizer, video, chat_template=template)

    smol = family == "smolvlm"
    settings = {
        # The image is resized to a longest edge of 4 tiles, then cut into tiles (plus a global
        # view), as SmolVLM and Idefics3 do with 4 * 384 px and 4 * 364 px.
        "size": {"longest_edge": 4 * SMOL_TILE},
        "max_image_size": {"longest_edge": SMOL_TILE},
        "do_image_splitting": True,
        "image_mean": list(IMAGENET_STANDARD_MEAN),
        "image_std": list(IMAGENET_STANDARD_STD),
        "resample": PILImageResampling.LANCZOS,
    }
    image_cls = SmolVLMImageProcessorPil if smol else Idefics3ImageProcessorPil
    image_processor = image_cls(**{**settings, **image_kwargs})
    seq_len = _smol_image_seq_len(image_processor.max_image_size["longest_edge"])
    template = SMOLVLM_TEMPLATE if smol else IDEFICS3_TEMPLATE
    tokenizer = _tokenizer(family, template)
    if smol:
        # SmolVLM's published video processor samples 64 frames at most, 1 a second.
        video = ImagesOnlyVideoProcessor(num_frames=64, fps=1)
        return TinySmolVLMProcessor(
            image_processor, tokenizer, video, image_seq_len=seq_len, chat_template=template
        )
    return Idefics3Processor(
        image_processor, tokenizer, image_seq_len=seq_len, chat_template=template
    )


def _smol_image_seq_len(tile: int) -> int:
    """Tokens a tile becomes: its patches, pixel-shuffled by the scale factor."""
    if tile % (SMOL_PATCH * SMOL_SCALE):
        raise ValueError(
            f"tile size (max_image_size longest_edge) {tile} is not a multiple of "
            f"{SMOL_PATCH * SMOL_SCALE} (patch {SMOL_PATCH} x scale factor {SMOL_SCALE})"
        )
    return (tile // SMOL_PATCH) ** 2 // SMOL_SCALE**2


def _ids(tokenizer: PreTrainedTokenizerBase, *tokens: str) -> list[int]:
    return [tokenizer.convert_tokens_to_ids(t) for t in tokens]


def _text_config(tokenizer: PreTrainedTokenizerBase, **extra: Any) -> dict[str, Any]:
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "max_position_embeddings": 8192,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        # Without a cache the causal mask follows packed rows (position ids that restart, no
        # attention mask); with one (use_cache=True) transformers skips that detection.
        "use_cache": False,
        **extra,
    }


def tiny_model(
    family: str, processor: ProcessorMixin | None = None, *, seed: int = 0
) -> PreTrainedModel:
    """A randomly initialised float32 model of the family that accepts ``processor``'s output.

    ``processor`` defaults to ``tiny_processor(family)``; the vocabulary, special token ids and
    the vision tower's patch, merge and tile sizes are read from it. Attention is SDPA, which
    (like eager) masks packed rows by their restarting position ids when no attention mask is
    given; Qwen models need their position ids as ``[4, batch, length]`` for that, the text
    positions first (otherwise transformers builds no packed mask).
    """
    _check_family(family)
    processor = tiny_processor(family) if processor is None else processor
    tokenizer = processor.tokenizer
    torch.manual_seed(seed)
    if family.startswith("qwen"):
        ip = processor.image_processor
        image_id, video_id, start_id, end_id, bos_id = _ids(
            tokenizer,
            "<|image_pad|>",
            "<|video_pad|>",
            "<|vision_start|>",
            "<|vision_end|>",
            "<|endoftext|>",
        )
        patches = {
            "patch_size": ip.patch_size,
            "spatial_merge_size": ip.merge_size,
            "temporal_patch_size": ip.temporal_patch_size,
        }
        ids = {
            "image_token_id": image_id,
            "video_token_id": video_id,
            "vision_start_token_id": start_id,
            "vision_end_token_id": end_id,
        }
        if family == "qwen3_vl":
            # Interleaved M-RoPE as published (24, 20, 20 of 64 frequencies): the 8 frequencies
            # of a 16-wide head go t h w t h w t h.
            rope = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [3, 3, 2]}
            rope["mrope_interleaved"] = True
            text = _text_config(tokenizer, head_dim=HEAD_DIM, rope_parameters=rope)
            vision = {
                "depth": VISION_LAYERS,
                "hidden_size": VISION_HIDDEN,
                "intermediate_size": 2 * VISION_HIDDEN,
                "num_heads": VISION_HEADS,
                "out_hidden_size": HIDDEN,
                # An 8x8 grid of learned position embeddings, interpolated to the image's grid.
                "num_position_embeddings": 64,
                # Deepstack: the first layer's features are also added into the text model.
                "deepstack_visual_indexes": [0],
                **patches,
            }
            config: Any = Qwen3VLConfig(text_config=text, vision_config=vision, **ids)
            model_cls: type[PreTrainedModel] = Qwen3VLForConditionalGeneration
        else:
            # Qwen2-VL and 2.5-VL split 64 frequencies 16, 24, 24 in blocks; 2, 3, 3 of 8 here.
            rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}
            text = _text_config(
                tokenizer, bos_token_id=bos_id, rms_norm_eps=1e-6, rope_parameters=rope
            )
            if family == "qwen2_vl":
                vision = {
                    "depth": VISION_LAYERS,
                    "embed_dim": VISION_HIDDEN,
                    "hidden_size": HIDDEN,  # the merger's output: the text model's width
                    "num_heads": VISION_HEADS,
                    "mlp_ratio": 2,
                    **patches,
                }
                config = Qwen2VLConfig(text_config=text, vision_config=vision, **ids)
                model_cls = Qwen2VLForConditionalGeneration
            else:
                vision = {
                    "depth": VISION_LAYERS,
                    "hidden_size": VISION_HIDDEN,
                    "intermediate_size": 2 * VISION_HIDDEN,
                    "num_heads": VISION_HEADS,
                    "out_hidden_size": HIDDEN,
                    # Windows of 2x2 merged tokens (published: 112 px = 4x4), so that windowed
                    # attention is exercised by small images; the last layer attends fully.
                    "window_size": 2 * ip.merge_size * ip.patch_size,
                    "fullatt_block_indexes": [VISION_LAYERS - 1],
                    **patches,
                }
                config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
                model_cls = Qwen2_5_VLForConditionalGeneration
    else:
        tile = processor.image_processor.max_image_size["longest_edge"]
        if processor.image_seq_len != _smol_image_seq_len(tile):
            raise ValueError(
                f"processor.image_seq_len {processor.image_seq_len} does not match tiles of "
                f"{tile} px ({_smol_image_seq_len(tile)} tokens)"
            )
        text = _text_config(
            tokenizer,
            model_type="llama",
            bos_token_id=tokenizer.bos_token_id,
            rms_norm_eps=1e-5,
            rope_theta=1e5,
        )
        vision = {
            "hidden_size": VISION_HIDDEN,
            "intermediate_size": 2 * VISION_HIDDEN,
            "num_hidden_layers": VISION_LAYERS,
            "num_attention_heads": VISION_HEADS,
            "image_size": tile,
            "patch_size": SMOL_PATCH,
        }
        image_id = tokenizer.convert_tokens_to_ids("<image>")
        config_cls = SmolVLMConfig if family == "smolvlm" else Idefics3Config
        # use_cache: the outer model makes the cache from its own config (see _text_config).
        config = config_cls(
            text_config=text,
            vision_config=vision,
            scale_factor=SMOL_SCALE,
            image_token_id=image_id,
            use_cache=False,
        )
        model_cls = (
            SmolVLMForConditionalGeneration
            if family == "smolvlm"
            else Idefics3ForConditionalGeneration
        )
    return model_cls._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
