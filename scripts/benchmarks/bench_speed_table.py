"""The text scripts/benchmarks/bench_speed.py prints and writes: one line per measured row, the targets table,
every row.

A row is a dict: case, tokens, measure, native, patched (ms or MB), ratio (patched / native, None where it
failed), low / high (the spread of a timing's per-pair ratios), target (None where none is set), and optionally
error, paths (the attention paths the patched model took, ``hf_posswap.core.paths``) and first_native /
first_patched (ms of the first, warm-up call: compilation and autotuning on CUDA). The headers say what was
measured on and how.
"""

from __future__ import annotations

import argparse
import platform
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import transformers

if TYPE_CHECKING:
    from bench_speed_measure import Shape

LABELS = {"forward": "forward ms", "train": "train step ms", "decode": "{n} cached decode steps ms",
          "memory": "peak MB over idle", "memory-total": "peak MB, whole process",
          "memory-train": "train step peak MB over idle"}


def label(measure: str, new_tokens: int) -> str:
    return LABELS[measure].format(n=new_tokens)


def print_row(row: dict) -> None:
    paths = f"  paths {','.join(row['paths'])}" if row.get("paths") else ""
    print(f"{row['case']:17s} {row['tokens']:6d} {row['measure']:13s} native {number(row['native']):>9s}  "
          f"patched {number(row['patched']):>9s}  ratio {ratio_text(row)} {verdict(row)}{paths}", flush=True)


def number(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def ratio_text(row: dict) -> str:
    """'1.07 (1.03–1.12)': the median ratio and, for timings, its min–max over the pairs."""
    if row["ratio"] is None:
        return f"failed: {row['error']}" if row.get("error") else "–"
    if row.get("low") is None:
        return f"{row['ratio']:.2f}"
    return f"{row['ratio']:.2f} ({row['low']:.2f}–{row['high']:.2f})"


def mark(row: dict) -> str:
    """'✓' within the row's target, '✗' over it (or failed), '' where no target is set."""
    if row["target"] is None:
        return ""
    return "✓" if row["ratio"] is not None and row["ratio"] <= row["target"] else "✗"


def verdict(row: dict) -> str:
    """'≤ 1.15 ✓' / '≤ 1.15 ✗'; '' where no target is set."""
    return f"≤ {row['target']:.2f} {mark(row)}" if row["target"] is not None else ""


def summary_cell(rows: list[dict], case: str, measure: str, length: int | None,
                 targets: dict[tuple[str, int | None], float]) -> str:
    """One cell of the targets table, '1.07 ✓ (≤ 1.15)'; where ``length`` is None, the worst length's ratio.
    ``targets`` are the case's: a cell they name that has no row says 'not run'."""
    found = [r for r in rows if r["case"] == case and r["measure"] == measure and length in (None, r["tokens"])]
    if not found:
        targeted = any(m == measure and length in (None, n) for m, n in targets)
        return "not run" if targeted else "–"
    worst = max(found, key=lambda r: float("inf") if r["ratio"] is None else r["ratio"])
    notes = [f"≤ {worst['target']:.2f}"] if worst["target"] is not None else []
    notes += [f"worst at {worst['tokens']:,}"] if length is None and len(found) > 1 else []
    value = "failed" if worst["ratio"] is None else f"{worst['ratio']:.2f}"
    return " ".join(part for part in (value, mark(worst), f"({'; '.join(notes)})" if notes else "") if part)


def case_paths(rows: list[dict], case: str) -> str:
    """The attention paths the patched model of ``case`` took over all its rows, or '–' where none was noted."""
    taken = sorted({path for r in rows if r["case"] == case for path in r.get("paths") or ()})
    return ", ".join(taken) or "–"


def tables(rows: list[dict], cases: list[str], summary: list[tuple[str, int | None, str]],
           targets: dict[str, dict[tuple[str, int | None], float]], new_tokens: int, first_calls: bool) -> list[str]:
    """The targets table (one row per case, a column per ``summary`` entry, then the paths taken) and the table
    of every row; ``first_calls`` adds the warm-up calls' times (on CUDA, where compilation happens)."""
    lines = ["| case | " + " | ".join(header for _, _, header in summary) + " | paths (patched) |",
             "|---" * (len(summary) + 2) + "|"]
    lines += [f"| {case} | " + " | ".join(summary_cell(rows, case, m, n, targets.get(case, {})) for m, n, _ in summary)
              + f" | {case_paths(rows, case)} |" for case in cases]
    extra = " first call ms (native / patched) |" if first_calls else ""
    lines += ["", "| case | tokens | measure | native | patched | patched / native | target |" + extra,
              "|---" * (7 + bool(first_calls)) + "|"]
    for r in rows:
        line = (f"| {r['case']} | {r['tokens']} | {label(r['measure'], new_tokens)} | {number(r['native'])} "
                f"| {number(r['patched'])} | {ratio_text(r)} | {verdict(r) or '–'} |")
        if first_calls:
            line += f" {number(r.get('first_native'))} / {number(r.get('first_patched'))} |"
        lines.append(line)
    return lines


def environment(settings: argparse.Namespace) -> dict:
    """What the numbers were measured on: versions, device, and the commit where git can tell."""
    info = {"device": settings.device, "dtype": settings.dtype, "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__, "commit": _commit()}
    if settings.device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(settings.torch_device)
    else:
        info["threads"] = settings.threads
    return info


def _commit() -> str | None:
    try:
        found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                               cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return found.stdout.strip() or None


def _model_text(shape: Shape) -> str:
    return (f"{shape.layers} layers, hidden {shape.hidden}, {shape.heads} heads of {shape.hidden // shape.heads} "
            f"(LLaMA: {shape.kv_heads} kv heads, MLP {shape.llama_intermediate}), vocab {shape.vocab}, no dropout")


def _timing_text(settings: argparse.Namespace) -> str:
    return (f"ratio = median of the per-pair patched / native ratios (min–max over the pairs). Decode: "
            f"{settings.new_tokens} greedy cached steps after the prompt, prefill not timed. Self-Extend: the model "
            "declared at a quarter of the prompt length and extended with extend_context(..., 'self_extend') "
            "(window a quarter of that, the smallest group reaching the length), forward only. Paths: the "
            "attention paths the patched model took (hf_posswap.core.paths).")


def cpu_header(settings: argparse.Namespace) -> str:
    return (
        f"Torch {torch.__version__}, transformers {transformers.__version__}, {settings.threads} threads, "
        f"{settings.dtype}, sdpa, batch 1; models built from configs: {_model_text(settings.shape)}. "
        f"{settings.repeats} alternating pairs per timing; " + _timing_text(settings) + " Memory: one forward in a "
        "fresh process per model; the target judges the peak over the idle process (the whole process's peak, "
        "interpreter and weights included, dilutes the ratio)"
        + (f"; glibc's mmap threshold fixed at {settings.mmap_threshold:,} bytes in those processes, so freed tensors "
           "leave the process and the peak follows live tensors, not heap fragmentation"
           if settings.mmap_threshold else "")
        + ". ✓ / ✗: within / over the target. "
        + (f"Training steps up to {settings.max_train_length:,} tokens." if settings.max_train_length else ""))


def cuda_header(settings: argparse.Namespace) -> str:
    info = getattr(settings, "environment", None) or environment(settings)
    return (
        f"{info['gpu']}, torch {info['torch']}, transformers {info['transformers']}, {settings.dtype}, batch 1. "
        "Native: the unswapped model with attn_implementation='sdpa' (PyTorch's flash / cuDNN / memory-efficient "
        f"kernels), measured in the same run. Models built on the GPU from configs: {_model_text(settings.shape)}. "
        f"{settings.warmups} warm-up calls per side before each timing, the first timed apart (last column: "
        f"compilation, e.g. flex_attention's, and autotuning fall there), then {settings.repeats} alternating "
        "pairs, torch.cuda.synchronize() before every clock read; " + _timing_text(settings) + " Memory: "
        "torch.cuda.max_memory_allocated over the memory allocated just before one forward (no grad) or one "
        "training step, after one unmeasured call, in this process. ✓ / ✗: within / over the GPU targets "
        "(ALiBi, T5, KERPLE: train step ≤ 1.3, peak memory ≤ 1.1, cached decode ≤ 1.1; Self-Extend forward ≤ 2; "
        "FIRE and Sandwich have none).")
