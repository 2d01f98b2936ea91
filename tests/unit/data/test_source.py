import json

import pytest

from miles_ray.data import DataExhausted, DatasetSource, DatasetSourceConfig, read_rows
from miles_ray.types import check_prompt

ROWS = [
    {"prompt": f"What is {i} + {i}?", "answer": str(2 * i), "data_source": "sums" if i % 2 else "evens"}
    for i in range(6)
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(params=["jsonl", "json", "parquet", "hf_dir", "hf_object"])
def source_args(request, tmp_path):
    """The same rows as each format the source reads: (config kwargs, dataset object or None)."""
    import datasets

    kind = request.param
    if kind == "jsonl":
        return {"path": str(write_jsonl(tmp_path / "d.jsonl", ROWS))}, None
    if kind == "json":
        (tmp_path / "d.json").write_text(json.dumps(ROWS))
        return {"path": str(tmp_path / "d.json")}, None
    if kind == "parquet":
        datasets.Dataset.from_list(ROWS).to_parquet(str(tmp_path / "d.parquet"))
        return {"path": str(tmp_path / "d.parquet")}, None
    if kind == "hf_dir":
        datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "hf"))
        return {"path": str(tmp_path / "hf")}, None
    return {}, datasets.Dataset.from_list(ROWS)


def test_every_format_gives_the_same_prompts_rewarded_by_the_verifier(source_args, tokenizer):
    kwargs, dataset = source_args
    source = DatasetSource(DatasetSourceConfig(**kwargs, seed=3), tokenizer, dataset)
    prompts = [check_prompt(source.next_prompt(), source) for _ in range(len(ROWS))]
    assert sorted(p["index"] for p in prompts) == list(range(6))  # one epoch: every row once
    assert [p["uid"] for p in prompts] == list(range(6))
    for p in prompts:
        row = ROWS[p["index"]]
        text = tokenizer.decode(p["prompt_ids"])
        assert row["prompt"] in text and text.rstrip().endswith("assistant")  # SmolLM2's template, generation turn
        assert p["entry"] == row  # every column reaches the reward
        assert source.reward(f"The answer is \\boxed{{{row['answer']}}}", p["entry"]) == 1.0
        assert source.reward("The answer is \\boxed{-1}", p["entry"]) == 0.0


def test_each_epoch_is_a_fresh_seeded_order_and_epochs_end(tokenizer):
    def orders(seed):
        source = DatasetSource(DatasetSourceConfig(seed=seed, epochs=2), tokenizer, ROWS)
        out = [source.next_prompt()["index"] for _ in range(12)]
        assert source.exhausted
        with pytest.raises(DataExhausted, match="all 2 epochs of 6 prompts"):
            source.next_prompt()
        return out[:6], out[6:]

    first, second = orders(seed=1)
    assert sorted(first) == sorted(second) == list(range(6)) and first != second
    assert orders(seed=1) == (first, second) and orders(seed=2) != (first, second)
    unshuffled = DatasetSource(DatasetSourceConfig(shuffle=False), tokenizer, ROWS)
    assert [unshuffled.next_prompt()["index"] for _ in range(7)] == [0, 1, 2, 3, 4, 5, 0]


def test_the_position_resumes_exactly(tokenizer):
    straight = DatasetSource(DatasetSourceConfig(seed=5), tokenizer, ROWS)
    expected = [straight.next_prompt()["index"] for _ in range(15)]
    first = DatasetSource(DatasetSourceConfig(seed=5), tokenizer, ROWS)
    head = [first.next_prompt()["index"] for _ in range(8)]  # into the second epoch
    resumed = DatasetSource(DatasetSourceConfig(seed=5), tokenizer, ROWS)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))  # through a JSON checkpoint
    tail = [resumed.next_prompt() for _ in range(7)]
    assert head + [p["index"] for p in tail] == expected and tail[0]["uid"] == 8
    with pytest.raises(ValueError, match="for 6 prompts, this dataset has 5"):
        DatasetSource(DatasetSourceConfig(), tokenizer, ROWS[:5]).load_state_dict(first.state_dict())


def test_chat_messages_system_prompt_and_renamed_columns(tokenizer):
    rows = [
        {"question": [{"role": "user", "content": "Name a prime."}], "gold": "7", "level": 3},
        {
            "question": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}],
            "gold": "4",
            "level": 1,
        },
    ]
    config = DatasetSourceConfig(prompt_column="question", answer_column="gold", system_prompt="Think.", shuffle=False)
    source = DatasetSource(config, tokenizer, rows)
    first, second = source.next_prompt(), source.next_prompt()
    assert first["messages"][0] == {"role": "system", "content": "Think."}
    assert second["messages"][0] == {"role": "system", "content": "Be terse."}  # the row's own system turn is kept
    assert "Think." not in tokenizer.decode(second["prompt_ids"])
    assert first["entry"] == {**rows[0], "answer": "7"}


def test_over_long_prompts_are_dropped_and_counted(tokenizer):
    rows = ROWS + [{"prompt": "word " * 300, "answer": "1"}]
    source = DatasetSource(DatasetSourceConfig(max_prompt_tokens=64), tokenizer, rows)
    assert len(source) == 6 and source.stats()["num_dropped_too_long"] == 1
    assert all(source.next_prompt()["index"] != 6 for _ in range(12))
    with pytest.raises(ValueError, match="every prompt of list is over max_prompt_tokens=3"):
        DatasetSource(DatasetSourceConfig(max_prompt_tokens=3), tokenizer, rows)


def test_raw_prompts_without_a_chat_template(tokenizer):
    source = DatasetSource(DatasetSourceConfig(use_chat_template=False, shuffle=False), tokenizer, ROWS)
    assert source.next_prompt()["prompt_ids"] == tokenizer(ROWS[0]["prompt"])["input_ids"]
    with pytest.raises(ValueError, match="system_prompt needs use_chat_template=True"):
        DatasetSource(DatasetSourceConfig(use_chat_template=False, system_prompt="x"), tokenizer, ROWS)


@pytest.mark.parametrize(
    ("rows", "config", "message"),
    [
        (
            [{"question": "q", "answer": "1"}],
            {},
            r"row 0 has no column 'prompt' \(DatasetSourceConfig.prompt_column\); "
            r"its columns are \['answer', 'question'\]",
        ),
        ([{"prompt": "q", "answer": "1"}, {"prompt": "q"}], {}, "row 1 has no column 'answer'"),
        ([{"prompt": 3, "answer": "1"}], {}, "row 0: column 'prompt' must be a non-empty string or a list of chat"),
        ([{"prompt": "  ", "answer": "1"}], {}, "must be a non-empty string"),
        ([{"prompt": [{"role": "user"}], "answer": "1"}], {}, "list of chat messages"),
        ([], {}, "has no rows"),
        ([{"prompt": "q"}], {"answer_column": None, "reward": "no.such:module"}, "DatasetSourceConfig.reward"),
    ],
)
def test_bad_data_fails_when_the_source_is_built(tokenizer, rows, config, message):
    with pytest.raises(ValueError, match=message):
        DatasetSource(DatasetSourceConfig(**config), tokenizer, rows)


def test_malformed_and_empty_files_name_themselves(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "answer": "1"}\n\n{"prompt": "b", "answer": \n')
    with pytest.raises(ValueError, match=r"bad.jsonl:3: not valid JSON"):
        read_rows(bad)
    (tmp_path / "list.jsonl").write_text('["a"]\n')
    with pytest.raises(ValueError, match=r"list.jsonl:1: each line must be a JSON object, got list"):
        read_rows(tmp_path / "list.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="has no rows"):
        read_rows(tmp_path / "empty.jsonl")
    with pytest.raises(ValueError, match="does not exist"):
        read_rows(tmp_path / "missing.jsonl")
    (tmp_path / "d.csv").write_text("prompt,answer\n")
    with pytest.raises(ValueError, match="cannot tell the format"):
        read_rows(tmp_path / "d.csv")
    with pytest.raises(ValueError, match="path or a dataset object is needed"):
        DatasetSource(DatasetSourceConfig(), tokenizer=None)


def test_a_missing_split_lists_the_splits(tmp_path):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "hf"))
    assert len(read_rows(tmp_path / "hf")) == 6
    with pytest.raises(ValueError, match=r"the dataset has splits \['train'\]; split='test' is not one"):
        read_rows(tmp_path / "hf", split="test")
