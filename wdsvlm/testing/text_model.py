"""The sizes of every family's tiny model and the config of its text model."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

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


def text_config(tokenizer: PreTrainedTokenizerBase, **extra: Any) -> dict[str, Any]:
    """The tiny text model's config over ``tokenizer``'s vocabulary; ``extra`` adds to it."""
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
