"""What every stream's saved state says about who saved it, and the check made on loading it.

A stream's position is per reader (data-parallel rank x dataloader worker): each reads its own
part of the data, so a position is only meaningful to the same reader of the same layout.
Loading one saved under another world size or worker count raises ValueError saying so (the
trainer turns it into a refusal naming the checkpoint).
"""

from __future__ import annotations

from typing import Any

from lmforge.data.streaming.parts import StreamPart

STATE_VERSION = 1


def part_state(kind: str, part: StreamPart) -> dict[str, Any]:
    """The header of a saved stream state: its kind, version and reader layout."""
    return {
        "kind": kind,
        "version": STATE_VERSION,
        "rank": part.rank,
        "world_size": part.world_size,
        "worker": part.worker,
        "workers": part.workers,
    }


def check_saved_part(state: dict[str, Any], kind: str, part: StreamPart) -> None:
    """ValueError with the reason when `state` was not saved by this reader of this layout."""
    if state.get("kind") != kind or state.get("version") != STATE_VERSION:
        raise ValueError(
            f"the saved data position is a {state.get('kind')!r} v{state.get('version')} state, "
            f"this stream needs {kind!r} v{STATE_VERSION}"
        )
    for name, now in (("world_size", part.world_size), ("workers", part.workers)):
        if int(state[name]) != now:
            raise ValueError(
                f"the stream position was saved with {name}={state[name]}, this run has {name}={now}: each "
                "data-parallel rank and dataloader worker reads its own part of the data, so a position "
                f"only resumes exactly under the same layout. Run with {name}={state[name]} to resume."
            )
    if (int(state["rank"]), int(state["worker"])) != (part.rank, part.worker):
        raise ValueError(
            f"the stream position belongs to rank {state['rank']} worker {state['worker']}, "
            f"not to rank {part.rank} worker {part.worker}"
        )
