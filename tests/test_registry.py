"""`lmforge push` and `lmforge registry list|show` on two real tiny runs (a pretraining run with an
eval and a verified safetensors export, and a LoRA run on top of it): a local registry and an MLflow
file store read back with MLflow's own client, the model card through huggingface_hub, and no
token or secret in any pushed file. The Hub is only reached as far as a closed port."""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from lmforge.ckpt.atomic import MANIFEST_NAME, MARKER_NAME, check_checkpoint, seal_directory, sha256_file
from lmforge.cli.push import split_version
from lmforge.config import load_config
from lmforge.errors import UserInputError, WorkFailed
from lmforge.export.integrity import check_integrity
from lmforge.registry import list_models, push_run, show_version
from lmforge.registry.targets import HubTarget, LocalTarget, MlflowTarget, parse_target, safe_uri
from lmforge.train.runner import run_training
from tests.conftest import SMALL_ARCH, run_cli

HOOK_SECRET = "https://hooks.example.com/services/T0/B0/hooksecret4242"
HF_SECRET = "hf_fake_secret_123"


def _config(root: Path, corpus: Path, name: str, **sections: dict) -> dict:
    return {
        "run": {"name": name, "output_dir": str(root / "runs"), "seed": 0},
        "data": {
            "train": [{"path": str(corpus)}],
            "max_length": 64,
            "eval_fraction": 0.1,
            "cache_dir": str(root / "cache"),
        },
        "train": {
            "micro_batch_size": 4,
            "lr": 3e-3,
            "precision": "fp32",
            "log_every": 1,
            **sections.pop("train"),
        },
        "monitor": {"loggers": [], "system_metrics_seconds": None, **sections.pop("monitor", {})},
        **sections,
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> dict[str, Path]:
    """`pre`: 6 pretraining steps with evals and a verified safetensors export; `lora`: a LoRA
    adapter trained on pre/final. Then pre's records are made to hold secrets, as a hand-edited
    config.yaml or an older lmforge's manifest could: the push must keep them out on its own."""
    root = tmp_path_factory.mktemp("registry-runs")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LMFORGE_CACHE", str(root / "cache"))
        pre = _config(
            root,
            corpus,
            "pre",
            model={"preset": "llama-tiny", "config": SMALL_ARCH},
            tokenizer={"train": {"vocab_size": 300}},
            train={"max_steps": 6, "eval_every": 3},
            monitor={"alerts": {"webhook_url": HOOK_SECRET, "kinds": ["nonfinite"]}},
            export={"formats": ["safetensors"]},
        )
        run_training(load_config(None, base=pre))
        lora = _config(
            root,
            corpus,
            "lora",
            model={"path": str(root / "runs" / "pre" / "final")},
            train={"method": "lora", "max_steps": 4, "eval_every": 2},
        )
        run_training(load_config(None, base=lora))
    pre_dir = root / "runs" / "pre"
    config = pre_dir / "config.yaml"
    assert "***REDACTED***" in config.read_text()  # training redacted it; put it back
    config.write_text(config.read_text().replace("'***REDACTED***'", f"'{HOOK_SECRET}'"))
    manifest = json.loads((pre_dir / "manifest.json").read_text())
    manifest["command"] = f"lmforge train pre.yaml hub_token={HF_SECRET}"
    (pre_dir / "manifest.json").write_text(json.dumps(manifest))
    return {"pre": pre_dir, "lora": root / "runs" / "lora"}


@pytest.fixture(autouse=True)
def _secrets_in_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_TOKEN", HF_SECRET)
    monkeypatch.chdir(tmp_path)  # MLflow must leave nothing (no ./mlflow.db) in the working directory


def _manifest(run: Path) -> dict:
    return json.loads((run / "manifest.json").read_text())


def _assert_no_secret_under(*roots: Path) -> int:
    checked = 0
    for root in roots:
        for path in (p for p in root.rglob("*") if p.is_file()):
            data = path.read_bytes()
            for secret in (HOOK_SECRET, HF_SECRET, "hooksecret4242"):
                assert secret.encode() not in data, f"{secret} in {path}"
            checked += 1
    return checked


def test_push_local_versions_lineage_and_model_card(runs: dict[str, Path], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    registry = tmp_path / "registry"
    first = push_run(runs["pre"], str(registry))
    second = push_run(runs["pre"], str(registry))
    assert (first.name, first.version, second.version) == ("pre", "1", "2")
    version = registry / "pre" / "2"
    assert check_checkpoint(version).complete  # sealed: hash manifest and completion marker
    assert not [p for p in (registry / "pre").iterdir() if p.name.startswith(".staging")]

    lineage = json.loads((version / "lineage.json").read_text())
    manifest = _manifest(runs["pre"])
    assert lineage["lmforge"]["git"] == manifest["git"] and lineage["lmforge"]["trained_with"] == "0.1.0"
    assert lineage["data"]["fingerprint"] == manifest["data_fingerprint"]
    assert lineage["tokenizer"]["fingerprint"] == manifest["tokenizer_fingerprint"]
    assert lineage["data"]["train_sources"][0]["path"].endswith("text.jsonl")
    assert lineage["base_model"] is None and lineage["model"]["library"] == "transformers"
    assert lineage["training"]["steps"] == 6 and lineage["training"]["status"] == "finished"
    assert (
        lineage["evaluation"]["best"]["metric"] == "eval_loss" and lineage["evaluation"]["best"]["step"] == 6
    )
    assert lineage["exports"]["safetensors"]["passed"] is True
    assert "model.safetensors" in lineage["exports"]["safetensors"]["files"]
    assert lineage["config"]["monitor"]["alerts"]["webhook_url"] == "***REDACTED***"
    for name, entry in lineage["model"]["files"].items():
        assert sha256_file(version / name) == entry["sha256"], name
    assert "lmforge_finished.json" not in lineage["model"]["files"]
    assert "lmforge_manifest.json" not in lineage["model"]["files"] and lineage["model"]["sealed"] is True

    card = ModelCard.load(version / "README.md")
    assert card.data.library_name == "transformers" and "lmforge" in card.data.tags
    assert card.data.to_dict()["lmforge"]["data_fingerprint"] == manifest["data_fingerprint"]
    assert manifest["data_fingerprint"] in card.text and "## Evaluation" in card.text
    assert f"from_pretrained('{version.resolve()}')" in card.text
    AutoModelForCausalLM.from_pretrained(version)  # the pushed folder is a loadable HF model

    [row] = list_models(str(registry))
    assert row.versions == ["1", "2"] and row.metric == "eval_loss"
    info = show_version(str(registry), "pre", verify=True)
    assert info.version == "2" and info.integrity.startswith("ok")
    assert show_version(str(registry), "pre", "1").lineage["name"] == "pre"


def test_adapter_push_records_its_base_and_loads_with_peft(runs: dict[str, Path], tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    result = push_run(runs["lora"], str(tmp_path / "registry"), name="tiny-lora")
    version = Path(result.location)
    assert (version / "adapter_config.json").is_file() and not (version / "config.json").exists()
    lineage = json.loads((version / "lineage.json").read_text())
    base = lineage["base_model"]
    assert base["relation"] == "adapter base" and base["name_or_path"] == str(runs["pre"] / "final")
    assert base["run"]["data_fingerprint"] == _manifest(runs["pre"])["data_fingerprint"]
    assert lineage["model"]["library"] == "peft" and lineage["training"]["method"] == "lora"
    card = ModelCard.load(version / "README.md")
    assert card.data.library_name == "peft" and "PeftModel.from_pretrained" in card.text
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base["name_or_path"]), version)


def test_push_to_mlflow_file_store_read_back_with_mlflow_client(
    runs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri = (tmp_path / "mlruns").as_uri()
    first = push_run(runs["pre"], f"mlflow:{uri}")
    again = push_run(runs["pre"], f"mlflow:{uri}")
    # A plain path names a file store too.
    adapter = push_run(runs["lora"], f"mlflow:{tmp_path / 'mlruns'}", name="tiny-lora")
    assert (first.version, again.version, adapter.version) == ("1", "2", "1")
    assert first.location == "models:/pre/1"
    assert not (tmp_path / "mlflow.db").exists()

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    model_version = client.get_model_version("pre", "2")
    fingerprint = _manifest(runs["pre"])["data_fingerprint"]
    assert model_version.tags["lmforge.data_fingerprint"] == fingerprint
    assert model_version.source.endswith("/model") and model_version.run_id
    mlflow_run = client.get_run(model_version.run_id)
    assert mlflow_run.data.params["train.lr"] == "0.003"
    assert "best_eval_loss" in mlflow_run.data.metrics and mlflow_run.info.status == "FINISHED"
    folder = Path(client.download_artifacts(model_version.run_id, "model", str(tmp_path / "download")))
    lineage = json.loads((folder / "lineage.json").read_text())
    assert lineage["data"]["fingerprint"] == fingerprint and lineage["push"]["registry"] == "mlflow"
    assert (
        sha256_file(folder / "model.safetensors") == lineage["model"]["files"]["model.safetensors"]["sha256"]
    )
    card = ModelCard.load(folder / "README.md")
    assert fingerprint in card.text and f"runs:/{model_version.run_id}/model" in card.text
    adapter_version = client.get_model_version("tiny-lora", "1")
    assert adapter_version.tags["lmforge.base_model"] == str(runs["pre"] / "final")

    rows = {row.name: row for row in list_models(f"mlflow:{uri}")}
    assert rows["pre"].versions == ["1", "2"] and rows["pre"].metric == "eval_loss"
    info = show_version(f"mlflow:{uri}", "tiny-lora")
    assert info.lineage["base_model"]["relation"] == "adapter base" and info.integrity == "READY"


def test_no_token_or_secret_in_any_pushed_file(runs: dict[str, Path], tmp_path: Path) -> None:
    assert HOOK_SECRET in (runs["pre"] / "config.yaml").read_text()  # the run's records hold both
    assert HF_SECRET in (runs["pre"] / "manifest.json").read_text()
    push_run(runs["pre"], str(tmp_path / "registry"))
    push_run(runs["pre"], f"mlflow:{(tmp_path / 'mlruns').as_uri()}")
    # A fresh process knows no config's secret values: redaction by key name and by environment.
    result = run_cli("push", str(runs["pre"]), "--to", str(tmp_path / "cli-registry"), "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout)["version"] == "1"
    lineage = json.loads((tmp_path / "cli-registry" / "pre" / "1" / "lineage.json").read_text())
    assert "***REDACTED***" in lineage["environment"]["command"]
    assert _assert_no_secret_under(tmp_path / "registry", tmp_path / "mlruns", tmp_path / "cli-registry") > 20


def test_a_secret_inside_the_model_stops_the_push(runs: dict[str, Path], tmp_path: Path) -> None:
    run = shutil.copytree(runs["pre"], tmp_path / "leaky")
    tokenizer_config = run / "final" / "tokenizer_config.json"
    tokenizer_config.write_text(
        tokenizer_config.read_text().replace("{", '{"note": "' + HF_SECRET + '", ', 1)
    )
    _reseal(run / "final")  # as if training itself had written the secret there
    registry = tmp_path / "registry"
    with pytest.raises(WorkFailed, match="tokenizer_config.json would carry the value of a secret") as err:
        push_run(run, str(registry))
    assert HF_SECRET not in str(err.value)
    assert [p.name for p in (registry / "pre").iterdir()] == [".lock"]  # no version, no staging left
    with pytest.raises(WorkFailed, match="would carry the value of a secret"):
        push_run(run, f"mlflow:{tmp_path / 'mlruns'}")
    assert list_models(f"mlflow:{tmp_path / 'mlruns'}") == []


def test_interrupted_push_leaves_no_version_and_pushes_do_not_share_numbers(
    runs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = tmp_path / "registry"

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr("lmforge.registry.local.commit_checkpoint", interrupted)
        with pytest.raises(KeyboardInterrupt):
            push_run(runs["pre"], str(registry))
    assert [p.name for p in (registry / "pre").iterdir()] == [".lock"]
    with ThreadPoolExecutor(3) as pool:
        versions = sorted(
            r.version for r in pool.map(lambda _: push_run(runs["pre"], str(registry)), range(3))
        )
    assert versions == ["1", "2", "3"]


def test_hub_push_uploads_the_staged_folder_with_the_token_in_memory_only(
    runs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Hub's client is replaced at its two calls; everything up to them is the real push."""
    from types import SimpleNamespace

    from huggingface_hub import HfApi

    calls: dict[str, object] = {}

    def create_repo(self: HfApi, repo_id: str, **kwargs: object) -> None:
        calls.update(token=self.token, repo_id=repo_id, private=kwargs.get("private"))

    def upload_folder(
        self: HfApi, *, repo_id: str, folder_path: Path, commit_message: str
    ) -> SimpleNamespace:
        shutil.copytree(folder_path, tmp_path / "uploaded")
        calls["message"] = commit_message
        return SimpleNamespace(oid="abc123", commit_url=f"https://huggingface.co/{repo_id}/commit/abc123")

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    result = push_run(runs["lora"], "hf://someone/tiny-lora")
    assert (result.name, result.version) == ("someone/tiny-lora", "abc123")
    assert (
        calls["token"] == HF_SECRET and calls["private"] is True and calls["repo_id"] == "someone/tiny-lora"
    )
    uploaded = tmp_path / "uploaded"
    assert {"README.md", "lineage.json", "adapter_config.json", "adapter_model.safetensors"} <= {
        p.name for p in uploaded.iterdir()
    }
    card = ModelCard.load(uploaded / "README.md")
    assert (
        card.data.library_name == "peft"
        and "PeftModel.from_pretrained(base, 'someone/tiny-lora')" in card.text
    )
    assert json.loads((uploaded / "lineage.json").read_text())["push"] == {
        "registry": "hub",
        "repo_id": "someone/tiny-lora",
    }
    _assert_no_secret_under(uploaded)


def test_unfinished_or_foreign_directories_are_refused(runs: dict[str, Path], tmp_path: Path) -> None:
    run = shutil.copytree(runs["pre"], tmp_path / "unfinished")
    shutil.rmtree(run / "final")
    with pytest.raises(UserInputError, match="no complete final/"):
        push_run(run, str(tmp_path / "registry"))
    with pytest.raises(UserInputError, match="not a run directory"):
        push_run(tmp_path, str(tmp_path / "registry"))
    with pytest.raises(UserInputError, match="inside or around the run directory"):
        push_run(runs["pre"], str(runs["pre"].parent))
    assert not (tmp_path / "registry").exists()


def test_targets_are_parsed_and_credentials_never_shown(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert parse_target("registry/") == LocalTarget(Path("registry/"))
    assert parse_target("hf://owner/tiny-model.v2") == HubTarget("owner/tiny-model.v2")
    # A plain directory is a local MLflow registry: SQLite inside it (MLflow 3's file store is
    # deprecated and needs MLFLOW_ALLOW_FILE_STORE to be read back) ...
    assert parse_target("mlflow:./mlruns") == MlflowTarget(f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}")
    assert parse_target("mlflow:./mlruns").artifact_location == (tmp_path / "mlruns" / "artifacts").as_uri()
    # ... unless it already holds a file store that an earlier push wrote.
    (tmp_path / "old" / "0").mkdir(parents=True)
    (tmp_path / "old" / "0" / "meta.yaml").write_text("name: Default\n")
    assert parse_target("mlflow:./old") == MlflowTarget((tmp_path / "old").as_uri())
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert parse_target("mlflow:") == MlflowTarget("http://127.0.0.1:5000")
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    for text, message in [
        ("mlflow:", "MLFLOW_TRACKING_URI is not set"),
        ("s3://bucket/models", "unknown target scheme 's3'"),
        ("hf://just-a-name", "not a Hub repository id"),
        ("hf://owner/../x", "not a Hub repository id"),
    ]:
        with pytest.raises(UserInputError, match=message):
            parse_target(text)
    secret_uri = "https://alice:pw-secret-999@mlflow.example.com/path?token=abc123456"
    assert safe_uri(secret_uri) == "https://mlflow.example.com/path"
    assert "pw-secret" not in MlflowTarget(secret_uri).display
    assert split_version("tiny:3") == ("tiny", "3") and split_version("tiny") == ("tiny", None)
    assert split_version("tiny:latest") == ("tiny", None)


def test_cli_push_registry_and_hub_errors(runs: dict[str, Path], tmp_path: Path) -> None:
    registry = tmp_path / "registry"
    pushed = run_cli("push", str(runs["lora"]), "--to", str(registry), "--name", "tiny-lora")
    assert pushed.returncode == 0, pushed.stderr[-3000:]
    assert "pushed tiny-lora version 1" in pushed.stdout
    listed = run_cli("registry", "list", "--registry", str(registry), "--json")
    assert listed.returncode == 0, listed.stderr[-3000:]
    assert [(r["name"], r["versions"]) for r in json.loads(listed.stdout)] == [("tiny-lora", ["1"])]
    shown = run_cli("registry", "show", "tiny-lora:1", "--registry", str(registry))
    assert shown.returncode == 0 and "adapter base" in shown.stdout and "eval_loss" in shown.stdout
    missing = run_cli("registry", "show", "nope", "--registry", str(registry))
    assert missing.returncode == 2 and "no model named 'nope'" in missing.stderr
    # The positional NAME[:VERSION] is named as such, not as push's --name.
    bad_name = run_cli("registry", "show", "tiny-lora:v1", "--registry", str(registry))
    assert bad_name.returncode == 2 and "--name" not in bad_name.stderr, bad_name.stderr
    assert "NAME[:VERSION] 'tiny-lora:v1'" in bad_name.stderr and "tiny-chat:2" in bad_name.stderr
    # A registry version whose weights changed after the push: --verify names the file, exit code 1.
    weights = registry / "tiny-lora" / "1" / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    tampered = run_cli("registry", "show", "tiny-lora:1", "--registry", str(registry), "--verify")
    assert tampered.returncode == 1 and "Traceback" not in tampered.stderr
    assert "hash mismatch in adapter_model.safetensors" in tampered.stdout + tampered.stderr
    assert "tiny-lora:1" in tampered.stderr

    env = {"HOME": str(tmp_path / "home"), "HF_HOME": str(tmp_path / "hf"), "TMPDIR": str(tmp_path / "tmp")}
    for path in env.values():
        Path(path).mkdir()
    no_token = {
        **{k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")},
        **env,
    }
    refused = _run_cli_with_exact_env(["push", str(runs["pre"]), "--to", "hf://owner/tiny"], no_token)
    assert refused.returncode == 2 and "HF_TOKEN" in refused.stderr and "Traceback" not in refused.stderr
    unreachable = run_cli(
        "push", str(runs["pre"]), "--to", "hf://owner/tiny",
        env={**env, "HF_TOKEN": HF_SECRET, "HF_ENDPOINT": "http://127.0.0.1:9"},
    )  # fmt: skip
    assert unreachable.returncode == 1 and "cannot reach the Hub" in unreachable.stderr
    assert "Traceback" not in unreachable.stderr and HF_SECRET not in unreachable.stdout + unreachable.stderr
    mlflow_down = run_cli(
        "push", str(runs["pre"]), "--to", "mlflow:http://alice:pw-secret-999@127.0.0.1:9",
        env={"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"},
    )  # fmt: skip
    assert mlflow_down.returncode == 1 and "mlflow:http://127.0.0.1:9" in mlflow_down.stderr
    assert (
        "pw-secret-999" not in mlflow_down.stdout + mlflow_down.stderr
        and "Traceback" not in mlflow_down.stderr
    )
    unknown = run_cli("push", str(runs["pre"]), "--to", "s3://bucket/x")
    assert unknown.returncode == 2 and "unknown target scheme" in unknown.stderr
    _assert_no_secret_under(tmp_path)


def _run_cli_with_exact_env(args: list[str], env: dict[str, str]):  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "lmforge.cli.main", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_missing_registries_and_the_hub_are_usage_errors_for_list(tmp_path: Path) -> None:
    with pytest.raises(UserInputError, match="no such directory"):
        list_models(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    assert list_models(str(tmp_path / "empty")) == []
    with pytest.raises(UserInputError, match="the Hub is browsed at"):
        list_models("hf://owner/name")


def _reseal(final: Path) -> None:
    """Seal final/ again after editing it, as training would have sealed it had it written the edit."""
    (final / MARKER_NAME).unlink()
    seal_directory(final, step=json.loads((final / "lmforge_finished.json").read_text())["step"])


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


def test_training_seals_final_and_push_refuses_an_edited_final(runs: dict[str, Path], tmp_path: Path) -> None:
    """Issue 33 item 14: a final/ changed after training is never pushed as the trained model."""
    for run in ("pre", "lora"):
        final = runs[run] / "final"
        assert check_checkpoint(final).complete, run  # sealed: manifest of every file and marker
        assert check_integrity(final)["checked"].startswith("hash manifest")  # `ckpt verify` uses it
    sealed = json.loads((runs["lora"] / "final" / MANIFEST_NAME).read_text())["files"]
    assert {"adapter/adapter_model.safetensors", "adapter/adapter_config.json"} <= set(sealed)
    assert "lmforge_finished.json" in sealed

    registry = tmp_path / "registry"
    edits = {  # what was changed -> the file the refusal must name
        "config.json": lambda final: (final / "config.json").write_text(
            (final / "config.json").read_text().replace('"rms_norm_eps"', '"rms_norm_eps_"')
        ),
        "model.safetensors": lambda final: _flip_last_byte(final / "model.safetensors"),  # same size
        "lmforge_finished.json": lambda final: (final / "lmforge_finished.json").write_text(
            '{"step": 600, "parameters": 1}'
        ),
        "extra.safetensors": lambda final: shutil.copy(
            final / "model.safetensors", final / "extra.safetensors"
        ),
        "tokenizer.json": lambda final: (final / "tokenizer.json").unlink(),
    }
    for index, (name, edit) in enumerate(edits.items()):
        run = shutil.copytree(runs["pre"], tmp_path / f"edited-{index}")
        edit(run / "final")
        with pytest.raises(WorkFailed, match=f"final/{name}: .*nothing was pushed"):
            push_run(run, str(registry))
        with pytest.raises(WorkFailed, match=name):
            push_run(run, f"mlflow:{tmp_path / 'mlflow'}")
        assert check_integrity(run / "final")["status"] == "failed", name
    assert not (registry / "pre").exists() or [p.name for p in (registry / "pre").iterdir()] == [".lock"]

    # The CLI: exit code 1, the file named, no traceback.
    edited = tmp_path / "edited-0"
    refused = run_cli("push", str(edited), "--to", str(registry))
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    assert f"{edited / 'final' / 'config.json'}: hash mismatch" in refused.stderr

    # A final/ with no seal at all (an older lmforge): refused unless --allow-unsealed, then recorded.
    old = shutil.copytree(runs["lora"], tmp_path / "old-lora")
    (old / "final" / MANIFEST_NAME).unlink()
    (old / "final" / MARKER_NAME).unlink()
    with pytest.raises(UserInputError, match="no hash manifest .*--allow-unsealed"):
        push_run(old, str(registry))
    result = push_run(old, str(registry), allow_unsealed=True)
    info = show_version(str(registry), "lora", result.version, verify=True)
    assert info.lineage["model"]["sealed"] is False and info.intact
    from lmforge.registry import summary_rows

    assert ("trained files", "UNCHECKED: final/ had no hash manifest (pushed with --allow-unsealed)") in (
        summary_rows(info)
    )


def test_local_mlflow_registry_is_sqlite_and_reads_back_without_file_store_flag(
    runs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    target = f"mlflow:{tmp_path / 'mlflow'}"
    with pytest.raises(UserInputError, match="no MLflow database at"):
        list_models(target)  # reading creates nothing
    assert not (tmp_path / "mlflow").exists()
    first = push_run(runs["pre"], target)
    assert (first.version, first.location) == ("1", "models:/pre/1")
    database = tmp_path / "mlflow" / "mlflow.db"
    assert database.is_file() and not (tmp_path / "mlruns").exists() and not (tmp_path / "mlflow.db").exists()

    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{database}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)  # MLflow's own client, no flag set
    version = client.get_model_version("pre", "1")
    assert version.source.startswith((tmp_path / "mlflow" / "artifacts").as_uri())
    folder = Path(client.download_artifacts(version.run_id, "model", str(tmp_path / "download")))
    lineage = json.loads((folder / "lineage.json").read_text())
    assert (
        sha256_file(folder / "model.safetensors") == lineage["model"]["files"]["model.safetensors"]["sha256"]
    )

    [row] = list_models(target)
    assert row.name == "pre" and row.versions == ["1"]
    # The process's own tracking URI is left as it was: set stays set, unset stays unset (the
    # commands a run starts afterwards inherit the environment).
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "elsewhere").as_uri())
    list_models(target)
    assert os.environ["MLFLOW_TRACKING_URI"] == (tmp_path / "elsewhere").as_uri()
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    list_models(target)
    assert "MLFLOW_TRACKING_URI" not in os.environ
    info = show_version(target, "pre", verify=True)
    assert info.intact and info.integrity.startswith("ok")
    # Weights changed in the artifact store after the push: --verify says which file, exit code 1.
    [stored] = (tmp_path / "mlflow" / "artifacts").rglob("model/model.safetensors")
    _flip_last_byte(stored)
    info = show_version(target, "pre", verify=True)
    assert not info.intact and info.integrity == "hash mismatch in model.safetensors"
    shown = run_cli("registry", "show", "pre:1", "--registry", target, "--verify", cwd=tmp_path)
    assert shown.returncode == 1 and "hash mismatch in model.safetensors" in shown.stderr, shown.stderr[
        -2000:
    ]
    assert "Traceback" not in shown.stderr
