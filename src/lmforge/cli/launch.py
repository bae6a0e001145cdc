"""`lmforge launch`: distributed `lmforge train` through torchrun or deepspeed (or an sbatch script)."""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from lmforge.cli.console import VERBOSE_HELP, apply_verbosity
from lmforge.config import LmforgeConfig
from lmforge.config.redact import redact_text
from lmforge.errors import UserInputError

if TYPE_CHECKING:
    from lmforge.distributed.launch import LaunchPlan, LaunchRequest


def launch(
    config: Path = typer.Argument(..., help="The run's YAML config."),
    overrides: list[str] | None = typer.Argument(
        None, help="Dotted key=value overrides passed to every worker (train.lr=1e-4).", show_default=False
    ),
    nproc_per_node: int = typer.Option(
        None,
        "--nproc-per-node",
        help="Worker processes per node [default: number of CUDA GPUs, else 1].",
        show_default=False,
    ),
    nnodes: str = typer.Option(
        None,
        "--nnodes",
        help="Number of nodes, or an elastic range MIN:MAX (1:4) [default: 1; deepspeed: the hostfile's hosts].",
        show_default=False,
    ),
    node_rank: int = typer.Option(
        None, "--node-rank", help="This node's rank, 0 on the master [default: 0].", show_default=False
    ),
    master_addr: str = typer.Option(
        None,
        "--master-addr",
        help="Address of the node with rank 0 [default: 127.0.0.1; deepspeed: the hostfile's first host].",
        show_default=False,
    ),
    master_port: int = typer.Option(
        None,
        "--master-port",
        help="A free port on the master node [default: one node: a free port (torchrun's --standalone "
        "rendezvous); several nodes: 29500].",
        show_default=False,
    ),
    backend: str = typer.Option("torchrun", "--backend", help="Launcher: torchrun, deepspeed or accelerate."),
    max_restarts: int = typer.Option(
        0, "--max-restarts", help="Elastic: restart the worker group up to K times (uses c10d rendezvous)."
    ),
    rdzv_backend: str = typer.Option(
        None,
        "--rdzv-backend",
        help="Rendezvous: c10d (elastic) or static [default: c10d with an --nnodes range or --max-restarts].",
        show_default=False,
    ),
    rdzv_endpoint: str = typer.Option(
        None,
        "--rdzv-endpoint",
        help="c10d rendezvous HOST:PORT [default: MASTER_ADDR:MASTER_PORT].",
        show_default=False,
    ),
    rdzv_id: str = typer.Option(
        None,
        "--rdzv-id",
        help="c10d job id, the same on every node [default: lmforge-<run.name>].",
        show_default=False,
    ),
    hostfile: Path = typer.Option(
        None,
        "--hostfile",
        help="deepspeed: hostfile ('host slots=N' per line); needed for several nodes.",
        show_default=False,
    ),
    accelerate_config: Path = typer.Option(
        None,
        "--accelerate-config",
        help="accelerate: its config file (`accelerate config`); a DeepSpeed/FSDP section there sets the "
        "engine when distributed.strategy is auto.",
        show_default=False,
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Print the environment and the exact command, run nothing."
    ),
    slurm: bool = typer.Option(
        False, "--slurm", help="Write an sbatch script instead of running (with --dry-run: print it)."
    ),
    slurm_out: Path = typer.Option(
        None,
        "--slurm-out",
        help="Where --slurm writes the script (implies --slurm) [default: <run.output_dir>/<run.name>.sbatch].",
        show_default=False,
    ),
    verbose: bool = typer.Option(False, "--verbose", help=VERBOSE_HELP),
) -> None:
    """Start distributed training: `lmforge train CONFIG k=v ...` on every worker, through torchrun
    (default), deepspeed or accelerate. A failed worker stops the others; the exit code is its exit code.
    Out of memory with nothing left to halve, the workers stop (exit code 4) and are started again from the
    newest complete checkpoint with the next rung of monitor.guard.oom_ladder on (oom_ladder.json in the run).

    Example: `lmforge launch examples/pretrain_tiny.yaml train.max_steps=50 --nproc-per-node 2 --dry-run`

    Two nodes: `lmforge launch cfg.yaml --nnodes 2 --node-rank 0 --master-addr 10.0.0.1` on the first,
    `--node-rank 1` on the second. Slurm: `lmforge launch cfg.yaml --nnodes 4 --nproc-per-node 8 --slurm`.
    """
    from lmforge.config import load_config
    from lmforge.distributed import launch as plan
    from lmforge.distributed import vllm_server
    from lmforge.distributed.vllm_server import vllm_server_plan
    from lmforge.train import oom_ladder
    from lmforge.train.preflight import VLLM_SERVER_ENV, require_tested_versions

    apply_verbosity(verbose)  # the workers inherit it (LMFORGE_VERBOSE)
    from lmforge.distributed.hostfile import hostfile_layout

    try:
        if backend not in ("torchrun", "deepspeed", "accelerate"):
            raise UserInputError(f"--backend {backend!r}: use torchrun, deepspeed or accelerate")
        cfg = load_config(config, overrides or [])
        if not dry_run:  # a dry run starts nothing: it only shows the plan
            require_tested_versions()  # before any worker starts
        worker_overrides, engine_note = _engine_for_backend(
            backend, cfg.distributed.strategy, overrides or []
        )
        taken, ladder_note = _rungs_taken_before(cfg)
        if backend == "deepspeed" and hostfile is not None:
            nnodes, master_addr = hostfile_layout(hostfile, nnodes, master_addr)
        request = plan.LaunchRequest(
            config=config,
            overrides=[*worker_overrides, *oom_ladder.overrides_of(taken)],
            run_name=cfg.run.name,
            nproc_per_node=nproc_per_node if nproc_per_node is not None else plan.default_nproc_per_node(),
            nnodes=nnodes or "1",
            node_rank=node_rank,
            master_addr=master_addr or "127.0.0.1",
            master_port=master_port,
            backend=backend,  # type: ignore[arg-type]
            max_restarts=max_restarts,
            rdzv_backend=rdzv_backend,
            rdzv_endpoint=rdzv_endpoint,
            rdzv_id=rdzv_id,
            hostfile=hostfile,
            accelerate_config=accelerate_config,
        )
        slurm = slurm or slurm_out is not None
        server = vllm_server_plan(cfg, int(request.nproc_per_node), request.node_range[1])
        if slurm and server is not None:
            raise UserInputError(
                "train.rl.vllm.mode: server: --slurm writes one torchrun per node and starts no vLLM server; "
                "use mode colocate in a job script, or run lmforge launch inside the allocation"
            )
        if slurm:
            script = plan.slurm_script(request, Path.cwd())
            target = slurm_out or cfg.run.output_dir / f"{cfg.run.name}.sbatch"
        else:
            launch_plan = plan.plan_launch(request)
            launch_plan.stall = _stall_watch(cfg)
            mesh_note = _mesh_note(cfg, request)
            launch_plan.notes[:0] = [note for note in (mesh_note, engine_note, ladder_note) if note]
            if server is not None:  # the training processes see their GPUs only, the server its own
                launch_plan.env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, server.training_devices))
                launch_plan.env[VLLM_SERVER_ENV] = server.url  # what `lmforge train` checks it runs beside
                launch_plan.notes += vllm_server.describe(server)
                if not dry_run:
                    vllm_server.check_gpus_for(server)
    except UserInputError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None

    if slurm:
        # A secret given as an override never reaches a printed or written script.
        shown = redact_text(script)
        if shown != script:
            typer.echo(
                "lmforge launch: a secret override was redacted from the script; pass it through the "
                "environment instead (for example monitor.alerts.webhook_url_env)",
                err=True,
            )
        script = shown
        if dry_run:
            sys.stdout.write(script)
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(script, encoding="utf-8")
        target.chmod(0o755)
        typer.echo(f"wrote {target}\nsubmit it with: sbatch {target}")
        return
    if dry_run:
        sys.stdout.write(plan.render_dry_run(launch_plan))
        return
    try:
        plan.check_port_free(request)  # before any worker starts: a taken port was a traceback after 27 s
    except UserInputError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    for note in launch_plan.notes:
        typer.echo(f"lmforge launch: {note}", err=True)
    if server is None:
        raise typer.Exit(_train_with_oom_ladder(request, launch_plan, cfg, worker_overrides, taken))
    try:
        process = vllm_server.start(server, cfg.run.output_dir / cfg.run.name / "vllm_server.log")
    except UserInputError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1) from None
    try:
        code = _train_with_oom_ladder(request, launch_plan, cfg, worker_overrides, taken)
    finally:
        vllm_server.stop(process)
    raise typer.Exit(code)


def _mesh_note(cfg: LmforgeConfig, request: LaunchRequest) -> str | None:
    """The device mesh of a tensor / context / pipeline / expert parallel run, checked against the
    model and the world size before any worker starts."""
    from lmforge.distributed.parallel import launch_mesh_note

    low, high = request.node_range
    if low != high:  # an elastic range: the world size is known only when the workers meet
        return None
    return launch_mesh_note(cfg, int(request.nproc_per_node) * low)


def _train_with_oom_ladder(
    request: LaunchRequest,
    launch_plan: LaunchPlan,
    cfg: LmforgeConfig,
    overrides: list[str],
    taken: list[dict[str, Any]],
) -> int:
    """Run the workers until they finish or fail. Each time they stop out of memory for the next
    rung of the OOM ladder (train/oom_ladder.py), say so in one line and start them again with every
    rung taken so far; they resume from the newest complete checkpoint."""
    from lmforge.distributed import launch as plan
    from lmforge.train import oom_ladder

    os.environ[oom_ladder.DRIVER_ENV] = "1"  # the workers' too: they need not say how to go on
    while True:
        code, failure = _run_workers(request.backend, launch_plan)
        now = oom_ladder.read_rungs(cfg.run.dir)
        # A worker stops for the ladder with OOM_LADDER_EXIT, but a launcher may report its own code
        # (accelerate: 1) or another rank's: what counts is a rung recorded during this attempt.
        if code == 0 or now == taken:
            for line in failure if code else []:
                typer.echo(line, err=True)
            return code
        typer.echo(f"lmforge launch: {oom_ladder.restart_line(now[-1])}", err=True)
        taken = now
        restart = [*overrides, *oom_ladder.overrides_of(taken), *oom_ladder.RESTART_OVERRIDES]
        request = replace(request, overrides=restart)
        launch_plan = plan.plan_launch(request)
        launch_plan.stall = _stall_watch(cfg)


def _stall_watch(cfg: LmforgeConfig) -> tuple[float, Path] | None:
    """The launch ends after a stall of monitor.guard.stall_seconds (distributed/stall_watch.py)."""
    seconds = cfg.monitor.guard.stall_seconds
    return None if seconds is None else (seconds, cfg.run.dir / "stacks")


def _run_workers(backend: str, launch_plan: LaunchPlan) -> tuple[int, list[str]]:
    """One start of the workers: their exit code, and the lines that explain a failure."""
    from lmforge.distributed import launch as plan

    if backend in ("deepspeed", "accelerate"):
        code = plan.run_launcher(launch_plan)
        return code, [f"error: the {backend} launcher exited with code {code}"]
    code, failures = plan.run_torchrun(launch_plan)
    if failures and failures[0].startswith("error:"):  # a stall: said whole, not per worker
        return code, failures
    return code, [
        f"error: distributed training failed ({len(failures)} worker(s)):",
        *(f"  {line}" for line in failures),
    ]


def _rungs_taken_before(cfg: LmforgeConfig) -> tuple[list[dict[str, Any]], str | None]:
    """The rungs of the OOM ladder this run took in earlier launches, which stay on (their
    overrides join the workers' command), and a note naming them; none when run.overwrite
    starts the run over."""
    from lmforge.train.oom_ladder import LADDER_FILE, RUNG_WORDS, read_rungs

    taken = [] if cfg.run.overwrite else read_rungs(cfg.run.dir)
    if not taken:
        return [], None
    names = ", ".join(f"{RUNG_WORDS[r['rung']]} (out of memory at step {r.get('step')})" for r in taken)
    return (
        taken,
        f"{cfg.run.dir / LADDER_FILE}: this run took rungs of the OOM ladder before; they stay on: {names}",
    )


def _engine_for_backend(backend: str, strategy: str, overrides: list[str]) -> tuple[list[str], str | None]:
    """The workers' overrides and a note: `--backend deepspeed` means the DeepSpeed engine when the
    config leaves distributed.strategy to auto (it used to run DDP under DeepSpeed's launcher
    without a word); a strategy the config names is kept, and said."""
    if backend != "deepspeed":
        return list(overrides), None
    if strategy == "auto":
        return [*overrides, "distributed.strategy=deepspeed"], (
            "--backend deepspeed: the workers train with the DeepSpeed engine (distributed.strategy=deepspeed)"
        )
    if strategy != "deepspeed":
        return list(overrides), (
            f"--backend deepspeed starts the workers; they train with distributed.strategy={strategy}, as the "
            "config says (set distributed.strategy=deepspeed for the DeepSpeed engine)"
        )
    return list(overrides), None
