"""`lmforge ckpt verify`: integrity and behavioural parity of an artifact, as a verdict."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from lmforge.cli.console import console

# Exit code of a verification that ran and failed (2 stays "bad input").
VERIFY_FAILED = 1


def command(
    path: Path = typer.Argument(
        ...,
        help="The artifact: an HF model or adapter dir, a compressed-tensors export, a GGUF file/dir, an ONNX dir.",
    ),
    against: Path | None = typer.Option(
        None, "--against", help="Reference model (default: the source recorded by lmforge's converter)."
    ),
    data: Path | None = typer.Option(
        None,
        "--data",
        help="Texts (.txt, jsonl {text}) or QA rows to compare on (default: built-in texts); for a "
        "vision-language model, conversation rows with images (the run's eval rows), fed with their images.",
    ),
    runtime: str = typer.Option(
        "auto",
        help="auto (the artifact's own), transformers, onnxruntime, llama.cpp, or vllm (a CUDA GPU: the model "
        "as vLLM will serve it).",
    ),
    prompts: int = typer.Option(4, help="Greedy generations to compare."),
    new_tokens: int = typer.Option(16, help="Tokens per greedy generation."),
    max_rows: int = typer.Option(64, help="Texts or QA rows of --data compared on, at most."),
    max_ppl_increase: float | None = typer.Option(
        None, help="Gate: largest perplexity increase over the reference's (0.05: 5%)."
    ),
    max_accuracy_drop: float | None = typer.Option(
        None, help="Gate (QA --data): largest drop in greedy task accuracy (0.02: two points)."
    ),
    min_top1_agreement: float | None = typer.Option(
        None, help="Gate: smallest share of positions where both models predict the same next token."
    ),
    max_logit_diff: float | None = typer.Option(None, help="Parity: largest logit diff / largest |logit|."),
    min_greedy_prefix: float | None = typer.Option(
        None, help="Parity: smallest mean share of greedy tokens before the first difference."
    ),
    max_ppl_rel_diff: float | None = typer.Option(
        None, hidden=True, help="Former name of --max-ppl-increase."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document on stdout."),
) -> None:
    """Hashes, completeness and behaviour against a reference, in the artifact's own runtime: the gates
    (perplexity increase, top-1 agreement, and on QA --data the task accuracy drop) and, at 8 bits and
    above, logit and greedy parity; limits by precision unless given. Exits 1 when a check fails,
    naming the numbers that failed.

    Example: `lmforge ckpt verify runs/sft/export/gguf --against runs/sft/final --data eval.jsonl --json`
    """
    from lmforge.export.verify import verify

    given = {
        "max_ppl_increase": max_ppl_increase if max_ppl_increase is not None else max_ppl_rel_diff,
        "max_accuracy_drop": max_accuracy_drop,
        "min_top1_agreement": min_top1_agreement,
        "max_logit_diff": max_logit_diff,
        "min_greedy_prefix": min_greedy_prefix,
    }
    verdict = verify(
        path,
        against=against,
        data=data,
        runtime=runtime,
        prompts=prompts,
        new_tokens=new_tokens,
        max_rows=max_rows,
        tolerances={key: value for key, value in given.items() if value is not None},
    )
    if as_json:
        print(json.dumps(verdict.to_json(), indent=2))
    else:
        print_verdict(verdict.to_json())
    if not verdict.passed:
        raise typer.Exit(VERIFY_FAILED)


def print_verdict(result: dict) -> None:
    """A few human lines: what was checked, the key numbers, PASS or FAIL with the reasons."""
    integrity = result["integrity"]
    console.print(f"integrity: {integrity['status']} ({integrity.get('checked', '')})", markup=False)
    parity = result["parity"]
    if "skipped" in parity:
        console.print(f"parity: skipped ({parity['skipped']})", markup=False)
    elif parity:
        console.print(
            f"behaviour vs {result['reference']} in {result['runtime']} ({result['precision']}, on "
            f"{parity['data']}): ppl {parity['ppl_artifact']:.4g} vs {parity['ppl_reference']:.4g} "
            f"({parity['ppl_increase']:+.2%}), top-1 {parity['top1_agreement']:.1%}, logits max diff "
            f"{parity['logits_max_abs_diff']:.3g} (rel {parity['logits_rel_diff']:.3g}), greedy "
            f"{parity['greedy_identical']:.0%} identical ({parity['greedy_prefix']:.0%} of tokens agree)",
            markup=False,
        )
        accuracy = parity.get("accuracy")
        if accuracy:
            console.print(
                f"task accuracy on {accuracy['questions']} questions: {accuracy['artifact']:.1%} vs "
                f"{accuracy['reference']:.1%} (drop {accuracy['drop']:+.1%})",
                markup=False,
            )
    print_images(result.get("images") or {})
    if result["passed"]:
        console.print("[bold green]PASS[/]")
    else:
        console.print("[bold red]FAIL[/]")
        for failure in result["failures"]:
            console.print(f"  {failure}", markup=False)


def print_images(images: dict) -> None:
    """A vision-language model's line: on how many images it was compared, or why on none."""
    if not images:
        return  # a text model
    if images["checked"]:
        console.print(
            f"images: compared with {images['images']} image(s) fed, on {images['rows_with_images']} of "
            f"{images['rows']} rows",
            markup=False,
        )
    else:
        console.print(f"images: NOT checked ({images['why']})", markup=False)
