"""Tokenize: label masks that supervise exactly the answers, image token runs of the right
length, any tokenizer, templates rendered as transformers renders them."""

from __future__ import annotations

import json
import os
import pickle

import numpy as np
import pytest
import webdataset as wds

from wdsvlm.families.tiling import ImageConfig, tile_count
from wdsvlm.pipeline.images import DecodeImages
from wdsvlm.pipeline.plan import Plan, WorkerConfig
from wdsvlm.pipeline.read import ReadSamples
from wdsvlm.pipeline.stats import SkipStats
from wdsvlm.pipeline.tokenize import IGNORE_INDEX, Tokenize

from .conftest import EXAMPLE

TOKENIZER = os.path.join(EXAMPLE, "tokenizer")


@pytest.fixture(scope="module")
def example_samples():
    plan = Plan(EXAMPLE, worker_config=WorkerConfig(0, 1, 0))
    return list(wds.DataPipeline(plan, ReadSamples()))


def fresh(samples):
    return [dict(s) for s in samples]


def runs(ids, token_id):
    """Lengths of the runs of ``token_id`` in ``ids``."""
    out, n = [], 0
    for t in ids:
        if t == token_id:
            n += 1
        elif n:
            out.append(n)
            n = 0
    return out + ([n] if n else [])


def test_labels_supervise_exactly_the_answers_of_every_example_sample(example_samples):
    stage = Tokenize(TOKENIZER)
    tok = stage.tokenizer
    docs = {s["__key__"]: json.loads(s["json"]) for s in example_samples}
    out = list(stage(iter(fresh(example_samples))))
    assert len(out) == len(example_samples) == 320
    config = ImageConfig()
    for sample in out:
        ids, labels = sample["input_ids"], sample["labels"]
        assert ids.dtype == labels.dtype == np.int64 and ids.shape == labels.shape
        answers = [
            m["content"] for m in docs[sample["__key__"]]["messages"] if m["role"] == "assistant"
        ]
        supervised = ids[labels != IGNORE_INDEX]
        assert (labels[labels != IGNORE_INDEX] == supervised).all()
        assert tok.decode(supervised) == "".join(a + "<|im_end|>" for a in answers)
        assert labels[0] == IGNORE_INDEX  # a packed sample never starts supervised
        tiles = [tile_count(w, h, config) for w, h in sample["__meta__"]["images"]]
        assert sample["image_tiles"] == tiles
        image_runs = runs(ids, stage.image_token_id)
        assert sum(image_runs) == 64 * sum(tiles)
        text = "".join(m["content"] for m in docs[sample["__key__"]]["messages"])
        if "<image><image>" not in text:  # adjacent images make one run; else one run each
            assert image_runs == [64 * t for t in tiles]
        assert sample["num_tokens"] == len(ids)
        assert (labels[ids == stage.image_token_id] == IGNORE_INDEX).all()


def test_tiles_from_the_index_equal_tiles_from_decoding(example_samples):
    config = ImageConfig(tile_size=128, max_image_side=384)
    before = Tokenize(TOKENIZER, tokens_per_tile=3, image_config=config)
    after = Tokenize(TOKENIZER, tokens_per_tile=3, image_config=config)
    subset = example_samples[:60]
    a = list(before(iter(fresh(subset))))
    b = list(after(DecodeImages(config)(iter(fresh(subset)))))
    assert [s["__key__"] for s in a] == [s["__key__"] for s in b]
    for x, y in zip(a, b, strict=True):
        assert x["image_tiles"] == y["image_tiles"]
        assert sum(y["image_tiles"]) == y["pixel_values"].shape[0]
        assert (x["input_ids"] == y["input_ids"]).all() and (x["labels"] == y["labels"]).all()


def test_rendering_matches_transformers_apply_chat_template(example_samples):
    stage = Tokenize(TOKENIZER)
    for sample in example_samples[:100]:
        messages = json.loads(sample["json"])["messages"]
        assert stage.render(messages) == stage.tokenizer.apply_chat_template(
            messages, tokenize=False
        )


def sample_of(messages, images=(), key="k"):
    return {
        "__key__": key,
        "__shard__": "s",
        "json": json.dumps({"messages": messages}),
        "__meta__": {"images": [list(i) for i in images]},
    }


def qa(q, a):
    return [{"role": "user", "content": q}, {"role": "assistant", "content": a}]


def test_an_answer_quoted_in_the_question_is_not_taken_for_the_answer():
    stage = Tokenize(TOKENIZER)
    (out,) = stage(iter([sample_of(qa("Reply with Yes. and nothing else: Yes.", "Yes."))]))
    supervised = out["input_ids"][out["labels"] != IGNORE_INDEX]
    assert stage.tokenizer.decode(supervised) == "Yes.<|im_end|>"


def test_a_tokenizer_without_template_or_image_token_gets_chatml_and_an_added_token():
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer.from_file(os.path.join(TOKENIZER, "tokenizer.json"))
    bare = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>")
    assert not bare.chat_template
    size = len(bare)
    stage = Tokenize(
        bare,
        image_token="<|vision|>",
        tokens_per_tile=5,
        image_config=ImageConfig(tile_size=100, max_image_side=200),
    )
    assert len(bare) == size  # the caller's tokenizer is left as it was
    assert stage.image_token_id == size and len(stage.tokenizer) == size + 1
    messages = qa("<image>\nWhat is it?", "A dot.")
    (out,) = stage(iter([sample_of(messages, images=[(150, 150)])]))
    assert runs(out["input_ids"], stage.image_token_id) == [5 * 5]  # 2 x 2 tiles + thumbnail
    text = stage.tokenizer.decode(out["input_ids"][out["labels"] != IGNORE_INDEX])
    assert text == "A dot.<|im_end|>"
    assert stage.tokenizer.decode(out["input_ids"][:3]) == "<|im_start|>user\n"


def test_bad_samples_are_skipped_and_counted():
    stats = SkipStats()
    stage = Tokenize(TOKENIZER, stats=stats)
    samples = [
        sample_of(qa("Q", "A"), key="good"),
        {"__key__": "broken", "__shard__": "s", "json": b"{nope", "__meta__": {"images": []}},
        sample_of(qa("<image><image> Q", "A"), images=[(10, 10)], key="two-markers"),
        sample_of(qa("Q", "A"), images=[(10, 10)], key="no-marker"),
        {"__key__": "no-messages", "__shard__": "s", "json": b"{}", "__meta__": {"images": []}},
    ]
    out = list(stage(iter(samples)))
    assert [s["__key__"] for s in out] == ["good"]
    assert stats.counts == {"invalid_json": 2, "image_count_mismatch": 2}


def test_a_template_that_alters_answers_is_reported():
    stats = SkipStats()
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}"
        "<|im_end|>\n{% endfor %}"
    )
    stage = Tokenize(TOKENIZER, chat_template=template, stats=stats)
    out = list(stage(iter([sample_of(qa("Q", "Padded answer.   ")), sample_of(qa("Q", "Fine."))])))
    assert len(out) == 1 and stats.counts == {"template_mismatch": 1}


def test_a_template_that_trims_still_labels_the_answer_not_its_quote_in_the_question():
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}"
        "<|im_end|>\n{% endfor %}"
    )
    stage = Tokenize(TOKENIZER, chat_template=template)
    for question, answer in [
        ("Reply with Yes. and nothing else: Yes. ", "Yes."),
        ("Pick (a) or (b) ", "a"),
    ]:
        (out,) = stage.encode([sample_of(qa(question, answer))])
        supervised = out["input_ids"][out["labels"] != -100]
        assert stage.tokenizer.decode(supervised) == answer + "<|im_end|>"


def test_the_stage_pickles_for_worker_processes(example_samples):
    stage = Tokenize(TOKENIZER)
    stage.render(qa("a", "b"))
    copy = pickle.loads(pickle.dumps(stage))
    a = list(stage(iter(fresh(example_samples[:20]))))
    b = list(copy(iter(fresh(example_samples[:20]))))
    assert all((x["input_ids"] == y["input_ids"]).all() for x, y in zip(a, b, strict=True))


# The shape of several current Hugging Face templates: the answer inside {% generation %}, so
# that transformers can return an assistant mask.
GENERATION_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{% if m['role'] == 'assistant' %}"
    "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ m['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
)


def test_a_template_with_generation_blocks_renders_and_labels_the_answers():
    stage = Tokenize(TOKENIZER, chat_template=GENERATION_TEMPLATE)
    plain = Tokenize(TOKENIZER)  # ChatML: the same text without the generation blocks
    sample = sample_of(qa("<image>\nWhat is it?", "A red square."), images=[[64, 64]])
    (out,) = stage(iter([dict(sample)]))
    (same,) = plain(iter([dict(sample)]))
    assert np.array_equal(out["input_ids"], same["input_ids"])
    assert np.array_equal(out["labels"], same["labels"])
    supervised = stage.tokenizer.decode(out["input_ids"][out["labels"] != IGNORE_INDEX])
    assert supervised == "A red square.<|im_end|>"
    masked = stage.tokenizer.apply_chat_template(
        qa("<image>\nWhat is it?", "A red square."),
        chat_template=GENERATION_TEMPLATE,
        return_assistant_tokens_mask=True,
        return_dict=True,
    )
    assert sum(masked["assistant_masks"]) > 0  # transformers itself reads the blocks


def test_a_template_that_refuses_a_sample_skips_it_by_name_and_one_that_cannot_compile_is_refused():
    from wdsvlm.errors import TemplateError

    refusing = (
        "{% if messages[0]['role'] != 'system' %}"
        "{{ raise_exception('a system turn must come first') }}{% endif %}" + GENERATION_TEMPLATE
    )
    stats = SkipStats()
    stage = Tokenize(TOKENIZER, chat_template=refusing, stats=stats)
    good = sample_of([{"role": "system", "content": "Be brief."}, *qa("Q?", "A.")])
    bad = {**sample_of(qa("Q?", "A.")), "__shard__": "data-000003.tar", "__key__": "000000042"}
    out = list(stage(iter([good, bad])))
    assert len(out) == 1 and stats.counts == {"template_error": 1}
    assert stats.examples == {"template_error": ["data-000003.tar/000000042"]}
    with pytest.raises(TemplateError, match=r"data-000003.tar/000000042: .*system turn must"):
        stage.render(qa("Q?", "A."), "data-000003.tar/000000042")
    with pytest.raises(TemplateError, match="the chat template does not compile"):
        Tokenize(TOKENIZER, chat_template="{% for m in messages %}{{ m['content'] }}")
