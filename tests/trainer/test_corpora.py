import io
import json

from specloop.trainer.corpora import (
    iter_json_array,
    iter_sharegpt_conversations,
    iter_sharegpt_train,
    iter_stdlib_code_files,
    render_chat,
    sharegpt_split,
)


def _record(i: int, turns: int = 2) -> dict:
    speakers = ["human", "gpt"]
    return {"id": f"r{i}", "conversations": [
        {"from": speakers[t % 2], "value": f"message {i}.{t} with \"quotes\", commas, ] and é"}
        for t in range(turns)
    ]}


def _truncated_sharegpt(tmp_path, n: int, cut_chars: int = 40):
    """A ShareGPT-like file with n complete records and a cut-off (n+1)-th one."""
    text = json.dumps([_record(i) for i in range(n + 1)], indent=2, ensure_ascii=False)
    last = text.rindex('{\n    "id"')
    path = tmp_path / "sharegpt.json"
    path.write_text(text[: last + cut_chars], encoding="utf-8")
    return path


def test_incremental_parser_keeps_every_complete_record_of_a_truncated_array(tmp_path):
    path = _truncated_sharegpt(tmp_path, n=7)
    with open(path, "rb") as stream:
        records = list(iter_json_array(stream, chunk_size=16))
    assert [r["id"] for r in records] == [f"r{i}" for i in range(7)]
    assert records[3] == _record(3)


def test_incremental_parser_reads_a_complete_array_from_a_text_stream():
    stream = io.StringIO(json.dumps([{"a": 1}, [2, 3], "four"]))
    assert list(iter_json_array(stream, chunk_size=3)) == [{"a": 1}, [2, 3], "four"]


def test_conversations_map_speakers_to_chat_roles_and_skip_empty_ones(tmp_path):
    records = [
        {"id": "a", "conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"},
                                      {"from": "gpt", "value": "a"}]},
        {"id": "empty", "conversations": []},
        {"id": "b", "conversations": [{"from": "human", "value": "q2"}]},
    ]
    path = tmp_path / "chat.json"
    path.write_text(json.dumps(records)[:-1])  # cut off the closing bracket
    conversations = list(iter_sharegpt_conversations(path))
    assert conversations == [
        [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
        [{"role": "user", "content": "q2"}],
    ]


def test_holdout_excludes_the_last_conversations_in_file_order(tmp_path):
    path = _truncated_sharegpt(tmp_path, n=10)
    train, heldout = sharegpt_split(holdout=3, path=path)
    everything = list(iter_sharegpt_conversations(path))
    assert train == everything[:7] and heldout == everything[7:]
    assert list(iter_sharegpt_train(holdout=3, path=path)) == train


def test_real_sharegpt_training_split_never_reaches_the_last_500():
    everything = list(iter_sharegpt_conversations())
    train, heldout = sharegpt_split()
    assert len(everything) > 17_000
    assert heldout == everything[-500:] and train == everything[:-500]
    assert sum(1 for _ in iter_sharegpt_train()) == len(train)


def test_stdlib_iterator_excludes_test_directories_and_site_packages():
    files = dict(iter_stdlib_code_files())
    assert "os.py" in files and "json/decoder.py" in files
    for path in files:
        parts = path.split("/")[:-1]
        assert not {"test", "tests", "site-packages"} & set(parts), path
    with_tests = [p for p, _ in iter_stdlib_code_files(include_tests=True)]
    assert any(p.startswith("test/") for p in with_tests)
    assert len(with_tests) > len(files)


def test_render_chat_matches_the_chat_template_format():
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert render_chat(messages) == "<|system|>\nbe brief<|end|>\n<|user|>\nhi<|end|>\n"
    assert render_chat(messages, add_generation_prompt=True).endswith("<|end|>\n<|assistant|>\n")
