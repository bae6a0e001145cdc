"""The upstream-coupling registry holds for the pinned libraries, and notices when it would not."""

from __future__ import annotations

import inspect
from importlib import metadata

import pytest
from transformers import Trainer

from lmforge import upstream
from lmforge.train.hf_trainer import HFTrainerAdapter


@pytest.mark.parametrize("entry", upstream.REGISTRY, ids=lambda e: e.target.split(":")[-1])
def test_each_coupling_still_holds_upstream(entry: upstream.Coupling) -> None:
    assert upstream.coupling_problem(entry) is None


def test_every_trainer_method_lmforge_overrides_is_registered() -> None:
    registered = {e.target.rsplit(".", 1)[-1] for e in upstream.REGISTRY if e.kind == "override"}
    for mixin in (HFTrainerAdapter,):
        overridden = {
            name
            for name, value in vars(mixin).items()
            if inspect.isfunction(value) and hasattr(Trainer, name)
        }
        assert overridden <= registered, (
            f"{mixin.__name__} overrides {overridden - registered} without an entry"
        )


def test_a_changed_signature_is_reported() -> None:
    stale = upstream.Coupling(
        "transformers.trainer:Trainer._get_grad_norm", "override", "x", "y", ("self", "model")
    )
    assert "now takes" in (upstream.coupling_problem(stale) or "")
    gone = upstream.Coupling("transformers.trainer:Trainer._no_such_hook", "override", "x", "y", ("self",))
    assert "is gone" in (upstream.coupling_problem(gone) or "")


def test_versions_in_range_are_quiet_and_out_of_range_warn(monkeypatch: pytest.MonkeyPatch) -> None:
    assert upstream.check_upstream_versions() == []
    real = metadata.version
    monkeypatch.setattr(
        upstream.metadata, "version", lambda name: "6.0.0" if name == "transformers" else real(name)
    )
    warnings = upstream.check_upstream_versions()
    assert len(warnings) == 1 and warnings[0].startswith("transformers 6.0.0 is outside")
