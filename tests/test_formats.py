"""Fine-tuning formats and source files: every format and file type on small files under tmp_path."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmforge.config.schema import SourceConfig
from lmforge.data.examples import BadRow, Conversation, LabeledConversation, Message, PreferencePair
from lmforge.data.formats import detect_format, iter_source_examples, mix_weights, repeat_count
from lmforge.errors import UserInputError

ALPACA: list[dict[str, Any]] = [
    {
        "instruction": "Add",
        "input": "2 and 3",
        "output": "5",
        "system": "Be terse.",
        "history": [["hi", "hello"]],
    },
    {"instruction": "Say hi", "input": "", "output": "hi"},
]


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def read(path: Path, fmt: str = "auto", **kwargs: Any) -> list[Any]:
    source = SourceConfig(path=str(path), format=fmt, **kwargs)  # type: ignore[arg-type]
    return list(iter_source_examples(source, memory_budget_mb=16))


def roles(messages: list[Message]) -> list[str]:
    return [m.role for m in messages]


def check_alpaca(examples: list[Any]) -> None:
    first, second = examples
    assert isinstance(first, Conversation)
    assert roles(first.messages) == ["system", "user", "assistant", "user", "assistant"]
    assert first.messages[3].content == "Add\n2 and 3"  # LLaMA-Factory: instruction + "\n" + input
    assert first.messages[1].content == "hi" and first.messages[4].content == "5"
    assert [m.content for m in second.messages] == ["Say hi", "hi"]
    assert second.origin.line == 2


def test_alpaca_jsonl_with_system_and_history(tmp_path: Path) -> None:
    check_alpaca(read(write_jsonl(tmp_path / "a.jsonl", ALPACA), "alpaca"))


def test_alpaca_json_csv_parquet_arrow(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps(ALPACA))
    check_alpaca(read(tmp_path / "a.json"))
    flat = [{**r, "history": json.dumps(r.get("history", [])), "system": r.get("system", "")} for r in ALPACA]
    with (tmp_path / "a.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(flat[0]))
        writer.writeheader()
        writer.writerows(flat)
    check_alpaca(read(tmp_path / "a.csv"))
    table = pa.Table.from_pylist(flat)
    pq.write_table(table, tmp_path / "a.parquet")
    check_alpaca(read(tmp_path / "a.parquet"))
    with pa.OSFile(str(tmp_path / "stream.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)  # the Arrow stream format, as HF datasets writes its cache files
    check_alpaca(read(tmp_path / "stream.arrow"))
    with pa.OSFile(str(tmp_path / "file.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    check_alpaca(read(tmp_path / "file.arrow"))


def test_hf_datasets_arrow_file(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list([{k: v for k, v in r.items() if k != "history"} for r in ALPACA[1:]] * 3)
    ds.save_to_disk(str(tmp_path / "saved"))
    examples = read(tmp_path / "saved", "alpaca")  # the directory: data-*.arrow found recursively
    assert len(examples) == 3 and all(isinstance(e, Conversation) for e in examples)


def test_glob_directory_and_max_documents(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "a.jsonl", ALPACA)
    write_jsonl(tmp_path / "b.jsonl", ALPACA)
    assert len(read(tmp_path / "*.jsonl")) == 4
    assert len(read(tmp_path)) == 4
    assert len(read(tmp_path, max_documents=3)) == 3


def test_column_mapping(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "qa.jsonl", [{"question": "Why?", "answer": "Because."}])
    columns = {"prompt": "question", "response": "answer"}
    (example,) = read(path, columns=columns)  # auto-detected through the mapping
    assert [m.content for m in example.messages] == ["Why?", "Because."]
    with pytest.raises(UserInputError, match=r"columns.answr is not a column role of format alpaca"):
        read(path, "alpaca", columns={"answr": "answer"})


SHAREGPT_TOOLS = {
    "conversations": [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "function_call", "value": json.dumps({"name": "weather", "arguments": {"city": "Paris"}})},
        {"from": "observation", "value": '{"temp": 21}'},
        {"from": "gpt", "value": "21 degrees."},
    ],
    "system": "You can call tools.",
    "tools": json.dumps([{"name": "weather", "parameters": {"type": "object"}}]),
}


def test_sharegpt_function_call_observation_and_tools(tmp_path: Path) -> None:
    (example,) = read(write_jsonl(tmp_path / "s.jsonl", [SHAREGPT_TOOLS]))
    assert isinstance(example, Conversation)
    assert roles(example.messages) == ["system", "user", "assistant", "tool", "assistant"]
    call = example.messages[2].tool_calls
    assert call == [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]
    assert example.messages[3].name == "weather" and example.messages[3].content == '{"temp": 21}'
    assert example.tools == [
        {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    ]


def test_sharegpt_leading_system_turn(tmp_path: Path) -> None:
    row = {
        "conversations": [
            {"from": "system", "value": "S"},
            {"from": "human", "value": "q"},
            {"from": "gpt", "value": "a"},
        ]
    }
    (example,) = read(write_jsonl(tmp_path / "s.jsonl", [row]), "sharegpt")
    assert roles(example.messages) == ["system", "user", "assistant"]


def test_openai_turns_under_conversations(tmp_path: Path) -> None:
    row = {"conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    path = write_jsonl(tmp_path / "c.jsonl", [row])
    (bad,) = read(path)
    assert bad.detail.endswith("set `format: messages` and columns.messages to this column")
    (example,) = read(path, "messages", columns={"messages": "conversations"})
    assert roles(example.messages) == ["user", "assistant"]


def test_messages_with_tool_calls(tmp_path: Path) -> None:
    row = {
        "messages": [
            {"role": "system", "content": "Tools on."},
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
                ],
            },
            {"role": "tool", "name": "weather", "content": "3C"},
            {"role": "assistant", "content": [{"type": "text", "text": "It is 3C."}]},
        ],
        "tools": [{"type": "function", "function": {"name": "weather"}}],
    }
    (example,) = read(write_jsonl(tmp_path / "m.jsonl", [row]))
    assert roles(example.messages) == ["system", "user", "assistant", "tool", "assistant"]
    assert example.messages[2].tool_calls[0]["function"]["arguments"] == {
        "city": "Oslo"
    }  # JSON string parsed
    assert example.messages[3].name == "weather" and example.messages[4].content == "It is 3C."
    assert example.tools == [{"type": "function", "function": {"name": "weather"}}]


def test_preference_alpaca_form(tmp_path: Path) -> None:
    row = {"instruction": "2+2?", "input": "", "chosen": "4", "rejected": "5", "history": [["hi", "hey"]]}
    (pair,) = read(write_jsonl(tmp_path / "p.jsonl", [row]))
    assert isinstance(pair, PreferencePair)
    assert [m.content for m in pair.prompt] == ["hi", "hey", "2+2?"]
    assert (pair.chosen.role, pair.chosen.content, pair.rejected.content) == ("assistant", "4", "5")


def test_preference_conversation_form_as_llamafactory_dpo(tmp_path: Path) -> None:
    row: dict[str, Any] = {
        "conversations": [
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello"},
            {"from": "human", "value": "Joke?"},
        ],
        "chosen": {"from": "gpt", "value": "A good joke."},
        "rejected": {"from": "gpt", "value": "No."},
    }
    (pair,) = read(write_jsonl(tmp_path / "dpo.jsonl", [row]), "preference")
    assert roles(pair.prompt) == ["user", "assistant", "user"]
    assert pair.chosen.content == "A good joke." and pair.rejected.content == "No."
    bad = {**row, "conversations": row["conversations"][:2]}
    (bad_row,) = read(write_jsonl(tmp_path / "bad.jsonl", [bad]), "preference")
    assert isinstance(bad_row, BadRow) and bad_row.reason == "wrong role order"


def test_preference_messages_form(tmp_path: Path) -> None:
    row = {
        "messages": [{"role": "user", "content": "Hi"}],
        "chosen": {"role": "assistant", "content": "Hello!"},
        "rejected": {"role": "assistant", "content": "Go away."},
    }
    (pair,) = read(write_jsonl(tmp_path / "p.jsonl", [row]))
    assert pair.chosen.content == "Hello!" and roles(pair.prompt) == ["user"]


def test_trl_preference_rows_standard_conversational_and_implicit_prompt(tmp_path: Path) -> None:
    user = {"role": "user", "content": "2+2?"}
    rows = [
        {"prompt": "2+2?", "chosen": "4", "rejected": "5"},  # TRL's standard form
        {  # TRL's conversational form
            "prompt": [user],
            "chosen": [{"role": "assistant", "content": "4"}],
            "rejected": [{"role": "assistant", "content": "5"}],
        },
    ]
    for fmt in ("auto", "preference"):
        pairs = read(write_jsonl(tmp_path / f"trl-{fmt}.jsonl", rows), fmt)
        assert all(isinstance(p, PreferencePair) for p in pairs), pairs
        assert [[(m.role, m.content) for m in p.prompt] for p in pairs] == [[("user", "2+2?")]] * 2
        assert [(p.chosen.content, p.rejected.content) for p in pairs] == [("4", "5")] * 2
    implicit = {  # TRL's implicit prompt: the shared turns of two whole conversations
        "chosen": [user, {"role": "assistant", "content": "4"}],
        "rejected": [user, {"role": "assistant", "content": "5"}],
    }
    (pair,) = read(write_jsonl(tmp_path / "implicit.jsonl", [implicit]))
    assert roles(pair.prompt) == ["user"] and (pair.chosen.content, pair.rejected.content) == ("4", "5")
    mismatched = {**implicit, "rejected": [{"role": "user", "content": "3+3?"}, implicit["rejected"][1]]}
    (bad,) = read(write_jsonl(tmp_path / "bad.jsonl", [mismatched]))
    assert isinstance(bad, BadRow) and "implicit-prompt" in bad.message()


def test_kto_sharegpt_messages_and_label_column(tmp_path: Path) -> None:
    conv = [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    rows = [{"conversations": conv, "kto_tag": True}, {"conversations": conv, "kto_tag": False}]
    examples = read(write_jsonl(tmp_path / "k.jsonl", rows))
    assert [e.label for e in examples] == [True, False]
    assert all(isinstance(e, LabeledConversation) for e in examples)
    (labeled,) = read(write_jsonl(tmp_path / "l.jsonl", [{"messages": msgs, "label": True}]), "kto")
    assert labeled.label is True and roles(labeled.messages) == ["user", "assistant"]
    (bad,) = read(write_jsonl(tmp_path / "b.jsonl", [{"messages": msgs, "label": "yes"}]), "kto")
    assert isinstance(bad, BadRow)
    assert bad.message().endswith(
        "b.jsonl:1: mistyped field: 'label' is 'yes' (a string); expected true or false"
    )


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        ({"conversations"}, "sharegpt"),
        ({"messages", "tools"}, "messages"),
        ({"instruction", "input", "output"}, "alpaca"),
        ({"instruction", "chosen", "rejected"}, "preference"),
        ({"prompt", "chosen", "rejected"}, "preference"),
        ({"chosen", "rejected"}, "preference"),
        ({"conversations", "kto_tag"}, "kto"),
        ({"messages", "label"}, "kto"),
        ({"text"}, "text"),
    ],
)
def test_detect_format(keys: set[str], expected: str) -> None:
    assert detect_format(keys, "f.jsonl") == expected


def test_auto_detection_ambiguous_or_unknown_names_the_fix(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "x.jsonl", [{"messages": [], "instruction": "a", "output": "b"}])
    with pytest.raises(UserInputError) as err:
        read(path)
    text = str(err.value)
    assert str(path) in text and "instruction, messages, output" in text
    assert "several formats (messages, alpaca)" in text and "set `format:`" in text
    with pytest.raises(UserInputError, match=r"row keys \(prompt, reply\): they fit no known format"):
        read(write_jsonl(tmp_path / "y.jsonl", [{"prompt": "a", "reply": "b"}]))
    with pytest.raises(UserInputError, match="pretraining data"):
        read(write_jsonl(tmp_path / "t.jsonl", [{"text": "plain"}]))


def test_detection_skips_leading_bad_rows(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("{broken\n" + json.dumps(ALPACA[1]) + "\n")
    bad, good = read(path)
    assert isinstance(bad, BadRow) and isinstance(good, Conversation)


def test_weights_are_deterministic_and_match_their_mean() -> None:
    counts = [repeat_count(2.5, seed=7, source_index=0, row_index=i) for i in range(2000)]
    assert set(counts) == {2, 3} and abs(sum(counts) / 2000 - 2.5) < 0.05
    assert counts == [repeat_count(2.5, seed=7, source_index=0, row_index=i) for i in range(2000)]
    assert counts != [repeat_count(2.5, seed=8, source_index=0, row_index=i) for i in range(2000)]
    assert repeat_count(3.0, seed=1, source_index=0, row_index=5) == 3
    bad = BadRow.__new__(BadRow)
    streams: list[list[Any]] = [["a", "b", bad], ["c"]]
    mixed = list(mix_weights(streams, [2.0, 1.0], seed=0))
    assert mixed == ["a", "a", "b", "b", bad, "c"]  # bad rows pass through once
    half = list(mix_weights([list(range(1000))], [0.5], seed=3))
    assert 400 < len(half) < 600 and half == list(mix_weights([list(range(1000))], [0.5], seed=3))


def test_hub_source_without_network_says_how_to_work_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets.config
    import huggingface_hub.constants

    from lmforge.data.hub import is_remote_source

    # The libraries read these at import, which an earlier test may have done: set both ways, or
    # the lookup waits on connection timeouts (23 s in CI) before it fails.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert is_remote_source("hf://tatsu-lab/alpaca") and is_remote_source("tatsu-lab/alpaca")
    assert not is_remote_source("data/train.jsonl") and not is_remote_source("data/*.jsonl")
    with pytest.raises(UserInputError, match="could not stream it from the Hugging Face hub.*hf download"):
        list(
            iter_source_examples(SourceConfig(path="hf://lmforge-test/no-such-dataset"), memory_budget_mb=64)
        )


@pytest.mark.parametrize(
    "prompt,response",
    [("prompt", "response"), ("question", "answer"), ("input", "output"), ("query", "response")],
)
def test_prompt_response_rows_are_detected(tmp_path: Path, prompt: str, response: str) -> None:
    """Two-column rows (the tutorials' SFT shape) read as one user turn and one answer, with no
    `format:` or `columns:` needed; the prompt appears once."""
    path = write_jsonl(tmp_path / "d.jsonl", [{prompt: "What is 2 + 3?", response: "5"}] * 3)
    examples = read(path)
    assert len(examples) == 3 and all(isinstance(e, Conversation) for e in examples)
    assert [(m.role, m.content) for m in examples[0].messages] == [
        ("user", "What is 2 + 3?"),
        ("assistant", "5"),
    ]


def test_alpaca_over_other_columns_names_the_columns_fix(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "What is 2 + 3?", "answer": "5"}])
    with pytest.raises(UserInputError) as err:
        read(path, "alpaca")
    message = str(err.value)
    assert "columns: {prompt: question, response: answer}" in message and "on_bad_row" not in message
    mapped = read(path, "alpaca", columns={"prompt": "question", "response": "answer"})
    assert [m.content for m in mapped[0].messages] == ["What is 2 + 3?", "5"]
