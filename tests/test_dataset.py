import pytest

from tasks.dataset import DataError, load_jsonl, step_prompts


def write(tmp_path, text):
    path = tmp_path / "data.jsonl"
    path.write_text(text)
    return str(path)


def test_loads_prompts_and_optional_references(tmp_path):
    path = write(tmp_path, '{"prompt": "1+1=", "reference": "2"}\n\n{"prompt": "2+2="}\n')
    assert load_jsonl(path) == [{"prompt": "1+1=", "reference": "2"}, {"prompt": "2+2=", "reference": None}]


@pytest.mark.parametrize("text, message", [
    ('{"prompt": "1+1="}\n{"prompt": \n', "data.jsonl:2: not valid JSON"),
    ('{"prompt": "1+1="}\n{"question": "x"}\n', 'data.jsonl:2: needs a non-empty string "prompt"'),
    ('{"prompt": ""}\n', 'data.jsonl:1: needs a non-empty string "prompt"'),
    ('{"prompt": "1+1=", "reference": 2}\n', 'data.jsonl:1: "reference" must be a string'),
    ("\n\n", "holds no prompts"),
])
def test_bad_files_name_the_line(tmp_path, text, message):
    with pytest.raises(DataError, match=message.replace("+", r"\+")):
        load_jsonl(write(tmp_path, text))


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="cannot read data file"):
        load_jsonl(str(tmp_path / "absent.jsonl"))


def test_step_order_is_a_function_of_seed_and_step_and_covers_each_epoch():
    first_epoch = [i for step in range(5) for i in step_prompts(10, step, 2, seed=3)]
    assert sorted(first_epoch) == list(range(10))
    assert step_prompts(10, 7, 4, seed=3) == step_prompts(10, 7, 4, seed=3)
    assert step_prompts(10, 0, 10, seed=3) != step_prompts(10, 0, 10, seed=4)
