"""vLLM as a verification runtime (`ckpt verify --runtime vllm`): does the model a user will serve
with vLLM behave in vLLM like the trained model in transformers?

vLLM reports log-probabilities, not raw logits: the prompt's log-probabilities over the whole
vocabulary (`prompt_logprobs`) give every position's next-token distribution, so perplexity and
top-1 agreement are exact, and `verify.compare` puts the reference's logits through a log-softmax
before comparing them. Greedy generations run with temperature 0 and EOS ignored, as the other
runtimes' plain argmax loops do. vLLM needs a CUDA GPU; elsewhere this is refused before loading.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.errors import UserInputError

INSTALL = "pip install 'lmforge[vllm]' on a machine with a CUDA GPU"


def require_vllm(path: Path) -> None:
    import torch

    if not torch.cuda.is_available():
        raise UserInputError(
            f"--runtime vllm: vLLM runs on a CUDA GPU and this machine has none, so {path} cannot be checked "
            "in vLLM here. Fix: verify in transformers here (the default --runtime auto), and with "
            f"--runtime vllm on a GPU machine ({INSTALL})"
        )
    if importlib.util.find_spec("vllm") is None:
        raise UserInputError(f"--runtime vllm: vLLM is not installed. Fix: {INSTALL}")


def open_in_vllm(path: Path) -> VllmModel:
    require_vllm(path)
    if not (path / "config.json").is_file():
        raise UserInputError(
            f"--runtime vllm: {path} is not an HF model directory; vLLM verification takes a merged model "
            "or a compressed-tensors export (merge an adapter first: `lmforge ckpt merge-lora`)"
        )
    return VllmModel(path)


class VllmModel:
    """One vLLM engine on the model directory, in this process."""

    normalized = True  # logits() returns log-probabilities

    def __init__(self, path: Path) -> None:
        from transformers import AutoConfig
        from vllm import LLM

        config = AutoConfig.from_pretrained(path, trust_remote_code=False)
        self.vocab_size = int(config.get_text_config().vocab_size)
        # enforce_eager: no CUDA-graph capture for a handful of prompts; a small share of the GPU
        # so the reference model fits beside it.
        self.llm = LLM(
            model=str(path),
            max_logprobs=self.vocab_size,
            enforce_eager=True,
            gpu_memory_utilization=0.4,
            seed=0,
            trust_remote_code=False,
        )

    def logits(self, token_ids: list[int]) -> np.ndarray:
        from vllm import SamplingParams

        params = SamplingParams(
            max_tokens=1,
            temperature=0.0,
            prompt_logprobs=self.vocab_size,
            logprobs=self.vocab_size,
            detokenize=False,
        )
        result = self._generate(token_ids, params)
        # prompt_logprobs[i] is the distribution token i was drawn from (None for the first token);
        # the last position's distribution is the one the generated token came from.
        rows = [*result.prompt_logprobs[1:], result.outputs[0].logprobs[0]]
        out = np.full((len(token_ids), self.vocab_size), -np.inf, dtype=np.float32)
        for position, row in enumerate(rows):
            for token, logprob in row.items():
                out[position, token] = logprob.logprob
        return out

    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
        return list(self._generate(prompt_ids, params).outputs[0].token_ids)

    def _generate(self, token_ids: list[int], params: Any) -> Any:
        from vllm.inputs import TokensPrompt

        return self.llm.generate([TokensPrompt(prompt_token_ids=token_ids)], params, use_tqdm=False)[0]
