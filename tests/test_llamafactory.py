"""LLaMA-Factory dataset_info.json: a user's existing data directory works as is."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lmforge.config.schema import SourceConfig
from lmforge.data.examples import BadRow, Conversation, LabeledConversation, PreferencePair
from lmforge.data.formats import iter_source_examples
from lmforge.data.llamafactory import resolve_dataset_info
from lmforge.errors import UserInputError


def write(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    write(
        tmp_path / "qa.jsonl",
        [{"q": "Capital of France?", "ctx": "Europe", "a": "Paris", "hist": [["hi", "hey"]]}],
    )
    openai_tags = [
        {"role": "system", "content": "Tools on."},
        {"role": "user", "content": "Weather?"},
        {"role": "tool_call", "content": json.dumps({"name": "weather", "arguments": "{}"})},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
    ]
    write(
        tmp_path / "chat" / "part-0.jsonl", [{"messages": openai_tags, "functions": '[{"name": "weather"}]'}]
    )
    dpo_prompt = [{"from": "human", "value": "Tell a joke."}]
    write(
        tmp_path / "dpo.jsonl",
        [
            {
                "conversations": dpo_prompt,
                "chosen": {"from": "gpt", "value": "Ha."},
                "rejected": {"from": "gpt", "value": "No."},
            }
        ],
    )
    write(
        tmp_path / "dpo_alpaca.jsonl", [{"instruction": "2+2", "input": "", "chosen": "4", "rejected": "5"}]
    )
    write(
        tmp_path / "kto.jsonl",
        [{"messages": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}], "tag": False}],
    )
    info = {
        "qa": {
            "file_name": "qa.jsonl",
            "columns": {"prompt": "q", "query": "ctx", "response": "a", "history": "hist"},
        },
        "chat": {
            "file_name": "chat",
            "formatting": "sharegpt",
            "columns": {"messages": "messages", "tools": "functions", "images": None},
            "tags": {
                "role_tag": "role",
                "content_tag": "content",
                "user_tag": "user",
                "assistant_tag": "assistant",
                "observation_tag": "tool",
                "function_tag": "tool_call",
                "system_tag": "system",
            },
        },
        "dpo": {"file_name": "dpo.jsonl", "formatting": "sharegpt", "ranking": True},
        "dpo_alpaca": {
            "file_name": "dpo_alpaca.jsonl",
            "ranking": True,
            "columns": {
                "prompt": "instruction",
                "query": "input",
                "chosen": "chosen",
                "rejected": "rejected",
            },
        },
        "kto": {
            "file_name": "kto.jsonl",
            "formatting": "sharegpt",
            "columns": {"messages": "messages", "kto_tag": "tag"},
        },
        "hub_only": {"hf_hub_url": "someone/some-set"},
    }
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))
    return tmp_path


def read(path: Path, dataset: str, **kwargs: Any) -> list[Any]:
    source = SourceConfig(path=str(path), dataset=dataset, **kwargs)
    return list(iter_source_examples(source, memory_budget_mb=16))


def test_alpaca_entry_with_columns(data_dir: Path) -> None:
    (example,) = read(data_dir / "dataset_info.json", "qa")
    assert isinstance(example, Conversation)
    assert [m.content for m in example.messages] == ["hi", "hey", "Capital of France?\nEurope", "Paris"]
    resolved = resolve_dataset_info(SourceConfig(path=str(data_dir), dataset="qa"))  # the directory works too
    assert resolved.path == str(data_dir / "qa.jsonl") and resolved.format == "alpaca"
    assert resolved.columns["response"] == "a" and resolved.dataset is None


def test_sharegpt_entry_with_custom_tags_and_a_directory(data_dir: Path) -> None:
    (example,) = read(data_dir, "chat")
    assert [m.role for m in example.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert example.messages[2].tool_calls == [
        {"type": "function", "function": {"name": "weather", "arguments": {}}}
    ]
    assert example.tools == [{"type": "function", "function": {"name": "weather"}}]


def test_ranking_entries_are_preference(data_dir: Path) -> None:
    (pair,) = read(data_dir, "dpo")
    assert isinstance(pair, PreferencePair)
    assert (pair.prompt[0].content, pair.chosen.content, pair.rejected.content) == (
        "Tell a joke.",
        "Ha.",
        "No.",
    )
    (pair,) = read(data_dir, "dpo_alpaca")
    assert (pair.prompt[0].content, pair.chosen.content) == ("2+2", "4")


def test_kto_tag_entry(data_dir: Path) -> None:
    (labeled,) = read(data_dir, "kto")
    assert isinstance(labeled, LabeledConversation) and labeled.label is False


def test_source_columns_override_the_entry(data_dir: Path) -> None:
    (bad,) = read(data_dir, "qa", columns={"response": "missing"})
    assert isinstance(bad, BadRow) and bad.detail.startswith("no 'missing' field")


def test_unknown_name_lists_available_names(data_dir: Path) -> None:
    with pytest.raises(UserInputError) as err:
        read(data_dir, "nope")
    assert str(err.value) == (
        f"{data_dir / 'dataset_info.json'}: no dataset named 'nope'; available: chat, dpo, dpo_alpaca, "
        "hub_only, kto, qa. Fix: set `dataset:` on this source to one of those names."
    )


def test_hub_only_entry_needs_a_local_file(data_dir: Path) -> None:
    with pytest.raises(
        UserInputError, match=r"only hf_hub_url='someone/some-set'; reading it would need a network"
    ):
        read(data_dir, "hub_only")


def test_bad_entries(tmp_path: Path) -> None:
    info = {"gone": {"file_name": "gone.jsonl"}, "mm": {"file_name": "x.json", "columns": {"images": "imgs"}}}
    (tmp_path / "x.json").write_text("[]")
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))
    with pytest.raises(UserInputError, match=r"file_name 'gone.jsonl' does not exist"):
        read(tmp_path, "gone")
    with pytest.raises(UserInputError, match=r"multimodal columns \(images\) are not supported"):
        read(tmp_path, "mm")
    with pytest.raises(UserInputError, match=r"does not exist"):
        read(tmp_path / "elsewhere", "gone")


def test_dataset_info_read_as_data_says_to_set_dataset(data_dir: Path) -> None:
    with pytest.raises(UserInputError, match=r"LLaMA-Factory dataset_info.json; set `dataset:`"):
        list(
            iter_source_examples(SourceConfig(path=str(data_dir / "dataset_info.json")), memory_budget_mb=16)
        )
