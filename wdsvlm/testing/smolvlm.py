"""The tiny SmolVLM and Idefics3: processors with the published chat templates and tiling
(64 px tiles), and the configs of their random models."""

from __future__ import annotations

from typing import Any

from transformers import (
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    Idefics3ImageProcessorPil,
    Idefics3Processor,
    PreTrainedModel,
    ProcessorMixin,
    SmolVLMConfig,
    SmolVLMForConditionalGeneration,
    SmolVLMImageProcessorPil,
    SmolVLMProcessor,
)
from transformers.image_utils import (
    IMAGENET_STANDARD_MEAN,
    IMAGENET_STANDARD_STD,
    PILImageResampling,
)

from .images_only import ImagesOnly, ImagesOnlyVideoProcessor
from .text_model import VISION_HEADS, VISION_HIDDEN, VISION_LAYERS, text_config
from .tokenizer import family_tokenizer

# SmolVLM / Idefics3 tiles: 64 px with 16 px patches (SmolVLM-256M/500M and SmolVLM2 use
# 16 px patches too) is 4x4 patches, and pixel shuffle by 2 leaves 2x2 = 4 tokens a tile.
SMOL_TILE = 64
SMOL_PATCH = 16
SMOL_SCALE = 2

SMOL_TOKENS = [
    "<|im_start|>",
    "<end_of_utterance>",
    "<fake_token_around_image>",
    "<global-img>",
    "<image>",
    *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)),
]

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


class TinySmolVLMProcessor(ImagesOnly, SmolVLMProcessor):
    """``SmolVLMProcessor`` that builds without torchvision (images only)."""


def smol_processor(family: str, **image_kwargs: Any) -> ProcessorMixin:
    """The tiny processor of ``smolvlm`` or ``idefics3``."""
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
    seq_len = smol_image_seq_len(image_processor.max_image_size["longest_edge"])
    if smol:
        # SmolVLM pads with <|im_end|> and ends a turn with <end_of_utterance>.
        tokenizer = family_tokenizer(
            SMOL_TOKENS,
            eos="<end_of_utterance>",
            pad="<|im_end|>",
            bos="<|im_start|>",
            chat_template=SMOLVLM_TEMPLATE,
        )
        video = smol_video_processor(settings)
        return TinySmolVLMProcessor(
            image_processor, tokenizer, video, image_seq_len=seq_len, chat_template=SMOLVLM_TEMPLATE
        )
    tokenizer = family_tokenizer(
        ["<|begin_of_text|>", *SMOL_TOKENS],
        eos="<end_of_utterance>",
        pad="<|pad|>",
        bos="<|begin_of_text|>",
        chat_template=IDEFICS3_TEMPLATE,
    )
    return Idefics3Processor(
        image_processor, tokenizer, image_seq_len=seq_len, chat_template=IDEFICS3_TEMPLATE
    )


def smol_video_processor(settings: dict) -> Any:
    """SmolVLM's real video processor (which needs torchvision) with the image settings,
    sampling 2 frames a second, 8 at most (the published one: 1 a second, 64 at most);
    without torchvision, a stand-in that refuses videos."""
    try:
        import torchvision  # noqa: F401
    except ImportError:
        return ImagesOnlyVideoProcessor(num_frames=64, fps=1)
    from transformers import SmolVLMVideoProcessor

    keep = ("size", "max_image_size", "image_mean", "image_std", "resample")
    video = {k: settings[k] for k in keep}
    return SmolVLMVideoProcessor(**video, do_sample_frames=True, num_frames=8, fps=2)


def smol_image_seq_len(tile: int) -> int:
    """Tokens a tile becomes: its patches, pixel-shuffled by the scale factor."""
    if tile % (SMOL_PATCH * SMOL_SCALE):
        raise ValueError(
            f"tile size (max_image_size longest_edge) {tile} is not a multiple of "
            f"{SMOL_PATCH * SMOL_SCALE} (patch {SMOL_PATCH} x scale factor {SMOL_SCALE})"
        )
    return (tile // SMOL_PATCH) ** 2 // SMOL_SCALE**2


def smol_model_config(family: str, processor: ProcessorMixin) -> tuple[Any, type[PreTrainedModel]]:
    """The tiny model's config and class for ``processor``'s vocabulary, special token ids
    and tile size."""
    tokenizer = processor.tokenizer
    tile = processor.image_processor.max_image_size["longest_edge"]
    if processor.image_seq_len != smol_image_seq_len(tile):
        raise ValueError(
            f"processor.image_seq_len {processor.image_seq_len} does not match tiles of "
            f"{tile} px ({smol_image_seq_len(tile)} tokens)"
        )
    text = text_config(
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
    config_cls = SmolVLMConfig if family == "smolvlm" else Idefics3Config
    # use_cache: the outer model makes the cache from its own config (see text_config).
    config = config_cls(
        text_config=text,
        vision_config=vision,
        scale_factor=SMOL_SCALE,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        use_cache=False,
    )
    if family == "smolvlm":
        return config, SmolVLMForConditionalGeneration
    return config, Idefics3ForConditionalGeneration
