"""Protocol B (docs/benchmarks.md): speed and memory of patched models against native, measured in one run.

For each case (a family swapped to a scheme: llama-alibi ... bert-rope) and each length, the native model and the
patched one (same shape, same weights, same inputs) run alternately, the order flipping every pair (A B, B A, ...),
and the script reports for a forward pass, a training step (forward + backward) and cached decoding (N greedy
steps after the prompt, the prefill excluded from the time) the median milliseconds of each and the median and
min-max of the patched / native ratio over the pairs. Peak memory of one forward comes from a fresh subprocess per
model (VmHWM): the whole process, and the increment over the same process idle just before the forward. Every
ratio the issue-10 targets table names is compared with its target (TARGETS) and marked pass (✓) or fail (✗).

    python scripts/bench_speed.py --readme README.md   # 2,048 and 8,192 tokens, every case (35-45 min, 2 idle cores)
    python scripts/bench_speed.py --cases llama-alibi --lengths 2048 --steps forward decode --output bench.md
    python scripts/bench_speed.py --quick              # tiny models, 64 tokens: checks that it runs (2-7 min)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import (
    BertConfig,
    BertForMaskedLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
)

import hf_posswap as ps
from hf_posswap.persistence.saving import write_file_atomic

sys.path.insert(0, str(Path(__file__).resolve().parent))
from readme_section import replace_section  # noqa: E402

CASES = {
    "llama-alibi": ("llama", "alibi"), "gpt2-alibi": ("gpt2", "alibi"), "bert-alibi": ("bert", "alibi"),
    "llama-t5": ("llama", "t5"), "gpt2-t5": ("gpt2", "t5"), "bert-t5": ("bert", "t5"),
    "gpt2-rope": ("gpt2", "rope"), "bert-rope": ("bert", "rope"),
}
CAUSAL_FAMILIES = ("llama", "gpt2")  # BERT is bidirectional: forward and training only, no decoding

# Issue 10's targets, patched / native; a length of None applies at every length measured.
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
#: the summary table's columns, as in the issue: (measure, length or None for the worst over lengths, header)
SUMMARY = [("forward", 2048, "forward 2,048"), ("forward", 8192, "forward 8,192"), ("train", 2048, "train step 2,048"),
           ("memory", 8192, "peak memory 8,192"), ("decode", None, "cached decode")]


@dataclasses.dataclass(frozen=True)
class Shape:
    """Model size. The default is the issue's: big enough that attention dominates at long context."""

    layers: int = 4
    hidden: int = 512
    heads: int = 8  # head dim = hidden / heads = 64
    kv_heads: int = 2  # LLaMA only; GPT-2 and BERT have one key-value head per query head
    llama_intermediate: int = 1408  # ~8/3 x hidden, LLaMA's proportion; GPT-2 and BERT use 4 x hidden
    vocab: int = 4096


QUICK_SHAPE = Shape(layers=2, hidden=64, heads=4, kv_heads=2, llama_intermediate=192, vocab=256)


def build(family: str, shape: Shape, max_positions: int) -> PreTrainedModel:
    """A seeded fp32 model of ``family`` (sdpa attention, no dropout, so that only the position scheme differs)."""
    torch.manual_seed(0)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(
            vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.llama_intermediate,
            num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
            max_position_embeddings=max_positions, attn_implementation="sdpa"))
    if family == "gpt2":
        return GPT2LMHeadModel(GPT2Config(
            vocab_size=shape.vocab, n_embd=shape.hidden, n_layer=shape.layers, n_head=shape.heads,
            n_positions=max_positions, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
            attn_implementation="sdpa"))
    return BertForMaskedLM(BertConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, intermediate_size=4 * shape.hidden, max_position_embeddings=max_positions,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="sdpa"))


def prompt(shape: Shape, length: int) -> torch.Tensor:
    """The same seeded token ids for every model of a length: [1, length]."""
    return torch.randint(0, shape.vocab, (1, length), generator=torch.Generator().manual_seed(length))


def time_forward(model: PreTrainedModel, input_ids: torch.Tensor) -> float:
    """Seconds of one inference forward over the whole input."""
    model.eval()
    start = time.perf_counter()
    with torch.no_grad():
        model(input_ids=input_ids)
    return time.perf_counter() - start


def time_train(model: PreTrainedModel, input_ids: torch.Tensor) -> float:
    """Seconds of one training step, forward + backward of the LM loss (BERT: MLM loss over every token)."""
    model.train()
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    return time.perf_counter() - start


def time_decode(model: PreTrainedModel, input_ids: torch.Tensor, new_tokens: int) -> float:
    """Seconds of ``new_tokens`` greedy steps with the KV cache after the prompt, fed as ``generate`` feeds them
    (attention mask and position ids); the prefill runs before the clock starts, fresh each time."""
    model.eval()
    length = input_ids.shape[1]
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=True)
        start = time.perf_counter()
        for step in range(new_tokens):
            token = out.logits[:, -1:].argmax(-1)
            out = model(input_ids=token, past_key_values=out.past_key_values, use_cache=True,
                        attention_mask=torch.ones(1, length + step + 1, dtype=torch.long),
                        position_ids=torch.tensor([[length + step]]))
    return time.perf_counter() - start


def alternate(native: Callable[[], float], patched: Callable[[], float], repeats: int) -> dict:
    """Run each once to warm up, then ``repeats`` pairs, flipping the order every pair (A B, B A, ...) so neither
    side always runs first. Returns the medians (s) and the median, min and max of the per-pair ratios."""
    native(), patched()
    pairs = []
    for index in range(repeats):
        if index % 2 == 0:
            t_native = native()
            t_patched = patched()
        else:
            t_patched = patched()
            t_native = native()
        pairs.append((t_native, t_patched))
    ratios = [p / n for n, p in pairs]
    return {"native": statistics.median(n for n, _ in pairs), "patched": statistics.median(p for _, p in pairs),
            "ratio": statistics.median(ratios), "low": min(ratios), "high": max(ratios)}


def memory_probe(family: str, scheme: str | None, length: int, shape: dict, threads: int) -> None:
    """Run in a fresh subprocess: build (and swap) the model, then one forward of ``length`` tokens; print the
    peak resident MB of the whole process and the part of it above the process just before the forward."""
    torch.set_num_threads(threads)
    model = build(family, Shape(**shape), length).eval()
    if scheme:
        ps.swap(model, scheme)
    input_ids = prompt(Shape(**shape), length)
    idle = _status_kb("VmRSS")
    reset = _reset_peak()  # VmHWM := VmRSS, so building the model does not count
    with torch.no_grad():
        model(input_ids=input_ids)
    peak = _status_kb("VmHWM")
    print(json.dumps({"peak_mb": peak / 1024, "over_idle_mb": (peak - idle) / 1024 if reset else None}))


def _status_kb(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def _reset_peak() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux >= 4.0); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as refs:
            refs.write("5")
    except OSError:
        return False
    return True


def measure_memory(
    family: str, scheme: str | None, length: int, shape: Shape, threads: int, mmap_threshold: int | None = None
) -> dict:
    """memory_probe in a fresh interpreter (VmHWM, not ru_maxrss, which would carry the parent's over fork).

    ``mmap_threshold`` (bytes) fixes glibc's ``MALLOC_MMAP_THRESHOLD_`` in that interpreter: every allocation of at
    least that size is its own mapping, given back when freed, so VmHWM follows the peak of live tensors instead of
    how fragmented the heap got (glibc raises its threshold to the size of each freed mapping, up to 32 MiB, after
    which tensors up to that size are carved from the heap and their freed pages stay resident)."""
    call = f"b.memory_probe({family!r}, {scheme!r}, {length}, {dataclasses.asdict(shape)!r}, {threads})"
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); import bench_speed as b; {call}"
    env = None if mmap_threshold is None else {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(mmap_threshold)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if result.returncode != 0:
        tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {result.returncode}: {tail}"}
    return json.loads(result.stdout.strip().splitlines()[-1])


def target_for(case: str, measure: str, length: int) -> float | None:
    """The issue's target for this ratio, or None where the issue sets none."""
    targets = TARGETS[case]
    return targets.get((measure, length), targets.get((measure, None)))


def timing_row(case: str, length: int, measure: str, native: PreTrainedModel, patched: PreTrainedModel,
               input_ids: torch.Tensor, settings: argparse.Namespace) -> dict:
    """Alternate the step on both models and return one result row (milliseconds)."""
    steps = {"forward": lambda m: time_forward(m, input_ids), "train": lambda m: time_train(m, input_ids),
             "decode": lambda m: time_decode(m, input_ids, settings.new_tokens)}
    step = steps[measure]
    result = alternate(lambda: step(native), lambda: step(patched), settings.repeats)
    return {"case": case, "tokens": length, "measure": measure, "native": 1e3 * result["native"],
            "patched": 1e3 * result["patched"], "ratio": result["ratio"], "low": result["low"],
            "high": result["high"], "target": target_for(case, measure, length)}


def memory_rows(case: str, length: int, settings: argparse.Namespace) -> list[dict]:
    """Two rows: peak MB of the whole process, and peak MB over the idle process (the one the target judges)."""
    family, scheme = CASES[case]
    native, patched = (measure_memory(family, s, length, settings.shape, settings.threads, settings.mmap_threshold)
                       for s in (None, scheme))
    failed = native.get("error") or patched.get("error")
    rows = []
    for measure, key in (("memory-total", "peak_mb"), ("memory", "over_idle_mb")):
        row = {"case": case, "tokens": length, "measure": measure, "native": native.get(key),
               "patched": patched.get(key), "target": target_for(case, measure, length), "error": failed}
        usable = not failed and row["native"] and row["patched"] is not None
        row["ratio"] = row["patched"] / row["native"] if usable else None
        rows.append(row)
    return rows


def run(settings: argparse.Namespace) -> list[dict]:
    """Every case x length x measure of ``settings``; prints each row as it is measured."""
    rows = []
    for case in settings.cases:
        family, scheme = CASES[case]
        for length in settings.lengths:
            native = build(family, settings.shape, length + settings.new_tokens)
            patched = build(family, settings.shape, length + settings.new_tokens)
            ps.swap(patched, scheme)
            input_ids = prompt(settings.shape, length)
            for measure in settings.steps:
                if measure == "train" and length > settings.max_train_length:
                    continue
                if measure == "decode" and family not in CAUSAL_FAMILIES:
                    continue
                rows.append(timing_row(case, length, measure, native, patched, input_ids, settings))
                _print_row(rows[-1])
            if settings.memory:
                rows += memory_rows(case, length, settings)
                _print_row(rows[-2]), _print_row(rows[-1])
    return rows


LABELS = {"forward": "forward ms", "train": "train step ms", "decode": "{n} cached decode steps ms",
          "memory": "peak MB over idle", "memory-total": "peak MB, whole process"}


def _label(measure: str, new_tokens: int) -> str:
    return LABELS[measure].format(n=new_tokens)


def _print_row(row: dict) -> None:
    print(f"{row['case']:12s} {row['tokens']:6d} {row['measure']:13s} native {_number(row['native']):>9s}  "
          f"patched {_number(row['patched']):>9s}  ratio {_ratio(row)} {_verdict(row)}", flush=True)


def _number(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def _ratio(row: dict) -> str:
    """'1.07 (1.03–1.12)': the median ratio and, for timings, its min–max over the pairs."""
    if row["ratio"] is None:
        return f"failed: {row['error']}" if row.get("error") else "–"
    if row.get("low") is None:
        return f"{row['ratio']:.2f}"
    return f"{row['ratio']:.2f} ({row['low']:.2f}–{row['high']:.2f})"


def _mark(row: dict) -> str:
    """'✓' within the row's target, '✗' over it (or failed), '' where the issue sets no target."""
    if row["target"] is None:
        return ""
    return "✓" if row["ratio"] is not None and row["ratio"] <= row["target"] else "✗"


def _verdict(row: dict) -> str:
    """'≤ 1.15 ✓' / '≤ 1.15 ✗'; '' where the issue sets no target."""
    return f"≤ {row['target']:.2f} {_mark(row)}" if row["target"] is not None else ""


def summary_cell(rows: list[dict], case: str, measure: str, length: int | None) -> str:
    """One cell of the targets table, '1.07 ✓ (≤ 1.15)'; where ``length`` is None, the worst length's ratio."""
    found = [r for r in rows if r["case"] == case and r["measure"] == measure and length in (None, r["tokens"])]
    if not found:
        targeted = any(m == measure and length in (None, n) for m, n in TARGETS[case])
        return "not run" if targeted else "–"
    worst = max(found, key=lambda r: float("inf") if r["ratio"] is None else r["ratio"])
    notes = [f"≤ {worst['target']:.2f}"] if worst["target"] is not None else []
    notes += [f"worst at {worst['tokens']:,}"] if length is None and len(found) > 1 else []
    value = "failed" if worst["ratio"] is None else f"{worst['ratio']:.2f}"
    return " ".join(part for part in (value, _mark(worst), f"({'; '.join(notes)})" if notes else "") if part)


def markdown(rows: list[dict], settings: argparse.Namespace, minutes: float) -> str:
    """The targets table (one row per case, the issue's columns), then every measurement."""
    shape = settings.shape
    lines = [
        f"Torch {torch.__version__}, {settings.threads} threads, fp32, sdpa, batch 1; models built from configs: "
        f"{shape.layers} layers, hidden {shape.hidden}, {shape.heads} heads of {shape.hidden // shape.heads} "
        f"(LLaMA: {shape.kv_heads} kv heads), vocab {shape.vocab}, no dropout. {settings.repeats} alternating pairs "
        f"per timing; ratio = median of the per-pair patched / native ratios (min–max over the pairs). Decode: "
        f"{settings.new_tokens} greedy cached steps after the prompt, prefill not timed. Memory: one forward in a "
        "fresh process per model; the target judges the peak over the idle process (the whole process's peak, "
        "interpreter and weights included, dilutes the ratio)"
        + (f"; glibc's mmap threshold fixed at {settings.mmap_threshold:,} bytes in those processes, so freed tensors "
           "leave the process and the peak follows live tensors, not heap fragmentation"
           if settings.mmap_threshold else "")
        + ". ✓ / ✗: within / over issue 10's target. "
        f"Training steps up to {settings.max_train_length:,} tokens. The run took {minutes:.0f} min.",
        "",
        "| case | " + " | ".join(header for _, _, header in SUMMARY) + " |",
        "|---" * (len(SUMMARY) + 1) + "|",
    ]
    lines += [f"| {case} | " + " | ".join(summary_cell(rows, case, m, n) for m, n, _ in SUMMARY) + " |"
              for case in settings.cases]
    lines += ["", "| case | tokens | measure | native | patched | patched / native | target |", "|---" * 7 + "|"]
    lines += [f"| {r['case']} | {r['tokens']} | {_label(r['measure'], settings.new_tokens)} | {_number(r['native'])} "
              f"| {_number(r['patched'])} | {_ratio(r)} | {_verdict(r) or '–'} |" for r in rows]
    return "\n".join(lines)


def positive(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text) if text.lstrip("-").isdigit() else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; --quick swaps in tiny models and defaults (explicit flags still win)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--lengths", nargs="+", type=positive, help="prompt lengths (default 2048 8192)")
    parser.add_argument("--steps", nargs="+", default=["forward", "train", "decode"],
                        choices=["forward", "train", "decode"])
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--mmap-threshold", type=positive, metavar="BYTES",
                        help="memory probes: fix glibc's MALLOC_MMAP_THRESHOLD_ (e.g. 65536) so the peak follows live "
                             "tensors, not heap fragmentation (default: glibc's dynamic threshold)")
    parser.add_argument("--repeats", type=positive, help="alternating pairs per timing (default 5)")
    parser.add_argument("--new-tokens", type=positive, help="cached decode steps timed after the prompt (default 32)")
    parser.add_argument("--max-train-length", type=positive, default=2048, help="skip training steps above this")
    parser.add_argument("--threads", type=positive, default=2, help="torch threads (default 2, as the targets)")
    parser.add_argument("--quick", action="store_true", help="tiny models, 64 tokens, 1 pair: a smoke run")
    parser.add_argument("--output", help="write the markdown tables here")
    parser.add_argument("--readme", help="README to refresh between <!-- bench-speed:start/end --> markers")
    args = parser.parse_args(argv)
    args.shape = QUICK_SHAPE if args.quick else Shape()
    args.lengths = args.lengths or ([64] if args.quick else [2048, 8192])
    args.repeats = args.repeats or (1 if args.quick else 5)
    args.new_tokens = args.new_tokens or (4 if args.quick else 32)
    args.memory = not args.no_memory
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    rows = run(args)
    table = markdown(rows, args, (time.perf_counter() - start) / 60)
    print("\n" + table)
    if args.output:
        write_file_atomic(args.output, table + "\n")
    if args.readme:
        command = "python scripts/bench_speed.py " + " ".join(sys.argv[1:] if argv is None else argv)
        replace_section(Path(args.readme), "bench-speed", f"`{command.strip()}`:\n\n{table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
