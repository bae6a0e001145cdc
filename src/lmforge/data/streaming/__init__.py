"""Streaming data: sources read lazily while training, each rank and dataloader worker reading its
own part, with a JSON-safe position for an exact resume and a report built as the data is used."""

from lmforge.data.streaming.chat_stream import ChatStream
from lmforge.data.streaming.report import reader_states, stream_report
from lmforge.data.streaming.text_stream import TextStream

__all__ = ["ChatStream", "TextStream", "reader_states", "stream_report"]
