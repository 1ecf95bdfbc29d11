import json

import pytest

from specloop.services.prompts import PromptError, encode, load_prompts, parse_record


def test_prompt_and_chat_records_both_parse(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(
        json.dumps({"id": "a", "prompt": "def f():\n"})
        + "\n\n"
        + json.dumps({"id": "b", "messages": [{"role": "user", "content": "hi"}]})
        + "\n"
    )
    recs = load_prompts(f)
    assert [r.id for r in recs] == ["a", "b"]
    assert recs[0].prompt == "def f():\n" and recs[1].messages == ({"role": "user", "content": "hi"},)


@pytest.mark.parametrize(
    "obj,msg",
    [
        ({"id": "a", "prompt": ""}, "non-empty"),
        ({"prompt": "x"}, "'id'"),
        ({"id": "a"}, "exactly one"),
        ({"id": "a", "prompt": "x", "messages": []}, "exactly one"),
        ({"id": "a", "messages": [{"role": "user"}]}, "content"),
        ([1, 2], "JSON object"),
    ],
)
def test_malformed_records_are_refused_with_the_reason(obj, msg):
    with pytest.raises(PromptError, match=msg):
        parse_record(obj, "f:1")


def test_invalid_json_names_the_line(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"id": "a", "prompt": "x"}\n{oops\n')
    with pytest.raises(PromptError, match=r"p.jsonl:2: invalid JSON"):
        load_prompts(f)


def test_missing_and_empty_files_are_refused(tmp_path):
    with pytest.raises(PromptError, match="not found"):
        load_prompts(tmp_path / "nope.jsonl")
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(PromptError, match="no prompts"):
        load_prompts(tmp_path / "e.jsonl")


def test_chat_messages_go_through_the_chat_template(tiny_pair):
    from specloop.drafter.model.loading import load_tokenizer

    tok = load_tokenizer(tiny_pair[0])
    rec = parse_record({"id": "c", "messages": [{"role": "user", "content": "hello"}]}, "x")
    ids = encode(tok, rec)
    assert tok.decode(ids) == "<|user|>\nhello<|end|>\n<|assistant|>\n"
    assert encode(tok, parse_record({"id": "p", "prompt": "hello"}, "x")) == tok.encode("hello")
