"""Reading documents from files, globs, directories and built-in corpora; errors name file and line."""

from __future__ import annotations

import itertools
import json
import re
import sysconfig
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmforge.config.schema import SourceConfig
from lmforge.data.corpus import builtin_files, builtin_names, iter_builtin_documents
from lmforge.data.source_paths import resolve_files
from lmforge.data.sources import SourceStats, iter_documents, sources_fingerprint
from lmforge.errors import UserInputError


def read(path: Path | str, **settings: object) -> tuple[list[str], SourceStats]:
    stats = SourceStats(str(path))
    documents = list(iter_documents(SourceConfig(path=str(path), **settings), stats))
    return documents, stats


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def test_txt_file_line_and_paragraph_splits(tmp_path: Path) -> None:
    file = tmp_path / "a.txt"
    file.write_text("first line\nsecond line\n\n  \n\nthird para\n   \nlast", encoding="utf-8")

    whole, stats = read(file)
    assert whole == [file.read_text(encoding="utf-8")] and stats.documents == 1

    lines, stats = read(file, split="line")
    assert lines == ["first line", "second line", "third para", "last"]
    assert stats.empty_documents_skipped == 4  # "", "  ", "", "   " are counted, not silently lost

    paragraphs, stats = read(file, split="paragraph")
    assert paragraphs == ["first line\nsecond line", "third para", "last"]
    assert stats.empty_documents_skipped == 0


def test_jsonl_reads_the_text_field_and_counts_empty_documents(tmp_path: Path) -> None:
    file = write_jsonl(
        tmp_path / "d.jsonl", [{"body": "one"}, {"body": ""}, {"body": " \n\t"}, {"body": "two  "}]
    )
    with file.open("a") as handle:
        handle.write("\n")  # a blank line is no record
    documents, stats = read(file, text_field="body")
    assert documents == ["one", "two  "]  # kept documents are not stripped
    assert (stats.documents, stats.empty_documents_skipped, stats.files) == (2, 2, 1)


def test_jsonl_bad_line_error_names_file_line_and_fix(tmp_path: Path) -> None:
    file = tmp_path / "bad.jsonl"
    file.write_text('{"text": "ok"}\n{"text": "ok"}\n{"text": "unterminated\n', encoding="utf-8")
    with pytest.raises(UserInputError, match=rf"{re.escape(str(file))}:3: invalid JSON .*Fix:"):
        read(file)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"content": "x"}, r"no field 'text' \(fields present: content\).*text_field"),
        ({"text": 3}, r"field 'text' is int, expected a string"),
        ([1, 2], r"expected a JSON object"),
    ],
)
def test_jsonl_wrong_record_shapes_are_explained(tmp_path: Path, row: object, message: str) -> None:
    file = write_jsonl(tmp_path / "d.jsonl", [{"text": "fine"}, row])
    with pytest.raises(UserInputError, match=rf"{re.escape(str(file))}:2: {message}"):
        read(file)


def test_invalid_utf8_names_the_line(tmp_path: Path) -> None:
    file = tmp_path / "latin1.txt"
    file.write_bytes("ok\nna\xefve\n".encode("latin-1"))
    with pytest.raises(UserInputError, match=rf"{re.escape(str(file))}:2: not valid UTF-8.*Fix"):
        read(file, split="line")


def test_json_list_of_objects_or_strings(tmp_path: Path) -> None:
    objects = tmp_path / "o.json"
    objects.write_text(json.dumps([{"text": "a"}, {"text": ""}, {"text": "b"}]), encoding="utf-8")
    strings = tmp_path / "s.json"
    strings.write_text(json.dumps(["c", "d"]), encoding="utf-8")
    assert read(objects)[0] == ["a", "b"] and read(objects)[1].empty_documents_skipped == 1
    assert read(strings)[0] == ["c", "d"]


def test_json_top_level_object_is_rejected_with_a_fix(tmp_path: Path) -> None:
    file = tmp_path / "d.json"
    file.write_text(json.dumps({"data": [{"text": "a"}]}), encoding="utf-8")
    with pytest.raises(UserInputError, match=r"top level is a JSON dict.*\.jsonl"):
        read(file)


def test_parquet_column_read_across_batches(tmp_path: Path) -> None:
    texts = [f"row {i}" if i % 1000 else "" for i in range(5000)]  # more rows than one read batch
    pq.write_table(pa.table({"text": texts, "id": list(range(5000))}), tmp_path / "d.parquet")
    documents, stats = read(tmp_path / "d.parquet")
    assert documents == [t for t in texts if t]
    assert stats.empty_documents_skipped == 5


def test_parquet_missing_column_lists_the_columns(tmp_path: Path) -> None:
    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "d.parquet")
    with pytest.raises(UserInputError, match=r"no column 'text' \(columns: body\)"):
        read(tmp_path / "d.parquet")


def test_glob_and_directory_resolve_sorted_supported_files(tmp_path: Path) -> None:
    (tmp_path / "sub" / "deeper").mkdir(parents=True)
    for name in ["b.txt", "a.txt", "sub/c.jsonl", "sub/deeper/d.md", "notes.csv"]:
        (tmp_path / name).write_text('{"text": "x"}' if name.endswith("jsonl") else "x", encoding="utf-8")

    assert resolve_files(SourceConfig(path=str(tmp_path / "*.txt"))) == [
        tmp_path / "a.txt",
        tmp_path / "b.txt",
    ]
    # A directory reads its data files; .md files there are documentation unless named.
    found = resolve_files(SourceConfig(path=str(tmp_path)))
    assert found == sorted(tmp_path / n for n in ["a.txt", "b.txt", "sub/c.jsonl"])
    recursive = resolve_files(SourceConfig(path=str(tmp_path / "**" / "*.jsonl")))
    assert recursive == [tmp_path / "sub" / "c.jsonl"]
    assert resolve_files(SourceConfig(path=str(tmp_path / "**" / "*.md"))) == [tmp_path / "sub/deeper/d.md"]
    assert read(tmp_path)[1].documents == 3


def test_missing_path_and_empty_glob_say_what_was_searched(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(UserInputError, match=rf"'{re.escape(str(missing))}': no such file or directory.*Fix"):
        resolve_files(SourceConfig(path=str(missing)))
    with pytest.raises(UserInputError, match=r"no files found; searched the glob .*\*\.parquet"):
        resolve_files(SourceConfig(path=str(tmp_path / "*.parquet")))


def test_unsupported_file_type_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "table.csv").write_text("a,b\n", encoding="utf-8")
    with pytest.raises(UserInputError, match=r"unsupported type '\.csv'"):
        resolve_files(SourceConfig(path=str(tmp_path / "table.csv")))


def test_max_documents_stops_reading(tmp_path: Path) -> None:
    file = write_jsonl(tmp_path / "d.jsonl", [{"text": str(i)} for i in range(10)])
    documents, stats = read(file, max_documents=3)
    assert documents == ["0", "1", "2"] and stats.documents == 3


def test_builtin_stdlib_corpus_is_deterministic_and_offline() -> None:
    files = builtin_files("builtin:python-stdlib")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    relative = [f.relative_to(stdlib).as_posix() for f in files]
    assert relative == sorted(relative) and "os.py" in relative
    assert not any(part in {"site-packages", "test", "tests"} for r in relative for part in r.split("/"))
    first = list(itertools.islice(iter_builtin_documents("builtin:python-stdlib"), 3))
    assert first == [f.read_text(encoding="utf-8") for f in files[:3]]
    documents, stats = read("builtin:python-stdlib", max_documents=5)
    assert len(documents) == 5 and stats.files == len(files)


def test_unknown_builtin_lists_valid_names() -> None:
    with pytest.raises(
        UserInputError, match=r"unknown built-in corpus 'builtin:wiki'.*builtin:python-stdlib"
    ):
        list(iter_builtin_documents("builtin:wiki"))
    assert builtin_names() == ["builtin:python-stdlib"]


def test_fingerprint_follows_content_and_settings(tmp_path: Path) -> None:
    file = write_jsonl(tmp_path / "d.jsonl", [{"text": "abc"}])
    source = SourceConfig(path=str(file))
    first = sources_fingerprint([source])
    assert sources_fingerprint([source]) == first
    write_jsonl(file, [{"text": "abd"}])  # same size, different bytes
    changed = sources_fingerprint([source])
    assert changed != first
    assert sources_fingerprint([SourceConfig(path=str(file), max_documents=1)]) != changed
    builtin = [SourceConfig(path="builtin:python-stdlib")]
    assert sources_fingerprint(builtin) == sources_fingerprint(builtin)
