"""The tiny processors' tokenizer: the byte-level BPE tokenizer trained on the text of
``shards_example`` (``scripts/make_example.py``), shipped as package data in
``example_tokenizer/`` so that ``wdsvlm.testing`` works from an installed wheel, and a fresh
copy of it carrying a family's special tokens."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

# A copy of shards_example/tokenizer (tests/test_tiny.py checks that the two are the same).
TOKENIZER_DIR = Path(__file__).parent / "example_tokenizer"


def family_tokenizer(
    specials: Sequence[str], *, eos: str, pad: str, bos: str | None, chat_template: str
) -> PreTrainedTokenizerBase:
    """A fresh copy of the shipped tokenizer with a family's special tokens (one id each), its
    end, padding and (if it has one) beginning tokens, and its chat template."""
    if not (TOKENIZER_DIR / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"wdsvlm.testing's tokenizer is missing at {TOKENIZER_DIR}: this installation of "
            "wdsvlm lacks its package data; reinstall wdsvlm"
        )
    tok = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    # Keep the shipped extra special tokens (replace=False): they stay special when decoding.
    tok.add_special_tokens(
        {"additional_special_tokens": list(specials)}, replace_extra_special_tokens=False
    )
    tok.eos_token, tok.pad_token = eos, pad
    if bos is not None:
        tok.bos_token = bos
    # The published checkpoints ship the template with the tokenizer too: text-only code that
    # calls tokenizer.apply_chat_template sees the same rendering as the processor.
    tok.chat_template = chat_template
    return tok
