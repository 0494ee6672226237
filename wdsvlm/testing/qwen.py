"""The tiny Qwen2-VL, Qwen2.5-VL and Qwen3-VL: processors with the published chat templates and
image settings (small images), and the configs of their random models."""

from __future__ import annotations

from typing import Any

from transformers import (
    PreTrainedModel,
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
)
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, PILImageResampling

from .images_only import ImagesOnly, ImagesOnlyVideoProcessor
from .text_model import HEAD_DIM, HIDDEN, VISION_HEADS, VISION_HIDDEN, VISION_LAYERS, text_config
from .tokenizer import family_tokenizer

QWEN_TOKENS = [
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
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


class TinyQwen2VLProcessor(ImagesOnly, Qwen2VLProcessor):
    """``Qwen2VLProcessor`` that builds without torchvision (images only)."""


class TinyQwen2_5_VLProcessor(ImagesOnly, Qwen2_5_VLProcessor):
    """``Qwen2_5_VLProcessor`` that builds without torchvision (images only)."""


class TinyQwen3VLProcessor(ImagesOnly, Qwen3VLProcessor):
    """``Qwen3VLProcessor`` that builds without torchvision (images only)."""


def qwen_processor(family: str, **image_kwargs: Any) -> ProcessorMixin:
    """The tiny processor of ``qwen2_vl``, ``qwen2_5_vl`` or ``qwen3_vl``."""
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
    tokenizer = family_tokenizer(
        QWEN_TOKENS, eos="<|im_end|>", pad="<|endoftext|>", bos=None, chat_template=template
    )
    return cls(
        image_processor, tokenizer, video_processor(family, settings), chat_template=template
    )


def video_processor(family: str, settings: dict) -> Any:
    """The family's real video processor (which needs torchvision) with the image settings,
    sampling 2 frames a second, 4 to 16 of them; without torchvision, a stand-in that
    refuses videos."""
    try:
        import torchvision  # noqa: F401
    except ImportError:
        return ImagesOnlyVideoProcessor(
            patch_size=settings["patch_size"],
            merge_size=settings["merge_size"],
            temporal_patch_size=settings["temporal_patch_size"],
        )
    from transformers import Qwen2VLVideoProcessor, Qwen3VLVideoProcessor

    video = {**settings, "fps": 2, "min_frames": 4, "max_frames": 16, "do_sample_frames": True}
    video["cap_pixels_per_frame"] = False  # what the processors do today (and say so)
    if family == "qwen3_vl":  # its pixel bounds are over all the frames of a video
        size = settings["size"]
        video["size"] = {**size, "longest_edge": size["longest_edge"] * 8}
        return Qwen3VLVideoProcessor(**video)
    return Qwen2VLVideoProcessor(**video)


def qwen_model_config(family: str, processor: ProcessorMixin) -> tuple[Any, type[PreTrainedModel]]:
    """The tiny model's config and class for ``processor``'s vocabulary, special token ids
    and patch sizes."""
    tokenizer, ip = processor.tokenizer, processor.image_processor
    image_id, video_id, start_id, end_id, bos_id = (
        tokenizer.convert_tokens_to_ids(t)
        for t in (
            "<|image_pad|>",
            "<|video_pad|>",
            "<|vision_start|>",
            "<|vision_end|>",
            "<|endoftext|>",
        )
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
        text = text_config(tokenizer, head_dim=HEAD_DIM, rope_parameters=rope)
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
        config = Qwen3VLConfig(text_config=text, vision_config=vision, **ids)
        return config, Qwen3VLForConditionalGeneration
    # Qwen2-VL and 2.5-VL split 64 frequencies 16, 24, 24 in blocks; 2, 3, 3 of 8 here.
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}
    text = text_config(tokenizer, bos_token_id=bos_id, rms_norm_eps=1e-6, rope_parameters=rope)
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
        return config, Qwen2VLForConditionalGeneration
    vision = {
        "depth": VISION_LAYERS,
        "hidden_size": VISION_HIDDEN,
        "intermediate_size": 2 * VISION_HIDDEN,
        "num_heads": VISION_HEADS,
        "out_hidden_size": HIDDEN,
        # Windows of 2x2 merged tokens (published: 112 px = 4x4), so that windowed
        # attention is exercised by small images; the last layer attends fully.
        "window_size": 2 * ip.merge_size * ip.patch_size,
        "tokens_per_second": 2,  # as published (the class defaults to 4)
        "fullatt_block_indexes": [VISION_LAYERS - 1],
        **patches,
    }
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
    return config, Qwen2_5_VLForConditionalGeneration
