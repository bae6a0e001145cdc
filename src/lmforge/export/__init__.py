"""Export: a checkpoint turned into other artifacts and checked. Consolidation of sharded
checkpoints, format conversion (safetensors, GGUF, ONNX), LoRA merge, prune, inspect, integrity and
behavioural verification in each artifact's own runtime, and the config's `export:` step.

Above evaluate/ (verification runs the model through it); reads checkpoints through lmforge.ckpt."""
