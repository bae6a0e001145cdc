"""The Jinja texts of the built-in chat templates of families with a tool-call format: Llama 3, Qwen2,
Qwen3, DeepSeek-V3/R1 and GLM-4.5 (the others are in `data.chat_template_texts`).

As there, each renders what the family's own template renders and wraps what the assistant writes
(content, tool calls, the token that ends its turn) in `{% generation %}` markers. Tool results
are never inside them: the model reads them, it does not write them.
"""

from __future__ import annotations

from lmforge.data.chat_template_texts import (
    GLM_NEXT_ROLE_TOKEN,
    GLM_ROLE_TOKEN_UNLESS_WRITTEN,
    GLM_ROLE_TOKENS,
)

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

# The Qwen family's tool syntax (Qwen2.5, Qwen3): tool schemas in a <tools> block of the system
# turn, calls in <tool_call> tags, results in <tool_response> tags of a user turn.
_QWEN_TOOLS_INTRO = (
    "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>"
)
_QWEN_TOOLS_OUTRO = (
    "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, '
    '\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n'
)
_QWEN_TOOL_SCHEMAS = (
    '{{ "' + _QWEN_TOOLS_INTRO + '" }}'
    '{% for tool in tools %}{{ "\\n" }}{{ tool | tojson }}{% endfor %}'
    '{{ "' + _QWEN_TOOLS_OUTRO + '" }}'
)
_QWEN_TOOL_CALLS = (
    "{% for tool_call in message['tool_calls'] %}"
    "{% if not loop.first %}{{ '\n' }}{% endif %}"
    "{% set call = tool_call['function'] if tool_call['function'] is defined else tool_call %}"
    "{{ '<tool_call>\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{% if call['arguments'] is string %}{{ call['arguments'] }}{% else %}{{ call['arguments'] | tojson }}{% endif %}"
    "{{ '}\n</tool_call>' }}"
    "{% endfor %}"
)
_QWEN_USER_OR_LATER_SYSTEM = (
    "{% if message['role'] == 'user' or (message['role'] == 'system' and not loop.first) %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
)
_QWEN_TOOL_RESULT = (
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% endif %}"
)

# Qwen2 / Qwen2.5 instruct layout: ChatML with a default system turn. The default system text
# is Qwen2's generic one, not Qwen2.5's "You are Qwen, created by Alibaba Cloud. ...".
QWEN2_TEMPLATE = (
    "{% set default_system = 'You are a helpful assistant.' %}"
    "{% if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% else %}{{ default_system }}{% endif %}"
    '{{ "\\n\\n' + _QWEN_TOOLS_INTRO + '" }}'
    '{% for tool in tools %}{{ "\\n" }}{{ tool | tojson }}{% endfor %}'
    '{{ "' + _QWEN_TOOLS_OUTRO + '" }}'
    "{% elif messages[0]['role'] == 'system' %}"
    "{{ '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>system\n' + default_system + '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}" + _QWEN_USER_OR_LATER_SYSTEM + "{% elif message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}"
    "{% if message['tool_calls'] is defined %}"
    "{% if message['content'] %}{{ message['content'] + '\n' }}{% endif %}"
    + _QWEN_TOOL_CALLS
    + "{% else %}{{ message['content'] }}{% endif %}"
    "{{ '<|im_end|>' }}{% endgeneration %}{{ '\n' }}" + _QWEN_TOOL_RESULT + "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Qwen3 (hybrid thinking): no default system turn. As Qwen3's own template, the assistant turns
# after the last user query carry their reasoning in <think> tags (read from `<think>...</think>`
# in the content), and the final one an empty <think></think> block when it has none: the
# non-thinking answer format. Earlier turns are rendered without reasoning.
_QWEN3_LAST_QUERY = (
    "{% set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{% for message in messages[::-1] %}"
    "{% set index = (messages|length - 1) - loop.index0 %}"
    "{% if ns.multi_step_tool and message['role'] == 'user' and message['content'] is string and not "
    "(message['content'].startswith('<tool_response>') and message['content'].endswith('</tool_response>')) %}"
    "{% set ns.multi_step_tool = false %}{% set ns.last_query_index = index %}{% endif %}"
    "{% endfor %}"
)
_QWEN3_ANSWER_WITH_REASONING = (
    "{% set content = message['content'] %}{% set reasoning = '' %}"
    "{% if message['reasoning_content'] is string %}{% set reasoning = message['reasoning_content'] %}"
    "{% elif '</think>' in content %}"
    "{% set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}"
    "{% set content = content.split('</think>')[-1].lstrip('\n') %}{% endif %}"
    "{% if loop.index0 > ns.last_query_index and (loop.last or reasoning) %}"
    "{{ '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}"
    "{% else %}{{ content }}{% endif %}"
)


def _qwen3_template(thinking: bool) -> str:
    """Qwen3's layout; without `thinking`, Qwen3-Instruct-2507's (no <think> handling at all)."""
    answer = (
        _QWEN3_ANSWER_WITH_REASONING if thinking else "{% set content = message['content'] %}{{ content }}"
    )
    no_think_prompt = "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    return (
        "{% if tools %}"
        "{{ '<|im_start|>system\n' }}"
        "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
        + _QWEN_TOOL_SCHEMAS
        + "{% elif messages[0]['role'] == 'system' %}"
        "{{ '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}{% endif %}"
        + (_QWEN3_LAST_QUERY if thinking else "")
        + "{% for message in messages %}"
        + _QWEN_USER_OR_LATER_SYSTEM
        + "{% elif message['role'] == 'assistant' %}"
        "{{ '<|im_start|>assistant\n' }}{% generation %}"
        + answer
        + "{% if message['tool_calls'] is defined %}{% if content %}{{ '\n' }}{% endif %}"
        + _QWEN_TOOL_CALLS
        + "{% endif %}"
        "{{ '<|im_end|>' }}{% endgeneration %}{{ '\n' }}" + _QWEN_TOOL_RESULT + "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
        + (no_think_prompt if thinking else "")
        + "{% endif %}"
    )


QWEN3_TEMPLATE = _qwen3_template(thinking=True)
QWEN3_NOTHINK_TEMPLATE = _qwen3_template(thinking=False)

# DeepSeek-V3 / R1: BOS and the system prompts (joined by blank lines) first, then <｜User｜> and
# <｜Assistant｜> turns, the assistant's closed by <｜end▁of▁sentence｜>. Unlike DeepSeek's own template
# the reasoning (<think>...</think>) is kept in assistant turns (it is what the model learns to
# write), and the generation prompt adds R1's "<think>\n" only with enable_thinking=True.
_DEEPSEEK_TOOL_CALLS = (
    "{% if message['tool_calls'] is defined %}{{ '<｜tool▁calls▁begin｜>' }}"
    "{% for tool_call in message['tool_calls'] %}"
    "{% if not loop.first %}{{ '\n' }}{% endif %}"
    "{% set call = tool_call['function'] if tool_call['function'] is defined else tool_call %}"
    "{% set kind = tool_call['type'] if tool_call['type'] is defined else 'function' %}"
    "{{ '<｜tool▁call▁begin｜>' + kind + '<｜tool▁sep｜>' + call['name'] + '\n```json\n' }}"
    "{% if call['arguments'] is string %}{{ call['arguments'] }}{% else %}{{ call['arguments'] | tojson }}{% endif %}"
    "{{ '\n```<｜tool▁call▁end｜>' }}"
    "{% endfor %}{{ '<｜tool▁calls▁end｜>' }}{% endif %}"
)
DEEPSEEK_TEMPLATE = (
    "{% set ns = namespace(system='', first_system=true) %}"
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{% set ns.system = message['content'] if ns.first_system else ns.system + '\n\n' + message['content'] %}"
    "{% set ns.first_system = false %}{% endif %}{% endfor %}"
    "{% if bos_token is defined and bos_token %}{{ bos_token }}{% endif %}{{ ns.system }}"
    "{% for message in messages %}"
    "{% set after_tool = not loop.first and messages[loop.index0 - 1]['role'] == 'tool' %}"
    "{% if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<｜tool▁outputs▁end｜>' if after_tool else '<｜Assistant｜>' }}"
    "{% generation %}{{ message['content'] }}" + _DEEPSEEK_TOOL_CALLS + "{{ '<｜end▁of▁sentence｜>' }}"
    "{% endgeneration %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if not after_tool %}{{ '<｜tool▁outputs▁begin｜>' }}{% endif %}"
    "{{ '<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if messages[-1]['role'] == 'tool' %}{{ '<｜tool▁outputs▁end｜>' }}"
    "{% elif add_generation_prompt %}{{ '<｜Assistant｜>' }}"
    "{% if enable_thinking is defined and enable_thinking %}{{ '<think>\n' }}{% endif %}{% endif %}"
)

# GLM-4.5 / GLM-4.6 (GLM-4-MoE): GLM-4's layout, plus a <think> block in every assistant turn
# (empty unless the turn carries reasoning after the last user message) and the tool syntax
# of GLM-4.5's template (<tool_call>name, <arg_key>/<arg_value> pairs, <|observation|> results).
_GLM45_TOOL_SCHEMAS = (
    "{% if tools %}{{ '<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query."
    "\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{% for tool in tools %}{{ '\n' }}{{ tool | tojson(ensure_ascii=False) }}{% endfor %}"
    "{{ '\n</tools>\n\nFor each function call, output the function name and arguments within the following "
    "XML format:\n<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}"
    "</arg_value>\n<arg_key>{arg-key-2}</arg_key>\n<arg_value>{arg-value-2}</arg_value>\n...\n</tool_call>' }}"
    "{% endif %}"
)
_GLM45_ANSWER = (
    "{% set content = message['content'] %}{% set reasoning = '' %}"
    "{% if message['reasoning_content'] is string %}{% set reasoning = message['reasoning_content'] %}"
    "{% elif '</think>' in content %}"
    "{% set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}"
    "{% set content = content.split('</think>')[-1].lstrip('\n') %}{% endif %}"
    "{% if loop.index0 > ns.last_user_index and reasoning %}{{ '\n<think>' + reasoning.strip() + '</think>' }}"
    "{% else %}{{ '\n<think></think>' }}{% endif %}"
    "{% if content.strip() %}{{ '\n' + content.strip() }}{% endif %}"
    "{% if message['tool_calls'] is defined %}{% for tool_call in message['tool_calls'] %}"
    "{% set call = tool_call['function'] if tool_call['function'] is defined else tool_call %}"
    "{% if call['arguments'] is string %}{{ raise_exception('the glm4_moe chat template writes tool-call "
    "arguments as key/value pairs: give them as an object, not a JSON string') }}{% endif %}"
    "{{ '\n<tool_call>' + call['name'] + '\n' }}"
    "{% for key, value in call['arguments'].items() %}"
    "{{ '<arg_key>' + key + '</arg_key>\n<arg_value>' }}"
    "{{ value if value is string else value | tojson(ensure_ascii=False) }}{{ '</arg_value>\n' }}"
    "{% endfor %}{{ '</tool_call>' }}"
    "{% endfor %}{% endif %}"
)
GLM4_MOE_TEMPLATE = (
    GLM_ROLE_TOKENS + "[gMASK]<sop>" + _GLM45_TOOL_SCHEMAS + "{% set ns = namespace(last_user_index=-1) %}"
    "{% for message in messages %}{% if message['role'] == 'user' %}"
    "{% set ns.last_user_index = loop.index0 %}{% endif %}{% endfor %}"
    "{% set no_think = enable_thinking is defined and not enable_thinking %}"
    "{% for message in messages %}"
    + GLM_ROLE_TOKEN_UNLESS_WRITTEN
    + "{% if message['role'] == 'assistant' %}"
    "{% generation %}" + _GLM45_ANSWER + GLM_NEXT_ROLE_TOKEN + "{% endgeneration %}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{% else %}{{ '\n' + message['content'] }}"
    "{% if message['role'] == 'user' and no_think and not message['content'].endswith('/nothink') %}"
    "{{ '/nothink' }}{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% if no_think %}{{ '\n<think></think>' }}{% endif %}"
    "{% endif %}"
)
