"""Protocol B (docs/benchmarks.md): speed and memory of patched models against native, measured in one run.

For each case (a family swapped to a scheme: llama-alibi ... bert-rope, or extended with Self-Extend) and each
length, the native model and the patched one (same shape, same weights, same inputs) run alternately, the order
flipping every pair (A B, B A, ...), and the script reports for a forward pass, a training step (forward + backward)
and cached decoding (N greedy steps after the prompt, the prefill excluded from the time) the median milliseconds
of each and the median and min-max of the patched / native ratio over the pairs, beside the attention paths the
patched model took (hf_posswap.core.paths). Peak memory of one forward: on the CPU from a fresh subprocess per
model (VmHWM), the whole process and the increment over the same process idle just before the forward; on CUDA
from the caching allocator in this process (also for one training step). Every ratio a target is set for (TARGETS
on the CPU, CUDA_TARGETS on a GPU) is marked pass (✓) or fail (✗).

    # 2,048 and 8,192 tokens, every case (35-45 min, 2 idle cores)
    python scripts/benchmarks/bench_speed.py --readme docs/speed.md
    python scripts/benchmarks/bench_speed.py --cases llama-alibi --lengths 2048 --steps forward decode --output bench.md
    # tiny models, 64 tokens: checks that it runs (2-7 min)
    python scripts/benchmarks/bench_speed.py --quick
    python scripts/benchmarks/bench_speed.py --device cuda --dtype bfloat16 --json gpu.json --budget-seconds 400
                                                       # 8,192 and 32,768 tokens, a 0.3 B LLaMA-like decoder

--output and --json are rewritten (atomically) after every row, so a run that is killed or stopped by
--budget-seconds keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from hf_posswap.core.paths import record_paths
from hf_posswap.persistence.saving import write_file_atomic

sys.path.extend(str(Path(__file__).resolve().parents[1] / name) for name in ("recipes", "benchmarks", "maintenance"))
from bench_speed_measure import (  # noqa: E402
    CUDA_SHAPE,
    QUICK_SHAPE,
    SELF_EXTEND,
    Shape,
    alternate,
    build,
    build_patched,
    cuda_peak,
    measure_memory,
    prompt,
    release_cuda_memory,
    time_decode,
    time_forward,
    time_train,
)
from bench_speed_table import cpu_header, cuda_header, environment, print_row, tables  # noqa: E402
from bench_speed_table import summary_cell as _summary_cell  # noqa: E402
from readme_section import replace_section  # noqa: E402

__all__ = ["CASES", "CUDA_TARGETS", "Shape", "TARGETS", "alternate", "build", "main", "markdown", "memory_rows",
           "prompt", "run", "summary_cell", "target_for"]

CASES = {
    "llama-alibi": ("llama", "alibi"), "gpt2-alibi": ("gpt2", "alibi"), "bert-alibi": ("bert", "alibi"),
    "llama-t5": ("llama", "t5"), "gpt2-t5": ("gpt2", "t5"), "bert-t5": ("bert", "t5"),
    "gpt2-rope": ("gpt2", "rope"), "bert-rope": ("bert", "rope"),
    "llama-kerple": ("llama", "kerple"), "llama-fire": ("llama", "fire"), "llama-sandwich": ("llama", "sandwich"),
    "llama-self-extend": ("llama", SELF_EXTEND),
}
CPU_CASES = list(CASES)[:8]  # the CPU run's default: the cases the targets name
CUDA_CASES = ["llama-alibi", "llama-t5", "llama-kerple", "llama-fire", "llama-sandwich", "llama-self-extend"]
CAUSAL_FAMILIES = ("llama", "gpt2")  # BERT is bidirectional: forward and training only, no decoding
FORWARD_ONLY = (SELF_EXTEND,)  # measured as inference only: forward and its peak memory

# The targets, patched / native; a length of None applies at every length measured.
_CAUSAL_ALIBI = {("forward", 2048): 1.15, ("forward", 8192): 1.15, ("train", 2048): 1.15, ("memory", 8192): 1.25,
                 ("decode", None): 1.11}
_BIDIRECTIONAL_ALIBI = {("forward", 2048): 1.15, ("forward", 8192): 1.25, ("train", 2048): 1.25,
                        ("memory", 8192): 1.25}
_CAUSAL_T5 = {("forward", 2048): 1.5, ("forward", 8192): 1.5, ("train", 2048): 2.0, ("memory", 8192): 1.5,
              ("decode", None): 1.11}
_BIDIRECTIONAL_T5 = {("forward", 2048): 2.0, ("forward", 8192): 2.0, ("train", 2048): 2.5, ("memory", 8192): 1.5}
_ROPE_IN_ATTENTION = {("forward", 2048): 1.05, ("forward", 8192): 1.05, ("train", 2048): 1.05,
                      ("memory", 8192): 1.05, ("decode", None): 1.11}
TARGETS: dict[str, dict[tuple[str, int | None], float]] = {
    "llama-alibi": _CAUSAL_ALIBI, "gpt2-alibi": _CAUSAL_ALIBI, "bert-alibi": _BIDIRECTIONAL_ALIBI,
    "llama-t5": _CAUSAL_T5, "gpt2-t5": _CAUSAL_T5, "bert-t5": _BIDIRECTIONAL_T5,
    "gpt2-rope": _ROPE_IN_ATTENTION, "bert-rope": {k: v for k, v in _ROPE_IN_ATTENTION.items() if k[0] != "decode"},
}
# On a GPU, against sdpa's flash / cuDNN kernels in bf16, at every length: the bias schemes through
# flex_attention; FIRE and Sandwich are measured without a target.
_CUDA_BIAS = {("train", None): 1.3, ("memory", None): 1.1, ("memory-train", None): 1.1, ("decode", None): 1.1}
CUDA_TARGETS: dict[str, dict[tuple[str, int | None], float]] = {
    "llama-alibi": _CUDA_BIAS, "llama-t5": _CUDA_BIAS, "llama-kerple": _CUDA_BIAS,
    "llama-self-extend": {("forward", None): 2.0},
}
#: the summary table's columns: (measure, length or None for the worst over lengths, header)
SUMMARY = [("forward", 2048, "forward 2,048"), ("forward", 8192, "forward 8,192"), ("train", 2048, "train step 2,048"),
           ("memory", 8192, "peak memory 8,192"), ("decode", None, "cached decode")]
CUDA_SUMMARY = [("forward", 8192, "forward 8,192"), ("forward", 32768, "forward 32,768"),
                ("train", 8192, "train step 8,192"), ("train", 32768, "train step 32,768"),
                ("memory", None, "peak memory, forward"), ("memory-train", None, "peak memory, train step"),
                ("decode", None, "cached decode")]


def targets(device: str) -> dict[str, dict[tuple[str, int | None], float]]:
    return CUDA_TARGETS if device == "cuda" else TARGETS


def target_for(case: str, measure: str, length: int, device: str = "cpu") -> float | None:
    """The target for this ratio on ``device``, or None where none is set."""
    case_targets = targets(device).get(case, {})
    return case_targets.get((measure, length), case_targets.get((measure, None)))


def summary_cell(rows: list[dict], case: str, measure: str, length: int | None, device: str = "cpu") -> str:
    """One cell of the targets table, '1.07 ✓ (≤ 1.15)'; where ``length`` is None, the worst length's ratio."""
    return _summary_cell(rows, case, measure, length, targets(device).get(case, {}))


def plan(case: str, length: int, settings: argparse.Namespace) -> list[str]:
    """The measures of one case at one length, in the order they run."""
    family, scheme = CASES[case]
    measures = [m for m in settings.steps if not (
        (m == "train" and settings.max_train_length is not None and length > settings.max_train_length)
        or (m == "decode" and family not in CAUSAL_FAMILIES)
        or (m != "forward" and scheme in FORWARD_ONLY))]
    if settings.memory:
        measures.append("memory")
        if settings.device == "cuda" and "train" in measures:
            measures.append("memory-train")
    return measures


def timing_row(case: str, length: int, measure: str, native: torch.nn.Module, patched: torch.nn.Module,
               input_ids: torch.Tensor, settings: argparse.Namespace) -> dict:
    """Alternate the step on both models and return one result row (milliseconds), with the attention paths the
    patched model took (the native model notes none)."""
    steps = {"forward": lambda m: time_forward(m, input_ids), "train": lambda m: time_train(m, input_ids),
             "decode": lambda m: time_decode(m, input_ids, settings.new_tokens)}
    step = steps[measure]
    with record_paths() as paths:
        result = alternate(lambda: step(native), lambda: step(patched), settings.repeats, settings.warmups)
    if measure == "train":
        native.zero_grad(set_to_none=True), patched.zero_grad(set_to_none=True)
    ms = {key: 1e3 * result[key] for key in ("native", "patched", "first_native", "first_patched")}
    return {"case": case, "tokens": length, "measure": measure, **ms, "ratio": result["ratio"], "low": result["low"],
            "high": result["high"], "target": target_for(case, measure, length, settings.device),
            "paths": sorted(set(paths))}


def memory_rows(case: str, length: int, settings: argparse.Namespace) -> list[dict]:
    """CPU: two rows, peak MB of the whole process and peak MB over the idle process (the one the target judges),
    each model in a fresh subprocess."""
    family, scheme = CASES[case]
    native, patched = (measure_memory(family, s, length, settings.shape, settings.threads, settings.mmap_threshold,
                                      settings.dtype) for s in (None, scheme))
    failed = native.get("error") or patched.get("error")
    rows = []
    for measure, key in (("memory-total", "peak_mb"), ("memory", "over_idle_mb")):
        row = {"case": case, "tokens": length, "measure": measure, "native": native.get(key),
               "patched": patched.get(key), "target": target_for(case, measure, length), "error": failed}
        usable = not failed and row["native"] and row["patched"] is not None
        row["ratio"] = row["patched"] / row["native"] if usable else None
        rows.append(row)
    return rows


def cuda_memory_row(case: str, length: int, measure: str, native: torch.nn.Module, patched: torch.nn.Module,
                    input_ids: torch.Tensor, settings: argparse.Namespace) -> dict:
    """CUDA: peak MB over the allocated memory before one forward ('memory') or training step ('memory-train')."""
    step = time_forward if measure == "memory" else time_train
    sides = {name: cuda_peak(model, lambda m: step(m, input_ids), input_ids.device)
             for name, model in (("native", native), ("patched", patched))}
    row = {"case": case, "tokens": length, "measure": measure, "native": sides["native"]["over_idle_mb"],
           "patched": sides["patched"]["over_idle_mb"], "native_total": sides["native"]["peak_mb"],
           "patched_total": sides["patched"]["peak_mb"], "target": target_for(case, measure, length, "cuda")}
    row["ratio"] = row["patched"] / row["native"] if row["native"] else None
    return row


def measure_rows(case: str, length: int, measure: str, native: torch.nn.Module, patched: torch.nn.Module,
                 input_ids: torch.Tensor, settings: argparse.Namespace) -> list[dict]:
    """The rows of one measure; a failure (say, CUDA out of memory) becomes a row that says so."""
    try:
        if measure == "memory" and settings.device == "cpu":
            return memory_rows(case, length, settings)
        if measure.startswith("memory"):
            return [cuda_memory_row(case, length, measure, native, patched, input_ids, settings)]
        return [timing_row(case, length, measure, native, patched, input_ids, settings)]
    except Exception as error:  # noqa: BLE001 - one failed measurement must not lose the others
        traceback.print_exception(error, file=sys.stderr)
        return [failed_row(case, length, measure, error, settings)]


def failed_row(case: str, length: int, measure: str, error: BaseException, settings: argparse.Namespace) -> dict:
    """A row for a measurement that raised, with the first line of the error."""
    message = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {message[0] if message else ''}"
    return {"case": case, "tokens": length, "measure": measure, "native": None, "patched": None, "ratio": None,
            "target": target_for(case, measure, length, settings.device), "error": text[:200]}


def out_of_time(settings: argparse.Namespace, next_up: str) -> bool:
    """True (and the reason noted in ``settings.stopped``) once --budget-seconds have passed since the start."""
    elapsed = time.perf_counter() - settings.started
    if settings.budget_seconds is None or elapsed < settings.budget_seconds:
        return False
    budget = settings.budget_seconds
    settings.stopped = f"stopped by --budget-seconds {budget:g} after {elapsed:.0f} s, before {next_up}"
    return True


def run(settings: argparse.Namespace, written: Callable[[list[dict]], None] = lambda rows: None) -> list[dict]:
    """Every case x length x measure of ``settings``; prints each row as it is measured and hands the rows so far
    to ``written`` after each measure. Starts nothing new once --budget-seconds have passed."""
    rows: list[dict] = []

    def add(found: list[dict]) -> None:
        for row in found:
            rows.append(row)
            print_row(row)
        written(rows)

    settings.stopped = None
    if getattr(settings, "started", None) is None:
        settings.started = time.perf_counter()
    for case in settings.cases:
        for length in settings.lengths:
            measures = plan(case, length, settings)
            if measures and not run_case(case, length, measures, settings, add):
                return rows
            release_cuda_memory(settings.torch_device)  # the case's models are gone
    return rows


def run_case(case: str, length: int, measures: list[str], settings: argparse.Namespace,
             add: Callable[[list[dict]], None]) -> bool:
    """Build the case's two models and measure each of ``measures``; False if the budget stopped it."""
    if out_of_time(settings, f"{case} at {length:,} tokens"):
        return False
    family, scheme = CASES[case]
    try:
        native = build(family, settings.shape, length + settings.new_tokens, settings.torch_device,
                       settings.torch_dtype)
        patched = build_patched(family, scheme, settings.shape, length, settings.new_tokens, settings.torch_device,
                                settings.torch_dtype)
        input_ids = prompt(settings.shape, length, settings.torch_device)
    except Exception as error:  # noqa: BLE001 - a case that cannot be built (e.g. out of memory): the others run
        traceback.print_exception(error, file=sys.stderr)
        add([failed_row(case, length, measure, error, settings) for measure in measures])
        return True
    for measure in measures:
        if out_of_time(settings, f"{case} at {length:,} tokens, {measure}"):
            return False
        add(measure_rows(case, length, measure, native, patched, input_ids, settings))
        if not release_cuda_memory(settings.torch_device):
            settings.stopped = (f"stopped: the CUDA device failed during {case} at {length:,} tokens, {measure} (a "
                                "kernel fault cannot be recovered in this process; rerun the cases after it)")
            return False
    return True


def markdown(rows: list[dict], settings: argparse.Namespace, minutes: float) -> str:
    """The targets table (one row per case, the targets' columns, the paths taken), then every measurement."""
    header = cuda_header(settings) if settings.device == "cuda" else cpu_header(settings)
    stopped = f" The run was {settings.stopped}." if getattr(settings, "stopped", None) else ""
    summary = CUDA_SUMMARY if settings.device == "cuda" else SUMMARY
    lines = tables(rows, settings.cases, summary, targets(settings.device), settings.new_tokens,
                   first_calls=settings.device == "cuda")
    return "\n".join([f"{header} The run took {minutes:.0f} min.{stopped}", "", *lines])


def write_outputs(rows: list[dict], settings: argparse.Namespace, command: str) -> str:
    """The markdown table, written to --output, and the raw rows to --json (each atomically); returns the table."""
    minutes = (time.perf_counter() - settings.started) / 60
    table = markdown(rows, settings, minutes)
    if settings.output:
        write_file_atomic(settings.output, table + "\n")
    if settings.json:
        record = {"command": command, "environment": settings.environment, "settings": _settings_record(settings),
                  "minutes": minutes, "stopped": settings.stopped, "rows": rows}
        write_file_atomic(settings.json, json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    return table


def _settings_record(settings: argparse.Namespace) -> dict:
    keys = ("cases", "lengths", "steps", "repeats", "warmups", "new_tokens", "max_train_length", "memory",
            "budget_seconds", "quick")
    return {"shape": dataclasses.asdict(settings.shape), **{key: getattr(settings, key) for key in keys}}


def positive(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text) if text.lstrip("-").isdigit() else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def seconds(text: str) -> float:
    """argparse type: a number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; --quick and --device cuda choose their own defaults (explicit flags still win)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--cases", nargs="+", choices=list(CASES),
                        help="default: the eight with targets on the CPU; the LLaMA bias and Self-Extend cases on CUDA")
    parser.add_argument("--lengths", nargs="+", type=positive,
                        help="prompt lengths (default 2048 8192; CUDA 8192 32768)")
    parser.add_argument("--steps", nargs="+", default=["forward", "train", "decode"],
                        choices=["forward", "train", "decode"])
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory measures")
    parser.add_argument("--mmap-threshold", type=positive, metavar="BYTES",
                        help="CPU memory probes: fix glibc's MALLOC_MMAP_THRESHOLD_ (e.g. 65536) so the peak follows "
                             "live tensors, not heap fragmentation (default: glibc's dynamic threshold)")
    parser.add_argument("--repeats", type=positive, help="alternating pairs per timing (default 5)")
    parser.add_argument("--warmups", type=positive, help="calls per side before each timing (default 1; CUDA 2)")
    parser.add_argument("--new-tokens", type=positive, help="cached decode steps timed after the prompt (default 32)")
    parser.add_argument("--max-train-length", type=positive,
                        help="skip training steps above this (default 2048 on the CPU; none on CUDA)")
    parser.add_argument("--threads", type=positive, help="CPU only: torch threads (default 2, as the targets)")
    parser.add_argument("--quick", action="store_true", help="tiny models, 64 tokens, 1 pair: a smoke run")
    parser.add_argument("--budget-seconds", type=seconds, metavar="N",
                        help="start no new measurement after N seconds; what was measured is still written")
    parser.add_argument("--output", help="write the markdown tables here (after every measure)")
    parser.add_argument("--json", metavar="PATH", help="write the raw rows here as JSON (after every measure)")
    parser.add_argument("--readme", help="page (docs/speed.md) to refresh between its bench-speed markers")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.exit(2, f"{parser.prog}: error: --device cuda, but this torch ({torch.__version__}) sees no CUDA "
                       "device\n")
    for flag, value in (("--threads", args.threads), ("--mmap-threshold", args.mmap_threshold)):
        if cuda and value is not None:
            parser.exit(2, f"{parser.prog}: error: {flag} applies to --device cpu only\n")
    args.shape = QUICK_SHAPE if args.quick else CUDA_SHAPE if cuda else Shape()
    args.cases = args.cases or (CUDA_CASES if cuda else CPU_CASES)
    args.lengths = args.lengths or ([64] if args.quick else [8192, 32768] if cuda else [2048, 8192])
    args.repeats = args.repeats or (1 if args.quick else 5)
    args.warmups = args.warmups or (2 if cuda else 1)
    args.new_tokens = args.new_tokens or (4 if args.quick else 32)
    args.max_train_length = args.max_train_length or (None if cuda else 2048)
    args.threads = None if cuda else args.threads or 2
    args.memory = not args.no_memory
    args.torch_device = torch.device("cuda" if cuda else "cpu")
    args.torch_dtype = getattr(torch, args.dtype)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    command = "python scripts/benchmarks/bench_speed.py " + " ".join(sys.argv[1:] if argv is None else argv)
    try:
        return measure_and_write(args, command)
    finally:
        torch.set_num_threads(threads)  # a caller (a test) keeps its own setting


def measure_and_write(args: argparse.Namespace, command: str) -> int:
    """Run every measurement, writing --output / --json after each, then print the tables and refresh --readme."""
    args.started, args.stopped = time.perf_counter(), None
    args.environment = environment(args)
    rows = run(args, lambda so_far: write_outputs(so_far, args, command))
    table = write_outputs(rows, args, command)
    print("\n" + table)
    if args.stopped:
        print(f"\n{args.stopped}", file=sys.stderr)
    if args.readme:
        replace_section(Path(args.readme), "bench-speed", f"`{command.strip()}`:\n\n{table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
