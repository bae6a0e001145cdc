"""The normalized rows every fine-tuning format is read into, and what the tokenizer stage consumes.

Readers (alpaca, sharegpt, messages, preference, kto; see `lmforge.data.formats`) turn a raw
row into one of these or into a `BadRow`; chat rendering and packing (`lmforge.data.chat`,
`lmforge.data.packing`) only ever see these types.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]


@dataclass(frozen=True)
class Origin:
    """Where a row came from, for error messages and the bad-row quarantine."""

    file: str
    line: int  # 1-based line for jsonl/txt; 1-based row index for json/csv/parquet/arrow


@dataclass
class Message:
    role: Role
    content: str
    # OpenAI-style tool calls of an assistant turn: [{"type": "function", "function": {"name", "arguments"}}].
    tool_calls: list[dict[str, Any]] | None = None
    name: str | None = None  # the tool's name on a tool message


@dataclass
class Conversation:
    """An SFT sample: a conversation that ends with an assistant turn, plus optional tool schemas."""

    messages: list[Message]
    origin: Origin
    tools: list[dict[str, Any]] | None = None
    # The row's images (absolute paths, checked readable), one per `<image>` placeholder in the
    # turns' text, in order (lmforge.data.images).
    images: list[str] = field(default_factory=list)


@dataclass
class PreferencePair:
    """A DPO-style sample: a shared prompt conversation and two alternative assistant answers."""

    prompt: list[Message]
    chosen: Message
    rejected: Message
    origin: Origin
    tools: list[dict[str, Any]] | None = None
    # The prompt's images (absolute paths, checked), one per `<image>` placeholder in its turns.
    images: list[str] = field(default_factory=list)


@dataclass
class LabeledConversation:
    """A KTO sample: a conversation and whether its final assistant answer is desirable."""

    messages: list[Message]
    label: bool
    origin: Origin
    images: list[str] = field(default_factory=list)  # refused by the stages that take these rows


Example = Conversation | PreferencePair | LabeledConversation


@dataclass
class BadRow:
    """A row that could not become an example; quarantined with its reason when on_bad_row=skip."""

    origin: Origin
    reason: str  # short class, e.g. "malformed JSON", "missing field", "wrong role order"
    detail: str  # what exactly, e.g. "conversations[2].from is 'bot'; expected human, gpt, ..."
    raw: str = field(default="", repr=False)  # the row text, cut to a few KB for the quarantine file

    def message(self) -> str:
        return f"{self.origin.file}:{self.origin.line}: {self.reason}: {self.detail}"
