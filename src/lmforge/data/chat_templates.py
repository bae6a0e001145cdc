"""The built-in chat templates (chatml, llama3, qwen2) and the special tokens each one needs.

`data.chat` picks the template a run trains with (a built-in by name, else the tokenizer's
own); the texts live here. Each built-in wraps assistant content in `{% generation %}`
markers, so the loss mask comes from the rendering itself.
"""

from __future__ import annotations

import logging

from transformers import PreTrainedTokenizerBase

from lmforge.data.tokenizer import CHATML_TEMPLATE

log = logging.getLogger(__name__)

# Llama 3 instruct layout (header / content / <|eot_id|>). Tool results use the `ipython`
# role and tool calls are JSON objects with name + parameters, as Llama 3.1 writes them.
LLAMA3_TEMPLATE = (
    "{% if bos_token is defined and bos_token %}{{ bos_token }}{% endif %}"
    "{% for message in messages %}"
    "{% set role = 'ipython' if message['role'] == 'tool' else message['role'] %}"
    "{{ '<|start_header_id|>' + role + '<|end_header_id|>\n\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{% if message['tool_calls'] is defined %}"
    "{% for tool_call in message['tool_calls'] %}"
    "{% set call = tool_call['function'] if tool_call['function'] is defined else tool_call %}"
    "{{ '{\"name\": \"' + call['name'] + '\", \"parameters\": ' }}"
    "{% if call['arguments'] is string %}{{ call['arguments'] }}{% else %}{{ call['arguments'] | tojson }}{% endif %}"
    "{{ '}' }}"
    "{% endfor %}"
    "{% else %}{{ message['content'] | trim }}{% endif %}"
    "{{ '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Qwen2 / Qwen2.5 instruct layout: ChatML with a default system turn, tool schemas in a
# <tools> block of the system turn, calls in <tool_call> tags and results in <tool_response>
# tags of a user turn. The default system text is Qwen2's generic one, not "You are Qwen".
_QWEN2_TOOLS_INTRO = (
    "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>"
)
_QWEN2_TOOLS_OUTRO = (
    "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, '
    '\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n'
)
QWEN2_TEMPLATE = (
    "{% set default_system = 'You are a helpful assistant.' %}"
    "{% if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% else %}{{ default_system }}{% endif %}"
    '{{ "' + _QWEN2_TOOLS_INTRO + '" }}'
    '{% for tool in tools %}{{ "\\n" }}{{ tool | tojson }}{% endfor %}'
    '{{ "' + _QWEN2_TOOLS_OUTRO + '" }}'
    "{% elif messages[0]['role'] == 'system' %}"
    "{{ '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>system\n' + default_system + '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' or (message['role'] == 'system' and not loop.first) %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}"
    "{% if message['tool_calls'] is defined %}"
    "{% if message['content'] %}{{ message['content'] + '\n' }}{% endif %}"
    "{% for tool_call in message['tool_calls'] %}"
    "{% if not loop.first %}{{ '\n' }}{% endif %}"
    "{% set call = tool_call['function'] if tool_call['function'] is defined else tool_call %}"
    "{{ '<tool_call>\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{% if call['arguments'] is string %}{{ call['arguments'] }}{% else %}{{ call['arguments'] | tojson }}{% endif %}"
    "{{ '}\n</tool_call>' }}"
    "{% endfor %}"
    "{% else %}{{ message['content'] }}{% endif %}"
    "{{ '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

BUILTIN_TEMPLATES: dict[str, str] = {
    "chatml": CHATML_TEMPLATE,
    "llama3": LLAMA3_TEMPLATE,
    "qwen2": QWEN2_TEMPLATE,
}
# Special tokens each built-in writes; a tokenizer that lacks them gets them added.
TEMPLATE_TOKENS: dict[str, list[str]] = {
    "chatml": ["<|im_start|>", "<|im_end|>"],
    "llama3": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    "qwen2": ["<|im_start|>", "<|im_end|>"],
}


def ensure_template_tokens(tokenizer: PreTrainedTokenizerBase, name: str | None) -> list[str]:
    """Add the special tokens built-in template `name` needs and the tokenizer lacks (none for None).

    Returns the tokens added (and logs them): the model's embedding grows to fit at build time.
    """
    vocab = tokenizer.get_vocab()
    missing = [token for token in TEMPLATE_TOKENS.get(name or "", []) if token not in vocab]
    if missing:
        tokenizer.add_special_tokens({"extra_special_tokens": missing}, replace_extra_special_tokens=False)
        log.warning(
            "chat template %s: added special tokens %s to the tokenizer; the embedding grows to %d rows",
            name,
            ", ".join(missing),
            len(tokenizer),
        )
    return missing
