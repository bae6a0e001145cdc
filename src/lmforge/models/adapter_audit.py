"""Which weights a LoRA / DoRA / QLoRA run adapts: every requested target must match, and the
audit says what got adapters, group by group, with their trainable parameters.

PEFT warns, at most, when a listed module or parameter matches nothing (and in transformers 5 an
MoE model's experts are no linear layers, so `all-linear` alone leaves them out): the run would
train something other than what was asked, silently. Here a target that matches nothing is a
config error naming the key, and the audit (train.log, the console, adapter_audit.json) lists
what was adapted.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from peft.tuners.lora import LoraLayer

from lmforge.config.schema import LoraConfig
from lmforge.errors import UserInputError

log = logging.getLogger(__name__)
_SHOWN_NAMES = 12  # existing names quoted in an error
_LAYER_INDEX = re.compile(r"\.\d+(?=\.|$)")


def check_targets_exist(model: torch.nn.Module, lora: LoraConfig, target_parameters: list[str]) -> None:
    """Refuse, before PEFT touches the model, a target that names nothing in it (PEFT's own rules:
    a listed module matches its full name or a `.`-suffix, a string is a regex over whole names,
    a parameter matches its full name or a `.`-suffix)."""
    modules = [name for name, _ in model.named_modules() if name]
    if isinstance(lora.target_modules, list):
        missing = [t for t in lora.target_modules if not _any_suffix(modules, t)]
    elif lora.target_modules != "all-linear":
        missing = [] if any(_full_match(lora.target_modules, n) for n in modules) else [lora.target_modules]
    else:
        missing = []
    if missing:
        raise UserInputError(
            f"train.lora.target_modules: {missing} match no module of this model; modules here include "
            f"{_examples(_leaf_module_names(model))}. Fused expert weights are parameters, not modules: "
            f"name them in train.lora.target_parameters ({_examples(_expert_suffixes(model)) or 'none here'})"
        )
    parameters = [name for name, _ in model.named_parameters()]
    missing = [t for t in target_parameters if not _any_suffix(parameters, t)]
    if missing:
        raise UserInputError(
            f"train.lora.target_parameters: {missing} match no parameter of this model; parameters here "
            f"include {_examples(_expert_suffixes(model) + _parameter_suffixes(parameters))}"
        )


def audit_adapters(model: torch.nn.Module) -> dict[str, Any]:
    """Each adapted group (decoder layers folded into `*`): module or parameter, how many, and the
    trainable parameters its adapters hold; weights trained in full (modules_to_save) after them."""
    groups: dict[tuple[str, str], list[int]] = {}
    counted: set[int] = set()
    for name, module in model.named_modules():
        if not _is_lora_layer(module):
            continue
        # A wrapper's base_layer may itself be a wrapper (two parameters of one module): its
        # adapters are counted where it is visited, not again in the outer one.
        own = [p for n, p in module.named_parameters() if "lora_" in n and not n.startswith("base_layer.")]
        counted.update(id(p) for p in own)
        target, kind = _adapted_target(name, module)
        entry = groups.setdefault((kind, _group_name(target)), [0, 0])
        entry[0] += 1
        entry[1] += sum(p.numel() for p in own if p.requires_grad)
    for name, param in model.named_parameters():
        if param.requires_grad and id(param) not in counted:
            entry = groups.setdefault(("full", _group_name(name)), [0, 0])
            entry[0] += 1
            entry[1] += param.numel()
    rows = [
        {"kind": kind, "name": name, "count": count, "trainable_parameters": trainable}
        for (kind, name), (count, trainable) in sorted(groups.items(), key=lambda item: _kind_order(item[0]))
    ]
    return {
        "groups": rows,
        "trainable_parameters": sum(row["trainable_parameters"] for row in rows),
        "total_parameters": sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()),
    }


def check_targets_adapted(audit: dict[str, Any], lora: LoraConfig, target_parameters: list[str]) -> None:
    """After PEFT: every listed name adapted something (PEFT may map a module name onto the parameter
    that replaced it in transformers 5, such as Mixtral's router `gate` -> `gate.weight`)."""
    adapted = [g["name"] for g in audit["groups"] if g["kind"] != "full"]
    owners = [g["name"] for g in audit["groups"] if g["kind"] == "module"]
    owners += [g["name"].rpartition(".")[0] for g in audit["groups"] if g["kind"] == "parameter"]
    listed = lora.target_modules if isinstance(lora.target_modules, list) else []
    for key, names, pool in (
        ("target_modules", listed, owners),
        ("target_parameters", target_parameters, adapted),
    ):
        missing = [t for t in names if not _any_suffix(pool, t, folded=True)]
        if missing:
            raise UserInputError(
                f"train.lora.{key}: PEFT put no adapter on {missing}; adapted here: {_examples(adapted)}. "
                f"Name modules that are linear layers, or parameters in train.lora.target_parameters"
            )


def report_audit(audit: dict[str, Any], request: dict[str, Any], path: Path | None) -> None:
    """Log the audit (train.log and the console) and, with `path`, write it there as JSON."""
    lines = [
        f"  {g['kind']:<9} {g['name']:<48} x{g['count']:<4} {g['trainable_parameters']:>12,}"
        for g in audit["groups"]
    ]
    log.info(
        "adapter audit: %s trainable parameters in %d groups%s\n%s",
        f"{audit['trainable_parameters']:,}",
        len(lines),
        f" (also in {path})" if path is not None else "",
        "\n".join(lines),
    )
    if path is not None:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps({**request, **audit}, indent=2), encoding="utf-8")
        os.replace(tmp, path)


def _full_match(pattern: str, name: str) -> bool:
    try:
        return re.fullmatch(pattern, name) is not None
    except re.error as err:
        raise UserInputError(
            f"train.lora.target_modules: {pattern!r} is neither all-linear nor a valid regular expression "
            f"({err}); give a list of module names such as [q_proj, v_proj]"
        ) from None


def _is_lora_layer(module: torch.nn.Module) -> bool:
    return isinstance(module, LoraLayer)


def _adapted_target(name: str, module: torch.nn.Module) -> tuple[str, str]:
    """(target name, kind): a parameter wrapper names its module (past nested base_layers) and parameter."""
    parameter = getattr(module, "parameter_name", None)
    if parameter is None:
        return name, "module"
    owner = name
    while owner.endswith(".base_layer"):
        owner = owner.removesuffix(".base_layer")
    return f"{owner}.{parameter}", "parameter"


def _group_name(name: str) -> str:
    """PEFT's and the trainer's prefixes off, every layer index as `*`."""
    for prefix in ("base_model.model.", "base_model."):
        name = name.removeprefix(prefix)
    name = name.replace(".modules_to_save.default", "").replace(".original_module", "")
    return _LAYER_INDEX.sub(".*", name)


def _kind_order(key: tuple[str, str]) -> tuple[int, str]:
    return {"module": 0, "parameter": 1, "full": 2}[key[0]], key[1]


def _any_suffix(names: Iterable[str], target: str, *, folded: bool = False) -> bool:
    target = _LAYER_INDEX.sub(".*", target) if folded else target
    return any(n == target or n.endswith(f".{target}") for n in names)


def _leaf_module_names(model: torch.nn.Module) -> list[str]:
    leaves = [name for name, m in model.named_modules() if name and not any(True for _ in m.children())]
    return list(dict.fromkeys(name.rpartition(".")[2] for name in leaves))


def _expert_suffixes(model: torch.nn.Module) -> list[str]:
    names = [".".join(n.split(".")[-2:]) for n, p in model.named_parameters() if p.ndim == 3]
    return list(dict.fromkeys(names))


def _parameter_suffixes(names: list[str]) -> list[str]:
    return list(dict.fromkeys(".".join(n.split(".")[-2:]) for n in names))


def _examples(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN_NAMES])
    return shown + (f", ... ({len(names) - _SHOWN_NAMES} more)" if len(names) > _SHOWN_NAMES else "")
