"""Model construction: presets, inline configs and local HF checkpoints."""
