import json

import pytest

from tasks.dataset import (DataError, encode_prompt, fit_to_length, load_jsonl, load_records, split_heldout,
                           step_prompts, stream_prompts)


def write(tmp_path, text):
    path = tmp_path / "data.jsonl"
    path.write_text(text)
    return str(path)


def write_parquet(tmp_path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq
    path = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_loads_prompts_and_optional_references(tmp_path):
    path = write(tmp_path, '{"prompt": "1+1=", "reference": "2"}\n\n{"prompt": "2+2=", "rubric": "is 4"}\n')
    assert load_jsonl(path) == [{"prompt": "1+1=", "reference": "2", "rubric": None},
                                {"prompt": "2+2=", "reference": None, "rubric": "is 4"}]


@pytest.mark.parametrize("text, message", [
    ('{"prompt": "1+1="}\n{"prompt": \n', "data.jsonl:2: not valid JSON"),
    ('{"prompt": "1+1="}\n{"question": "x"}\n', 'data.jsonl:2: needs a non-empty string "prompt"'),
    ('{"prompt": ""}\n', 'data.jsonl:1: needs a non-empty string "prompt"'),
    ('{"prompt": "1+1=", "reference": 2}\n', 'data.jsonl:1: "reference" must be a string'),
    ('{"prompt": "1+1=", "rubric": ["a"]}\n', 'data.jsonl:1: "rubric" must be a string'),
    ("\n\n", "holds no prompts"),
])
def test_bad_files_name_the_line(tmp_path, text, message):
    with pytest.raises(DataError, match=message.replace("+", r"\+")):
        load_jsonl(write(tmp_path, text))


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="cannot read data file"):
        load_jsonl(str(tmp_path / "absent.jsonl"))


def test_parquet_reads_like_jsonl(tmp_path):
    rows = [{"prompt": "1+1=", "reference": "2", "rubric": "is 2", "source": "extra columns are ignored"},
            {"prompt": "2+2=", "reference": None, "rubric": None, "source": ""}]
    assert load_records(write_parquet(tmp_path, rows)) == [
        {"prompt": "1+1=", "reference": "2", "rubric": "is 2"}, {"prompt": "2+2=", "reference": None, "rubric": None}]
    jsonl = write(tmp_path, "".join(json.dumps(r) + "\n" for r in rows))
    assert load_records(jsonl) == load_records(write_parquet(tmp_path, rows))


@pytest.mark.parametrize("rows, message", [
    ([{"question": "1+1="}], 'needs a "prompt" column'),
    ([{"prompt": "1+1="}, {"prompt": None}], 'row 2: needs a non-empty string "prompt"'),
    ([{"prompt": "1+1=", "reference": 2}], 'row 1: "reference" must be a string'),
])
def test_bad_parquet_names_the_row(tmp_path, rows, message):
    with pytest.raises(DataError, match=message.replace("+", r"\+")):
        load_records(write_parquet(tmp_path, rows))


def test_heldout_split_is_seeded_disjoint_and_complete():
    records = [{"prompt": str(i)} for i in range(20)]
    train, held = split_heldout(records, 0.25, seed=0)
    assert len(held) == 5 and len(train) == 15
    assert sorted(r["prompt"] for r in train + held) == sorted(r["prompt"] for r in records)
    assert split_heldout(records, 0.25, seed=0) == (train, held)
    assert split_heldout(records, 0.25, seed=1)[1] != held
    for bad in (0.0, 1.0, 0.99):
        with pytest.raises(DataError, match="--eval-split"):
            split_heldout(records, bad, seed=0)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """Character tokenizers without and with a chat template (configs only, no weights)."""
    from transformers import AutoTokenizer

    from tinymodel import make_model
    root = tmp_path_factory.mktemp("tok")
    make_model(str(root / "plain"), config_only=True)
    make_model(str(root / "chat"), config_only=True, chat_template=True)
    return AutoTokenizer.from_pretrained(root / "plain"), AutoTokenizer.from_pretrained(root / "chat")


def test_prompts_are_plain_text_without_a_chat_template(tokenizers):
    plain, _ = tokenizers
    assert plain.decode(encode_prompt(plain, "12+3=")) == "12+3="


def test_prompts_are_a_user_turn_in_the_chat_template(tokenizers):
    _, chat = tokenizers
    ids = encode_prompt(chat, "12+3=")
    assert chat.decode(ids) == "<|user|>12+3=<|assistant|>"
    assert ids[0] == chat.convert_tokens_to_ids("<|user|>") and ids[-1] == chat.convert_tokens_to_ids("<|assistant|>")


def test_prompts_over_the_length_limit_are_left_out_and_counted_never_cut(tokenizers):
    plain, _ = tokenizers
    records = [{"prompt": "1+1=", "rubric": None}, {"prompt": "9" * 20, "rubric": None},
               {"prompt": "2+2=", "rubric": "x" * 30}]
    judge = lambda r: encode_prompt(plain, f"{r['prompt']}|{r['rubric']}")  # noqa: E731
    kept, left_out = fit_to_length(records, plain, judge, max_model_len=24, response_tokens=8, critique_tokens=4)
    # 20 + 8 > 24 for the policy; 4 + 1 + 30 + 8 + 4 > 24 for the judge
    assert [r["prompt"] for r in kept] == ["1+1="] and left_out == 2
    assert kept[0]["prompt_ids"] == encode_prompt(plain, "1+1=")


def test_step_order_is_a_function_of_seed_and_step_and_covers_each_epoch():
    first_epoch = [i for step in range(5) for i in step_prompts(10, step, 2, seed=3)]
    assert sorted(first_epoch) == list(range(10))
    assert step_prompts(10, 7, 4, seed=3) == step_prompts(10, 7, 4, seed=3)
    assert step_prompts(10, 0, 10, seed=3) != step_prompts(10, 0, 10, seed=4)


def test_the_stream_runs_on_across_epochs_from_any_position():
    """A step that draws more than its share (--filter-groups) takes the stream from where it stands."""
    whole = stream_prompts(10, 0, 30, seed=3)
    assert whole[:10] == [i for step in range(5) for i in step_prompts(10, step, 2, seed=3)]
    assert stream_prompts(10, 7, 9, seed=3) == whole[7:16]  # across the first epoch's end
    assert sorted(whole[10:20]) == list(range(10)) and whole[10:20] != whole[:10]
