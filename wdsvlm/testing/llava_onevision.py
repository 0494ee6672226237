"""The tiny LLaVA-OneVision: a processor with the chat template of transformers' own
LLaVA-OneVision tests and anyres over 56 px views, and the config of its random model."""

from __future__ import annotations

from typing import Any

from transformers import (
    LlavaOnevisionConfig,
    LlavaOnevisionForConditionalGeneration,
    LlavaOnevisionImageProcessorPil,
    LlavaOnevisionProcessor,
    PreTrainedModel,
    ProcessorMixin,
)
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, PILImageResampling

from .images_only import ImagesOnly, ImagesOnlyVideoProcessor
from .text_model import VISION_HEADS, VISION_HIDDEN, VISION_LAYERS, text_config
from .tokenizer import family_tokenizer

# Views of 56 px in 14 px patches (as SigLIP's 384 px views are 27 x 27 of them): 4 x 4 = 16
# features a view. The published grid of 1 to 6 views a side, scaled to 56 px.
ONEVISION_VIEW = 56
ONEVISION_PATCH = 14
ONEVISION_PINPOINTS = [
    [ONEVISION_VIEW * r, ONEVISION_VIEW * c] for r in range(1, 7) for c in range(1, 7)
]

ONEVISION_TOKENS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<image>", "<video>"]

# The template of transformers' LLaVA-OneVision processor tests: a turn's images first, then
# its text pieces, each after a newline; the answers inside generation tags.
ONEVISION_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + ' '}}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}"
    "{{ '<video>' }}{% endfor %}"
    "{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ '\\n' + content['text'] }}{% endfor %}"
    "{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ '\\n' + content['text'] }}{% endgeneration %}{% endfor %}"
    "{% endif %}{{'<|im_end|>'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class TinyLlavaOnevisionProcessor(ImagesOnly, LlavaOnevisionProcessor):
    """``LlavaOnevisionProcessor`` that builds without torchvision (images only)."""


def onevision_processor(**image_kwargs: Any) -> ProcessorMixin:
    """The tiny processor of ``llava_onevision``."""
    settings: dict[str, Any] = {
        "size": {"height": ONEVISION_VIEW, "width": ONEVISION_VIEW},
        "image_grid_pinpoints": ONEVISION_PINPOINTS,
        "image_mean": list(OPENAI_CLIP_MEAN),
        "image_std": list(OPENAI_CLIP_STD),
        "resample": PILImageResampling.BICUBIC,
    }
    image_processor = LlavaOnevisionImageProcessorPil(**{**settings, **image_kwargs})
    tokenizer = family_tokenizer(
        ONEVISION_TOKENS,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        bos=None,
        chat_template=ONEVISION_TEMPLATE,
    )
    view = image_processor.size["height"]
    return TinyLlavaOnevisionProcessor(
        image_processor,
        tokenizer,
        onevision_video_processor(settings),
        num_image_tokens=(view // ONEVISION_PATCH) ** 2,
        vision_feature_select_strategy="full",  # SigLIP has no CLS token to drop
        chat_template=ONEVISION_TEMPLATE,
        vision_aspect_ratio="anyres_max_9",
    )


def onevision_video_processor(settings: dict) -> Any:
    """The real video processor (which needs torchvision) with the image settings, sampling 4
    frames of each video (the model stacks a batch's videos: they need one frame count);
    without torchvision, a stand-in that refuses videos."""
    try:
        import torchvision  # noqa: F401
    except ImportError:
        return ImagesOnlyVideoProcessor()
    from transformers import LlavaOnevisionVideoProcessor

    video = {k: settings[k] for k in ("size", "image_mean", "image_std", "resample")}
    return LlavaOnevisionVideoProcessor(**video, do_sample_frames=True, num_frames=4)


def onevision_model_config(processor: ProcessorMixin) -> tuple[Any, type[PreTrainedModel]]:
    """The tiny model's config and class for ``processor``'s vocabulary, special token ids,
    view size and resolutions."""
    tokenizer, ip = processor.tokenizer, processor.image_processor
    view = ip.size["height"]
    vision = {
        "model_type": "siglip_vision_model",
        "hidden_size": VISION_HIDDEN,
        "intermediate_size": 2 * VISION_HIDDEN,
        "num_hidden_layers": VISION_LAYERS,
        "num_attention_heads": VISION_HEADS,
        "image_size": view,
        "patch_size": ONEVISION_PATCH,
        "vision_use_head": False,
    }
    text = text_config(tokenizer, model_type="qwen2", rope_theta=1e6)
    config = LlavaOnevisionConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        video_token_index=tokenizer.convert_tokens_to_ids("<video>"),
        vision_feature_select_strategy=processor.vision_feature_select_strategy,
        vision_feature_layer=-1,
        vision_aspect_ratio=processor.vision_aspect_ratio,
        image_grid_pinpoints=[list(p) for p in ip.image_grid_pinpoints],
        use_cache=False,
    )
    return config, LlavaOnevisionForConditionalGeneration
