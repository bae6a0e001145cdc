"""lmforge: one YAML config from raw data to a trained, verified, exported language model."""

__version__ = "0.1.0"
