"""Every place lmforge touches an upstream internal or patches an upstream object is registered in
lmforge/upstream.py: an AST scan of src/lmforge (tests/upstream_scan.py) finds them, and the scan
is shown to catch each form of access on planted snippets."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

import lmforge
from lmforge import upstream
from tests.upstream_scan import Finding, read_package, scan_sources, unregistered

PACKAGE = Path(lmforge.__file__).parent


@pytest.fixture(scope="module")
def findings() -> list[Finding]:
    return scan_sources(read_package(PACKAGE))


def test_every_upstream_touch_is_registered(findings: list[Finding]) -> None:
    missing = unregistered(findings, [entry.target for entry in upstream.REGISTRY])
    assert not missing, (
        "register these in lmforge/upstream.py (target, kind, where, why), or stop touching upstream "
        "internals:\n" + "\n".join(map(str, missing))
    )


def test_the_known_couplings_are_found(findings: list[Finding]) -> None:
    """The couplings issue 34 listed as unregistered: the scan sees each of them."""
    found = {(f.path.rsplit("/", 1)[-1], f.name) for f in findings}
    for expected in (
        ("memory_savers.py", "forward"),
        ("memory_savers.py", "loss_function"),
        ("memory_savers.py", "_loss_function"),
        ("memory_savers.py", "final_logit_softcapping"),
        ("rl_samples.py", "_logs"),
        ("run.py", "_trial_id"),
        ("devices.py", "_is_avx512_bf16_supported"),
        ("devices.py", "_is_amx_tile_supported"),
        ("chunked_loss.py", "_forward_hooks"),
        ("context_parallel.py", "_op_dispatcher"),
        ("upstream.py", "propagate"),
    ):
        assert expected in found, expected


def _scan(source: str) -> list[Finding]:
    return scan_sources({"planted.py": textwrap.dedent(source)})


PLANTED = {
    "from-import of a private name": (
        "from torch.cpu import _is_amx_tile_supported\n",
        "_is_amx_tile_supported",
    ),
    "private module import": (
        "import torch.distributed.tensor.experimental._context_parallel._attention as ring\n",
        "_context_parallel",
    ),
    "private module by import_module": (
        "import importlib\nimportlib.import_module('torch._dynamo')\n",
        "_dynamo",
    ),
    "module attribute": (
        "import torch\ntorch.cpu._is_avx512_bf16_supported()\n",
        "_is_avx512_bf16_supported",
    ),
    "aliased module attribute": ("import torch.distributed as dist\ndist._world\n", "_world"),
    "local bound to an upstream chain": (
        "import torch\naten = torch.ops.aten\naten._scaled_dot_product_flash_attention_for_cpu\n",
        "_scaled_dot_product_flash_attention_for_cpu",
    ),
    "class attribute": ("from transformers import Trainer\nTrainer._get_grad_norm\n", "_get_grad_norm"),
    "getattr with a literal": ("def f(trainer):\n    return getattr(trainer, '_logs', None)\n", "_logs"),
    "getattr with a folded constant": (
        "def f(trainer):\n    return getattr(trainer, '_' + 'logs')\n",
        "_logs",
    ),
    "hasattr with a literal": ("def f(module):\n    return hasattr(module, '_hf_hook')\n", "_hf_hook"),
    "private attribute of an unknown receiver": ("def f(trial):\n    return trial._trial_id\n", "_trial_id"),
    "private attribute behind a decoy declaration": (
        """
        from trl import GRPOTrainer
        class Decoy:
            _logs = None
        def f(trainer):
            return trainer._logs
        """,
        "_logs",
    ),
    "self._name in an upstream subclass": (
        """
        from transformers import Trainer
        class T(Trainer):
            def f(self):
                return self._tr_loss
        """,
        "_tr_loss",
    ),
    "self._name set in a mixin of an upstream subclass": (
        """
        from transformers import Trainer
        class Hooks:
            def f(self):
                self._tr_loss = 0
        class T(Hooks, Trainer):
            pass
        """,
        "_tr_loss",
    ),
    "private method override": (
        """
        from transformers import Trainer
        class T(Trainer):
            def _get_grad_norm(self, model, grad_norm=None):
                return grad_norm
        """,
        "_get_grad_norm",
    ),
    "public upstream attribute set on self": (
        """
        from transformers import Trainer
        class T(Trainer):
            def create_accelerator_and_postprocess(self):
                self.is_fsdp_enabled = True
        """,
        "is_fsdp_enabled",
    ),
    "module patch": ("import torch\ntorch.load = print\n", "load"),
    "class patch": ("from transformers import Trainer\nTrainer.log = print\n", "log"),
    "setattr patch": ("import torch\nsetattr(torch, 'load', print)\n", "load"),
    "delattr of a private attribute": ("def f(lm):\n    delattr(lm, '_loss_function')\n", "_loss_function"),
    "instance method patch": ("def f(head):\n    head.forward = print\n", "forward"),
    "instance patch by del": ("def f(lm):\n    del lm._loss_function\n", "_loss_function"),
    "config attribute": (
        "def f(lm):\n    lm.config.final_logit_softcapping = None\n",
        "final_logit_softcapping",
    ),
    "attribute put on a trainer": ("def f(trainer, step):\n    trainer.train_step = step\n", "train_step"),
    "augmented assignment": (
        "def f(state, n):\n    state.num_input_tokens_seen += n\n",
        "num_input_tokens_seen",
    ),
    "annotated upstream receiver": (
        "from transformers import TrainerControl\ndef f(control: TrainerControl):\n    control.should_save = True\n",
        "should_save",
    ),
    "item written into an upstream table": (
        """
        from torch.distributed.tensor.experimental._context_parallel import _attention as ring
        ring.custom_ops[1] = print
        """,
        "custom_ops",
    ),
}


@pytest.mark.parametrize("case", PLANTED, ids=list(PLANTED))
def test_the_scan_catches_each_form(case: str) -> None:
    source, name = PLANTED[case]
    found = _scan(source)
    assert name in {f.name for f in found}, f"{case}: {found}"
    assert unregistered(found, []), "an empty registry covers nothing"


def test_lmforge_s_own_attributes_are_not_findings() -> None:
    found = _scan(
        """
        import os
        from dataclasses import dataclass
        @dataclass
        class Step:
            rank: int = 0
            _private: int = 0
        class Plain:
            def __init__(self):
                self._count = 0
            def bump(self):
                self._count += 1
        def f(step: Step, other):
            step.rank = 1
            other._private = 2
            os._exit(0)
        """
    )
    assert not found, found


def test_a_registered_target_covers_its_findings() -> None:
    found = _scan("import torch\ntorch.cpu._is_amx_tile_supported()\n")
    assert not unregistered(found, ["torch.cpu:_is_amx_tile_supported"])
    # The package must agree when the receiver is an import: a transformers entry does not cover torch.
    assert unregistered(found, ["transformers.x:_is_amx_tile_supported"])
