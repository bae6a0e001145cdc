"""The Jinja texts of the built-in chat templates of families without a tool-call format (Llama 2, Mistral,
Gemma, Phi-3, Phi-4, GLM-4); those with one are in `data.chat_template_tool_texts`, the catalogue
(names, special tokens, stop tokens) in `data.chat_templates`.

Each text renders what the family's own template renders (tests/test_chat_catalogue.py compares
them with the families' templates TRL ships, or with golden strings of the published format) and
wraps what the assistant writes (its content and the token that ends its turn) in
`{% generation %}` markers, so the loss mask comes from the rendering itself.
These templates stop with an error on a conversation with tools instead of inventing a format
(and Llama 2's, Mistral's and Gemma's on a system message they have no place for).
"""

from __future__ import annotations

_BOS = "{% if bos_token is defined and bos_token %}{{ bos_token }}{% endif %}"
_EOS = "{% if eos_token is defined and eos_token %}{{ eos_token }}{% endif %}"
# The first message, when it is a system message, taken out of the turns (families that place it inside one).
_SPLIT_SYSTEM = (
    "{% if messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set system = '' %}{% set loop_messages = messages %}{% endif %}"
)
_TOOL_FAMILIES = "llama3, qwen2, qwen3, qwen3_nothink, deepseek or glm4_moe"


def _no_tools(name: str) -> str:
    """Jinja that stops on tools, tool calls or tool results: the family has no format for them, and
    training a made-up one would teach the model a syntax no runtime parses."""
    message = (
        f"the {name} chat template has no tool-call format; use {_TOOL_FAMILIES} for conversations with tools"
    )
    refuse = "{{ raise_exception('" + message + "') }}"
    return (
        "{% if tools %}" + refuse + "{% endif %}"
        "{% for message in messages %}"
        "{% if message['role'] == 'tool' or message['tool_calls'] is defined %}" + refuse + "{% endif %}"
        "{% endfor %}"
    )


def _first_system_only(name: str) -> str:
    """Jinja that stops on a system message after the first: the family places only one, at the start."""
    message = f"the {name} chat template takes one system message, the first; merge the others into it"
    return (
        "{% for message in messages %}{% if message['role'] == 'system' and not loop.first %}"
        "{{ raise_exception('" + message + "') }}{% endif %}{% endfor %}"
    )


# Llama 2 chat (Meta's HF template): every user turn opens with BOS and [INST]; the system prompt
# sits in <<SYS>> tags inside the first one; the assistant answers ' {content} ' + EOS.
LLAMA2_TEMPLATE = (
    _no_tools("llama2") + _first_system_only("llama2") + _SPLIT_SYSTEM + "{% for message in loop_messages %}"
    "{% if message['role'] == 'user' %}"
    "{% set content = message['content'] %}"
    "{% if loop.first and system %}{% set content = '<<SYS>>\n' + system + '\n<</SYS>>\n\n' + content %}{% endif %}"
    + _BOS
    + "{{ '[INST] ' + content | trim + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{% generation %}{{ ' ' + message['content'] | trim + ' ' }}" + _EOS + "{% endgeneration %}"
    "{% endif %}"
    "{% endfor %}"
)

# Mistral instruct, v0.3 spacing ('[INST] {user}[/INST] {assistant}</s>'). The system prompt is
# prepended to the first user message, as v0.1/v0.2's template and LLaMA-Factory do (v0.3's own
# template puts it in the last user message and drops it once an assistant turn ends the chat).
MISTRAL_TEMPLATE = (
    _no_tools("mistral")
    + _first_system_only("mistral")
    + _SPLIT_SYSTEM
    + _BOS
    + "{% for message in loop_messages %}"
    "{% if message['role'] == 'user' %}"
    "{% if loop.first and system %}{{ '[INST] ' + system + '\n\n' + message['content'] + '[/INST]' }}"
    "{% else %}{{ '[INST] ' + message['content'] + '[/INST]' }}{% endif %}"
    "{% elif message['role'] == 'assistant' %}"
    "{% generation %}{{ ' ' + message['content'] | trim }}" + _EOS + "{% endgeneration %}"
    "{% endif %}"
    "{% endfor %}"
)

# Gemma / Gemma 2 / Gemma 3 (text): <start_of_turn>user|model turns closed by <end_of_turn>. Gemma has
# no system role: the system prompt opens the first user turn, followed by a blank line (Gemma 3's
# template, LLaMA-Factory).
GEMMA_TEMPLATE = (
    _no_tools("gemma")
    + _first_system_only("gemma")
    + _SPLIT_SYSTEM
    + _BOS
    + "{% for message in loop_messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<start_of_turn>model\n' }}"
    "{% generation %}{{ message['content'] | trim + '<end_of_turn>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}"
    "{{ '<start_of_turn>' + message['role'] + '\n' }}"
    "{% if loop.first and system %}{{ system + '\n\n' }}{% endif %}"
    "{{ message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

# Phi-3 / Phi-3.5: <|system|>, <|user|>, <|assistant|> turns closed by <|end|> and a newline; without a
# generation prompt the text ends with EOS, which after a final assistant turn belongs to it.
PHI3_TEMPLATE = (
    _no_tools("phi3") + "{% set close_with_eos = not add_generation_prompt %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{% set ends_chat = loop.last and close_with_eos %}"
    "{{ '<|assistant|>\n' }}"
    "{% generation %}{{ message['content'] + '<|end|>' }}"
    "{% if ends_chat %}{{ '\n' }}" + _EOS + "{% endif %}{% endgeneration %}"
    "{% if not ends_chat %}{{ '\n' }}{% endif %}"
    "{% else %}{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}"
    "{% elif messages[-1]['role'] != 'assistant' %}" + _EOS + "{% endif %}"
)

# Phi-4 (microsoft/phi-4): ChatML with <|im_sep|> after the role and no newlines.
PHI4_TEMPLATE = (
    _no_tools("phi4") + "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant<|im_sep|>' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '<|im_sep|>' + message['content'] + '<|im_end|>' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant<|im_sep|>' }}{% endif %}"
)

# GLM-4 chat (GLM-4-9B-chat, GLM-4-0414): [gMASK]<sop>, then <|role|>\n{content} turns with no closing
# token: the model ends its turn by writing the next role token (<|user|>, <|observation|>), so that
# token is the end of the assistant's turn and sits inside its generation block (GLM-4.5's template,
# glm4_moe, shares these pieces).
GLM_ROLE_TOKENS = (
    "{% set role_tokens = {'system': '<|system|>', 'user': '<|user|>', "
    "'assistant': '<|assistant|>', 'tool': '<|observation|>'} %}"
)
# A role token, unless the assistant turn before wrote it (it ended that turn) or the message
# continues a run of tool results (one <|observation|> opens them all).
GLM_ROLE_TOKEN_UNLESS_WRITTEN = (
    "{% set previous = '' if loop.first else messages[loop.index0 - 1]['role'] %}"
    "{% if not ((previous == 'assistant' and message['role'] in ('user', 'tool')) "
    "or (previous == 'tool' and message['role'] == 'tool')) %}{{ role_tokens[message['role']] }}{% endif %}"
)
GLM_NEXT_ROLE_TOKEN = (
    "{% if not loop.last and messages[loop.index0 + 1]['role'] in ('user', 'tool') %}"
    "{{ role_tokens[messages[loop.index0 + 1]['role']] }}{% endif %}"
)
GLM4_TEMPLATE = (
    _no_tools("glm4") + GLM_ROLE_TOKENS + "[gMASK]<sop>"
    "{% for message in messages %}"
    + GLM_ROLE_TOKEN_UNLESS_WRITTEN
    + "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ '\n' + message['content'] }}" + GLM_NEXT_ROLE_TOKEN + "{% endgeneration %}"
    "{% else %}{{ '\n' + message['content'] }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
