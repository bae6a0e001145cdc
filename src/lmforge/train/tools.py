"""Tools of multi-turn online RL (`train.rl.tools`), handed to TRL's GRPOTrainer.

TRL runs the episode: it renders the tools' schemas into the prompt with the chat template,
parses the model's tool calls with the tokenizer's response template, calls the tools, appends
their results and lets the model go on, up to `max_turns` calls and `max_completion_length`
tokens; the tool results are masked out of the loss (its `tool_mask`). lmforge supplies the
tools (a built-in or the user's functions, or an environment class), the response template of
the catalogue's tool templates, and checks everything a run would otherwise find mid-episode:
a template without a tool-call format, a function whose docstring cannot become a schema.
"""

from __future__ import annotations

import ast
import inspect
import logging
import math
import operator
from collections.abc import Callable
from typing import Any

from transformers import PreTrainedTokenizerBase

from lmforge.config.schema import BUILTIN_TOOLS, RlToolsConfig
from lmforge.data.chat_templates import builtin_template_name
from lmforge.errors import UserInputError
from lmforge.train.reward_sources import user_object

log = logging.getLogger(__name__)

# ---- the built-in calculator -------------------------------------------------------------------

_OPERATORS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_SIGNS: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 64  # 10**64 is still a number; 9**9**9 would hold the episode for minutes
MAX_EXPRESSION = 200  # characters
MAX_BITS = 512  # an integer result past about 10**154 is refused: powers of powers grow without bound


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, e.g. "12 * (3 + 4)".
    """
    # A parse tree walked by hand, never eval: the expression is the model's text.
    if len(expression) > MAX_EXPRESSION:
        raise ValueError(f"expression longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    return _number_text(_evaluate(tree.body))


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value  # type: ignore[return-value]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _SIGNS:
        return _SIGNS[type(node.op)](_evaluate(node.operand))  # type: ignore[no-any-return]
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is above {MAX_EXPONENT}")
        result = _OPERATORS[type(node.op)](left, right)
        if isinstance(result, int) and result.bit_length() > MAX_BITS:
            raise ValueError("the result has more than 150 digits")
        return result  # type: ignore[no-any-return]
    raise ValueError(f"only numbers and + - * / // % ** ( ) are allowed, not {ast.unparse(node)!r}")


def _number_text(value: int | float) -> str:
    """42, not 42.0; 0.333333333333, not 17 digits of float noise."""
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("the result is not a finite number")
        if value.is_integer():
            return str(int(value))
        return f"{value:.12g}"
    return str(value)


BUILTIN: dict[str, Callable[..., Any]] = {"calculator": calculator}
assert tuple(BUILTIN) == BUILTIN_TOOLS, "config.schema.BUILTIN_TOOLS lists the built-in tools"

# ---- what TRL's GRPOTrainer is given -----------------------------------------------------------

# The catalogue's templates with a tool-call format, by the TRL response template that parses what
# the model writes back into a tool call (tests/test_rl_tools.py renders and parses each one).
TOOL_TEMPLATES = ("qwen2", "qwen3", "qwen3_nothink", "llama3")


def response_template(name: str) -> dict[str, Any]:
    from trl.chat_template_utils import llama3_template, qwen3_template

    return llama3_template if name == "llama3" else qwen3_template  # type: ignore[no-any-return]


def tool_arguments(tools: RlToolsConfig, tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """GRPOTrainer's `tools` / `environment_factory` arguments; the tokenizer gets the response
    template that parses the model's tool calls. Every problem is a UserInputError now, before
    the model loads into a trainer."""
    _parse_tool_calls(tokenizer)
    functions = [_tool_function(index, spec, tools) for index, spec in enumerate(tools.functions)]
    arguments: dict[str, Any] = {"tools": functions}
    if tools.environment is not None:
        arguments["environment_factory"] = _environment_class(tools.environment)
    return arguments


def tool_names(tools: RlToolsConfig) -> list[str]:
    """The tools as the run directory records them."""
    return [*tools.functions, *([tools.environment] if tools.environment else [])]


def _parse_tool_calls(tokenizer: PreTrainedTokenizerBase) -> None:
    """Give the tokenizer a response template for its chat template's tool-call format: the
    catalogue's own, one the model ships, or one TRL knows for the model's template."""
    from trl.chat_template_utils import add_response_schema, supports_tool_calling

    name = builtin_template_name(tokenizer.chat_template)
    template = name or "the model's own template"
    refusal = UserInputError(
        "data.chat_template: tool rollouts need a chat template with a tool-call format, and "
        f"{template} has none lmforge or TRL can parse. Fix: set data.chat_template "
        f"to the model family's tool template: {', '.join(TOOL_TEMPLATES)}"
    )
    if name is not None and name not in TOOL_TEMPLATES:
        raise refusal
    if not supports_tool_calling(tokenizer):
        raise refusal
    if name is not None:
        tokenizer.response_template = response_template(name)
    elif getattr(tokenizer, "response_template", None) is None:
        try:
            add_response_schema(tokenizer)
        except ValueError:
            raise refusal from None


def _tool_function(index: int, spec: str, tools: RlToolsConfig) -> Callable[..., Any]:
    key = f"train.rl.tools.functions[{index}]"
    if spec in BUILTIN:
        return BUILTIN[spec]
    function = user_object(key, spec)
    if not inspect.isfunction(function):
        raise UserInputError(f"{key}: {spec} is not a function. Fix: name a `def` in its module")
    _check_schema(key, function)
    log.warning("%s: running your code %s (run_user_code: true)", key, spec)
    return function  # type: ignore[no-any-return]


def _environment_class(spec: str) -> type:
    key = "train.rl.tools.environment"
    environment = user_object(key, spec)
    if not inspect.isclass(environment):
        raise UserInputError(f"{key}: {spec} is not a class. Fix: name the environment class")
    if not callable(getattr(environment, "reset", None)):
        raise UserInputError(
            f"{key}: {spec} has no reset method. Fix: define `reset(self, **row)`, which starts an episode "
            "(it may return text to append to the prompt)"
        )
    for name, method in inspect.getmembers(environment, predicate=inspect.isfunction):
        if not name.startswith("_") and name not in ("reset", "get_reward"):
            _check_schema(f"{key} ({spec}.{name})", method)
    log.warning("%s: running your code %s (run_user_code: true)", key, spec)
    return environment


def _check_schema(key: str, function: Callable[..., Any]) -> None:
    """The tool's JSON schema, as the chat template will ask for it at every prompt: a missing
    docstring or argument description would otherwise stop the run at its first rollout."""
    from transformers.utils import get_json_schema

    try:
        get_json_schema(function)
    except Exception as err:
        raise UserInputError(
            f"{key}: {function.__qualname__} cannot be described to the model: {err}. Fix: give it type "
            "hints and a Google-style docstring with a line per argument under `Args:`"
        ) from None
