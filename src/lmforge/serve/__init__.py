"""`lmforge serve`: a trained or exported model behind an OpenAI-compatible chat endpoint on
127.0.0.1, through an existing server (llama-cpp-python's for GGUF, vLLM's for HF directories on a
CUDA GPU)."""
