"""The chat template a tokenizer renders with: ChatML where it has none, and the check, made
once when a stage is built, that it compiles and takes the family's conversations."""

from __future__ import annotations

import jinja2

from ..errors import TemplateError

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# A conversation every chat template renders: used once to find out whether it compiles.
PROBE = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "!"}]


def check_template(tokenizer, template: str, probe: list[dict] = PROBE) -> None:
    """Refuse a chat template that transformers cannot compile (a syntax error is the
    template's fault, not a sample's), naming where it fails; or one that cannot render
    ``probe``, a short conversation as the family gives it (a processor family's content
    lists)."""
    try:
        tokenizer.apply_chat_template(probe, chat_template=template, tokenize=False)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(
            f"the chat template does not compile (line {e.lineno}: {e.message})"
        ) from None
    except TypeError as e:
        raise TemplateError(
            f"the chat template cannot render content lists ({e}); a model family's "
            "processor needs its own chat template (processor.chat_template)"
        ) from None
    except jinja2.TemplateError:
        pass  # it compiles; it refuses this conversation, as it may refuse a sample
