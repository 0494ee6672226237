"""Input records: LLaVA and Cauldron made into one form, and every refusal naming its record."""

from __future__ import annotations

import json

import pytest

from wdsvlm.errors import InputError
from wdsvlm.write.inputs import iter_records

from .conftest import write_jsonl


def only(path, **kwargs):
    (item,) = list(iter_records(path, **kwargs))
    return item


def llava(conversations, **extra):
    return {"id": "x1", "conversations": conversations, **extra}


def turn(who, text):
    return {"from": who, "value": text}


def test_llava_roles_map_to_chat_roles(tmp_path):
    convo = [turn("system", "S"), turn("human", "Q1"), turn("gpt", "A1"), turn("human", "Q2")]
    convo.append(turn("gpt", "A2"))
    record = only(write_jsonl(str(tmp_path / "in.jsonl"), [llava(convo)]))
    assert [m["role"] for m in record["messages"]] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
    ]
    assert record["id"] == "x1" and record["source"] == "in"


def test_json_array_files_are_read_like_jsonl(tmp_path):
    path = tmp_path / "in.json"
    path.write_text(json.dumps([llava([turn("human", "Q"), turn("gpt", "A")], image="i.jpg")]))
    record = only(str(path), image_root="/data/imgs")
    assert record["images"] == ["/data/imgs/i.jpg"]
    assert record["where"] == "in.json record 0 (id 'x1')"


def test_relative_images_resolve_against_the_input_folder_by_default(tmp_path):
    path = write_jsonl(
        str(tmp_path / "in.jsonl"),
        [llava([turn("human", "<image>"), turn("gpt", "A")], image="sub/i.png")],
    )
    assert only(path)["images"] == [str(tmp_path / "sub" / "i.png")]


@pytest.mark.parametrize(
    "convo, reason, text",
    [
        ([turn("human", "Q")], "no_assistant_answer", "the last user turn has no assistant answer"),
        (
            [turn("human", "Q"), turn("human", "Q2"), turn("gpt", "A")],
            "no_assistant_answer",
            "user turn 1 has no assistant answer",
        ),
        ([turn("gpt", "A")], "bad_record", "turn 1 is an answer to no user turn"),
        (
            [turn("human", "Q"), turn("gpt", "A"), turn("system", "S")],
            "bad_record",
            "a system turn must come first",
        ),
        ([turn("robot", "Q")], "bad_record", "unknown role 'robot'"),
        ([], "bad_record", "'conversations' must be a non-empty list"),
        ([turn("system", "S")], "bad_record", "no user turn"),
    ],
)
def test_malformed_conversations_are_refused_by_name(tmp_path, convo, reason, text):
    path = write_jsonl(str(tmp_path / "in.jsonl"), ["", llava(convo)])
    error = only(path)
    assert isinstance(error, InputError)
    assert error.reason == reason
    assert text in str(error)
    assert str(error).startswith("in.jsonl line 2 (id 'x1'): ")


def test_markers_in_later_turns_stay_where_the_source_put_them(tmp_path):
    convo = [
        turn("human", "Hi"),
        turn("gpt", "Hello"),
        turn("human", "Now <image> this"),
        turn("gpt", "Ok"),
    ]
    record = only(write_jsonl(str(tmp_path / "in.jsonl"), [llava(convo, image=["a.jpg"])]))
    assert [m["content"] for m in record["messages"]] == ["Hi", "Hello", "Now <image> this", "Ok"]


def test_markers_without_images_are_text(tmp_path):
    record = only(
        write_jsonl(
            str(tmp_path / "in.jsonl"), [llava([turn("human", "<image> Q"), turn("gpt", "A")])]
        )
    )
    assert not isinstance(record, InputError) and record["messages"][0]["content"] == "<image> Q"


def test_cauldron_turn_without_answer_is_refused(tmp_path):
    path = write_jsonl(str(tmp_path / "c.jsonl"), [{"images": [], "texts": [{"user": "Q"}]}])
    error = only(path)
    assert isinstance(error, InputError) and error.reason == "no_assistant_answer"
    assert "c.jsonl line 1" in str(error) and "text 1 has no assistant answer" in str(error)


def test_unknown_format_is_a_clear_error(tmp_path):
    path = write_jsonl(str(tmp_path / "x.jsonl"), [{"question": "Q", "answer": "A"}])
    with pytest.raises(ValueError, match="cannot tell the format of .*x.jsonl.*--format"):
        list(iter_records(path))


def test_input_errors_survive_pickling():
    import pickle

    error = pickle.loads(pickle.dumps(InputError("f line 3", "missing_image", "gone")))
    assert (error.where, error.reason, error.message, str(error)) == (
        "f line 3",
        "missing_image",
        "gone",
        "f line 3: gone",
    )
