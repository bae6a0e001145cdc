"""Checkpoint persistence: atomic writing and sealing, safe loading, resumability checks, and
reading / writing the sharded states (torch DCP, DeepSpeed ZeRO, whole states) a run resumes from.

Below distributed/: it imports no lmforge package but the shared leaves. Turning checkpoints into
other artifacts (conversion, merge, prune, consolidate, verify) is lmforge.export."""
