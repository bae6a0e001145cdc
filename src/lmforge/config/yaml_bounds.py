"""A bound on how large a YAML document becomes once its aliases are expanded.

PyYAML builds an alias as a second reference to the same object, so reading an "alias bomb"
(`a: &a [x, x]`, `b: &b [*a, *a]`, ... nine levels deep) is cheap; everything that walks the
result afterwards (line maps, validation, `config show`, JSON dumps) visits every expanded node and
grows without limit. The expanded size is counted on the node graph, each node once, before any
of that runs; a document past the bound, or one that refers to itself, is refused.
"""

from __future__ import annotations

import yaml

from lmforge.errors import UserInputError

# A real config has a few hundred nodes; a sweep space or accelerate file fewer. A million
# leaves room for long inline lists while refusing a bomb in milliseconds.
MAX_EXPANDED_NODES = 1_000_000


def check_expanded_size(root: yaml.Node | None, source: str) -> None:
    """Raise UserInputError when `root`, with every alias expanded, holds more than
    MAX_EXPANDED_NODES nodes or contains itself (a recursive alias)."""
    sizes: dict[int, int] = {}
    in_progress: set[int] = set()

    def expanded(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in in_progress:
            raise UserInputError(
                f"{source}:{node.start_mark.line + 1}: a YAML alias refers to the node that contains it, "
                "which would expand forever. Fix: write the value out instead of the alias."
            )
        in_progress.add(key)
        total = 1
        if isinstance(node, yaml.SequenceNode):
            total += sum(expanded(item) for item in node.value)
        elif isinstance(node, yaml.MappingNode):
            total += sum(expanded(k) + expanded(v) for k, v in node.value)
        in_progress.discard(key)
        if total > MAX_EXPANDED_NODES:
            raise UserInputError(
                f"{source}:{node.start_mark.line + 1}: this YAML value expands to more than "
                f"{MAX_EXPANDED_NODES:,} nodes once its aliases (*name) are resolved (an 'alias bomb'); "
                "lmforge refuses it instead of running out of memory. Fix: use fewer nested aliases, "
                "or write the values out."
            )
        sizes[key] = total
        return total

    if root is not None:
        expanded(root)


def load_yaml_bounded(
    text: str, source: str, loader_class: type[yaml.SafeLoader] = yaml.SafeLoader
) -> object:
    """`yaml.safe_load(text)` that refuses alias bombs and recursive aliases first (see the module
    docstring). `source` names the file in messages. yaml.YAMLError passes through to the caller."""
    loader = loader_class(text)
    try:
        node = loader.get_single_node()
        check_expanded_size(node, source)
        return loader.construct_document(node) if node is not None else None
    finally:
        loader.dispose()
