"""Protocol A (docs/benchmarks.md): length generalization of tiny models trained from scratch, one per position scheme.

Each model is a LLaMA-shaped byte-level decoder built from a config; its position scheme is set with
``hf_posswap.swap`` (RoPE is the model's own; ``X+concat`` is scheme X with ``combine="concat"``; ``nope-interleaved``
is the SmolLM3 preset). It is trained at length L on Python's documentation topics plus 60 % synthetic passkey and
copy sequences, then evaluated at 1x, 2x, 4x and 8x L with the library's own evaluation:
non-overlapping NLL, tail NLL (only positions past L), sliding-window NLL and passkey accuracy by depth. The RoPE
model is then extended with every RoPE scaling (``hf_posswap.extend_context``), evaluated zero-shot, fine-tuned
briefly at the target length and evaluated again.

    # one seed, small budget, 8 runs (about 15 min on 2 cores)
    python scripts/benchmarks/bench_tiny.py --quick
    # full: 3 seeds, L = 256, 10,000 steps, every run
    python scripts/benchmarks/bench_tiny.py
    # full on one GPU, 16 runs at a time (~8 min per seed, H100)
    python scripts/benchmarks/bench_tiny.py --device cuda --jobs 16
    # a scheme with options
    python scripts/benchmarks/bench_tiny.py --schemes sandwich:dim=32 --seeds 2 --probe-every 1000
    # train each run until it retrieves; then with two probes in a row
    python scripts/benchmarks/bench_tiny.py --until-retrieval 20000 --probe-every 1000
    python scripts/benchmarks/bench_tiny.py --until-retrieval 20000 --confirm-retrieval 2 --probe-every 1000
    # redraw table and plot, merging runs of other seeds
    python scripts/benchmarks/bench_tiny.py --report a.json b.json
    # also refresh that section of docs/results.md and its plot
    python scripts/benchmarks/bench_tiny.py --quick --readme docs/results.md
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from hf_posswap.evaluation import byte_tokenizer
from hf_posswap.persistence.saving import write_file_atomic

sys.path.extend(str(Path(__file__).resolve().parents[1] / name) for name in ("recipes", "benchmarks", "maintenance"))
from bench_tiny_arguments import (  # noqa: E402
    QUICK_RUNS,
    RUNS,
    SCALINGS,
    available_runs,
    check_writable_readme,
    run_label,
    settings_problem,
)
from bench_tiny_report import load_parts, merge, report, write_split  # noqa: E402
from bench_tiny_training import (
    FULL,
    QUICK,
    LengthRamp,
    Settings,
    TrainingDiverged,
    TrainingFailed,
    batches,
    bias_profile,
    build_model,
    corpus_fingerprint,
    corpus_split,
    extend_rope,
    make_probe,
    measure,
    read_corpus_file,
    tile_learned_table,
    train,
    write_corpus_file,
)
from bench_tiny_training import (  # noqa: E402  (re-exported: tests and the recipe scripts read them here)
    Schedule as Schedule,
)
from bench_tiny_training import (
    copy_example as copy_example,
)
from bench_tiny_training import (
    passkey_example as passkey_example,
)
from bench_tiny_training import (
    split_run as split_run,
)

# --- the benchmark --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Task:
    """One unit of work: train and measure ``label`` for ``seed``, or (``method`` set) extend that seed's trained RoPE
    model with ``method`` (zero-shot and fine-tuned rows)."""

    label: str
    seed: int
    method: str | None = None


def train_and_measure(settings: Settings, task: Task, device: str, probe_every: int, state_dir: Path | None,
                      text: str | None = None) -> dict:
    """Train ``task.label`` from scratch on ``text`` (None: this Python's topics) and measure it (tiling a learned
    table to reach past L)."""
    tokenizer = byte_tokenizer()
    train_ids, heldout = corpus_split(tokenizer, text)
    started = time.time()
    model = build_model(settings, task.label, task.seed, device)
    length = (LengthRamp(settings.length, settings.steps, settings.curriculum) if settings.curriculum
              else settings.length)
    data = batches(tokenizer, train_ids, length, settings.batch, settings.synthetic, task.seed,
                   settings.passkey_share)

    probe = make_probe(model, tokenizer, train_ids, heldout, settings.length)
    losses, curve, plan = train(model, data, settings.steps, settings.lr, f"{task.label} seed {task.seed}", probe,
                                probe_every, settings.decay_from, settings.until_retrieval, settings.weight_decay,
                                settings.confirm_retrieval)
    if task.label == "rope" and state_dir is not None:
        state, kept = state_dir / f".rope-seed{task.seed}.pt.tmp", state_dir / f"rope-seed{task.seed}.pt"
        torch.save({k: v.cpu() for k, v in model.state_dict().items()}, state)
        state.replace(kept)  # whole or not at all: a later run reuses it
    if task.label.startswith("learned"):  # a learned table has no rows past L: tile it (1x is unchanged)
        tile_learned_table(model, max(settings.factors) * settings.length)
    row = measure(model, tokenizer, heldout, settings)
    profile = bias_profile(model, settings.length)
    if profile is not None:
        row["bias_profile"] = profile
    row["final_loss"] = statistics.mean(losses[-20:])
    row["steps"], row["decay_start"] = plan.total_steps, plan.decay_start
    row["seed"], row["seconds"] = task.seed, time.time() - started
    if curve:
        row["probe"] = curve
    return row


def extend_and_measure(settings: Settings, task: Task, device: str, state_dir: Path,
                       text: str | None = None) -> tuple[dict, dict]:
    """The seed's trained RoPE model extended with ``task.method``: measured zero-shot, fine-tuned, measured again."""
    tokenizer = byte_tokenizer()
    train_ids, heldout = corpus_split(tokenizer, text)
    started = time.time()
    model = build_model(settings, "rope", task.seed, device)
    model.load_state_dict(torch.load(state_dir / f"rope-seed{task.seed}.pt", map_location=device, weights_only=True))
    extend_rope(model, task.method, settings).eval()
    zero_shot = measure(model, tokenizer, heldout, settings)
    data = batches(tokenizer, train_ids, settings.extend_factor * settings.length, settings.finetune_batch,
                   settings.synthetic, task.seed + 1000, settings.passkey_share)
    train(model, data, settings.finetune_steps, settings.finetune_lr, f"fine-tune {task.method}")
    tuned = measure(model, tokenizer, heldout, settings)
    zero_shot["seed"] = tuned["seed"] = task.seed
    tuned["seconds"] = time.time() - started
    return zero_shot, tuned


def _do(settings: Settings, task: Task, device: str, probe_every: int, state_dir: Path,
        threads: int | None = None, text: str | None = None) -> tuple[Task, list[dict]]:
    """A worker's entry point (top level, so a spawned process can import it); ``threads``: its share of the
    machine's threads (a spawned process would take them all); ``text``: the corpus (None: this Python's topics)."""
    if threads is not None:
        torch.set_num_threads(threads)
    if task.method is None:
        return task, [train_and_measure(settings, task, device, probe_every, state_dir, text)]
    return task, list(extend_and_measure(settings, task, device, state_dir, text))


def worker_threads(device: str, jobs: int) -> int:
    """Threads for each of ``jobs`` workers: one on a GPU (it does the arithmetic), this process's threads split
    between them on the CPU. A spawned worker would otherwise take every core: two workers of two threads on two
    cores trained 7-10x slower per step than one (0.77-1.0 s against 0.078-0.114 s, p-RoPE and FIRE, L = 256)."""
    if device != "cpu":
        return 1
    return max(1, torch.get_num_threads() // max(1, jobs))


def run(
    settings: Settings,
    schemes: tuple[str, ...],
    scalings: tuple[str, ...],
    log: Callable[[str], None],
    partial: Path | None = None,
    device: str = "cpu",
    jobs: int = 1,
    probe_every: int = 0,
    text: str | None = None,
    command: str = "",
    worker: Callable = _do,
) -> dict:
    """Every (run, seed), then every (RoPE scaling, seed) once that seed's RoPE model is trained; ``jobs`` > 1 runs
    that many tasks at once in spawned processes (tiny models leave a GPU mostly idle). Rows come out in a fixed
    order whatever the order the tasks finish in. ``partial`` gets what has finished after each task, with the
    corpus fingerprint and versions, so that a run stopped early still merges with ``--report``."""
    import tempfile
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    started = time.time()
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
    results: dict = {"settings": dataclasses.asdict(settings), "runs": {}, "command": command,
                     "corpus": corpus_fingerprint(text),
                     "versions": {"torch": torch.__version__, "python": sys.version.split()[0],
                                  "threads": torch.get_num_threads(), "device": name, "jobs": jobs}}
    done: dict[tuple[str, int], dict] = {}
    order = [(label, seed) for label in schemes for seed in settings.seeds]
    scaled = [label for method in scalings for label in (f"rope+{method} (zero-shot)", f"rope+{method} (fine-tuned)")]
    order += [(label, seed) for label in scaled for seed in settings.seeds] if "rope" in schemes else []

    def record(task: Task, rows: list[dict]) -> None:
        labels = [task.label] if task.method is None else [
            f"rope+{task.method} (zero-shot)", f"rope+{task.method} (fine-tuned)"]
        for label, row in zip(labels, rows, strict=True):
            done[(label, task.seed)] = row
            summary = ", ".join(f"{f}x {row['windows'][f]:.2f}/{row['passkey'][f]:.0%}" for f in settings.factors)
            log(f"  {label:28s} seed {task.seed}: ppl/passkey {summary}")
        results["runs"] = {}
        results["settings"]["seeds"] = sorted({seed for _, seed in done})  # what the results hold so far
        for label, seed in order:
            if (label, seed) in done:
                results["runs"].setdefault(label, []).append(done[(label, seed)])
        results["seconds"] = time.time() - started
        if partial is not None:  # keep what finished if a later run fails or the run is stopped
            write_file_atomic(partial, json.dumps(results, indent=2))

    def follow_ups(task: Task) -> list[Task]:
        return [Task("rope", task.seed, m) for m in scalings] if task.label == "rope" and task.method is None else []

    tasks = [Task(label, seed) for seed in settings.seeds for label in schemes]
    with tempfile.TemporaryDirectory() as state_dir:
        if jobs <= 1:
            while tasks:
                task = tasks.pop(0)
                record(*worker(settings, task, device, probe_every, Path(state_dir), None, text))
                tasks[:0] = follow_ups(task)
            return results
        import multiprocessing

        threads = worker_threads(device, jobs)
        failures: list[str] = []
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            def submit(task: Task):
                future = pool.submit(worker, settings, task, device, probe_every, Path(state_dir), threads, text)
                future.task = task  # which task a failed future was
                return future

            pending = {submit(t) for t in tasks}
            while pending:
                finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                for future in finished:
                    try:
                        task, rows = future.result()
                    except Exception as error:  # noqa: BLE001 -- said below, after the other runs are kept
                        failures.append(f"{future.task.label} seed {future.task.seed}: {error}")
                        for waiting in pending:  # runs not started are dropped; running ones finish and are kept
                            waiting.cancel()
                        continue
                    record(task, rows)
                    if not failures:
                        pending |= {submit(t) for t in follow_ups(task)}
                pending = {future for future in pending if not future.cancelled()}
        if failures:
            raise TrainingFailed(f"{len(failures)} run(s) failed ({'; '.join(failures)}); the runs that finished are "
                                 "in partial.json")
    return results


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one seed and a small budget (under 15 minutes)")
    runs = available_runs()
    parser.add_argument("--schemes", nargs="+", type=run_label, metavar="RUN",
                        help=f"runs to train (default: all; with --quick: {', '.join(QUICK_RUNS)}): {', '.join(runs)}; "
                             "RUN:key=value[,key=value] passes options to its scheme (e.g. sandwich:dim=32)")
    parser.add_argument("--scalings", nargs="*", choices=SCALINGS,
                        help="RoPE scalings applied to the trained RoPE run (default: all; none without a value)")
    parser.add_argument("--steps", type=int, help="override the training steps")
    parser.add_argument("--finetune-steps", type=int, help="override the fine-tuning steps of the RoPE scalings")
    parser.add_argument("--seeds", type=int, nargs="+", help="override the seeds")
    parser.add_argument("--length", type=int, help="override the training length L")
    parser.add_argument("--trials", type=int, help="override the passkey keys per length and depth")
    parser.add_argument("--lr", type=float, help="override the training learning rate")
    parser.add_argument("--batch", type=int, help="override the training batch size")
    parser.add_argument("--weight-decay", type=float, help="override AdamW's weight decay in training (default 0.01)")
    parser.add_argument("--layers", type=int, help="override the model's decoder layers (Protocol A: 2 to 4)")
    parser.add_argument("--synthetic", type=float, help="override the share of synthetic (passkey/copy) sequences")
    parser.add_argument("--passkey-share", type=float, help="override the passkey share of the synthetic sequences")
    parser.add_argument("--decay-from", type=float, help="override where the learning rate starts to decay (share)")
    parser.add_argument("--until-retrieval", type=int, metavar="MAX_STEPS",
                        help="keep the learning rate up until a probe retrieves (>= 90 %%; needs --probe-every), then "
                             "decay as usual; stop by MAX_STEPS (> --steps) if it never does")
    parser.add_argument("--confirm-retrieval", type=int, metavar="N",
                        help="with --until-retrieval: start the decay only at the N-th probe in a row that retrieves "
                             "(default 1; a probe is 12 trials, so one can retrieve by luck)")
    parser.add_argument("--curriculum", type=float, metavar="SHARE",
                        help="a length curriculum: train on sequences growing from L/4 to L over this share of the "
                             "steps (0: off, the default)")
    parser.add_argument("--device", default="cpu", help="torch device to train and measure on (default cpu)")
    parser.add_argument("--jobs", type=int, default=1, help="tasks run at once in separate processes (GPU: several)")
    parser.add_argument("--probe-every", type=int, default=0,
                        help="measure in-distribution passkey and held-out perplexity every N training steps (the "
                             "learning curves)")
    parser.add_argument("--output-dir", default="outputs/bench_tiny", help="where results.json/.md and the plot go")
    parser.add_argument("--overwrite-output-dir", action="store_true",
                        help="train into an --output-dir that holds an earlier run's results (replacing them)")
    parser.add_argument("--readme", type=Path, help="page (docs/results.md) to refresh between its bench-tiny markers")
    parser.add_argument("--report", type=Path, nargs="+",
                        help="only redraw the table and plot from earlier results.json files (several: runs of other "
                             "seeds with the same settings, merged)")
    parser.add_argument("--split", type=Path, metavar="DIR",
                        help="with --report: instead, write one part per (run, seed) into DIR, named NN_<run>_seed<S>"
                             ".json (NN: the run's place in the full mode), RoPE scalings with their RoPE run")
    parser.add_argument("--corpus-file", type=Path, metavar="FILE",
                        help="read the documentation topics from FILE (written by --write-corpus) instead of this "
                             "Python's pydoc topics, which differ between Python versions: seeds run under another "
                             "Python then read the same text (results carry its fingerprint)")
    parser.add_argument("--write-corpus", type=Path, metavar="FILE",
                        help="only write this Python's documentation topics to FILE (for --corpus-file elsewhere)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.write_corpus is not None:
        return write_corpus_command(args, parser)
    if args.corpus_file is not None and args.report is not None:
        parser.error("--corpus-file is for training runs; --report reads no corpus")
    if args.split is not None and args.report is None:
        parser.error("--split DIR needs --report RESULTS.json (the results to split)")
    if args.report is not None:
        return report_command(args, parser)
    settings, text = training_preflight(args, parser)
    started = time.time()
    out = Path(args.output_dir)
    runs = available_runs()
    schemes = tuple(args.schemes or [r for r in runs if r in QUICK_RUNS or not args.quick])
    scalings = tuple(SCALINGS if args.scalings is None else args.scalings)
    command = shlex.join(["python", "scripts/benchmarks/bench_tiny.py", *(argv if argv is not None else sys.argv[1:])])
    try:
        results = run(settings, schemes, scalings, lambda line: print(line, flush=True), out / "partial.json",
                      args.device, args.jobs, args.probe_every, text, command)
    except (TrainingDiverged, TrainingFailed) as error:
        print(f"bench_tiny: {error}", file=sys.stderr)
        return 1
    results["seconds"] = time.time() - started
    print(report(results, out, args.readme))
    print(f"\n{results['seconds']:.0f} s; wrote {out}/results.json, results.md, bench_tiny.png")
    return 0


def write_corpus_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """--write-corpus FILE, alone: this Python's topics to a new file."""
    if args.report is not None or args.corpus_file is not None:
        parser.error("--write-corpus only writes this Python's topics; run it without --report or --corpus-file")
    if args.write_corpus.exists() or not args.write_corpus.name:
        parser.error(f"--write-corpus {args.write_corpus}: already exists (or names no file); choose a new file "
                     "name, so that no corpus carried from another Python is replaced")
    try:
        print(f"wrote {args.write_corpus} (corpus {write_corpus_file(args.write_corpus)})")
    except OSError as error:
        parser.error(f"--write-corpus {args.write_corpus}: {error}")
    return 0


def report_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """--report RESULTS... [--split DIR]: merge results, then redraw them, or write them as parts."""
    out = Path(args.output_dir)
    if args.split is not None and args.readme is not None:
        parser.error("--split writes parts only; refresh the page with --report PARTS... --readme docs/results.md")
    written = out.resolve() / "results.json"
    if args.split is None and any(path.resolve() == written for path in args.report):
        parser.error(f"--report {written}: is the file this report writes; give another --output-dir")
    check_writable_readme(args.readme, parser)
    merged = merge(load_parts(args.report), dataclasses.asdict(Settings()))
    if args.split is not None:
        for path in write_split(merged, args.split, RUNS):
            print(f"wrote {path}")
        return 0
    print(report(merged, out, args.readme))
    return 0


def training_preflight(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[Settings, str | None]:
    """Everything a training run can be refused for, found before it trains (hours in the full mode): settings,
    the corpus, the device, where results go. Returns the settings and the corpus text (None: this Python's)."""
    try:
        text = None if args.corpus_file is None else read_corpus_file(args.corpus_file)
    except ValueError as error:
        parser.error(str(error))
    settings = dataclasses.replace(QUICK if args.quick else FULL)
    for name in ("steps", "finetune_steps", "length", "trials", "lr", "weight_decay", "batch", "layers", "synthetic",
                 "passkey_share", "decay_from", "until_retrieval", "confirm_retrieval", "curriculum"):
        if getattr(args, name) is not None:
            setattr(settings, name, getattr(args, name))
    if args.seeds:
        settings.seeds = tuple(args.seeds)
    problem = settings_problem(settings, args)
    if problem:
        parser.error(problem)
    if args.scalings and args.schemes and "rope" not in args.schemes:
        parser.error(f"--scalings {' '.join(args.scalings)}: the scalings extend the trained RoPE run; add rope to "
                     "--schemes, or leave --scalings empty")
    try:
        device = torch.device(args.device)
    except RuntimeError as error:
        parser.error(f"--device {args.device}: {error}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device here; use --device cpu")
    _, heldout = corpus_split(byte_tokenizer(), text)
    needed = max(settings.factors) * settings.length
    if heldout.numel() < needed:
        longest = heldout.numel() // max(settings.factors)
        parser.error(f"--length {settings.length}: the held-out text ({heldout.numel():,} tokens) holds no window "
                     f"of {max(settings.factors)}x L = {needed:,} tokens; choose --length {longest} or less")
    out = Path(args.output_dir)
    earlier = [name for name in ("partial.json", "results.json") if (out / name).exists()]
    if earlier and not args.overwrite_output_dir:
        parser.error(f"--output-dir {out}: holds an earlier run's {' and '.join(earlier)}; choose another "
                     "--output-dir, or pass --overwrite-output-dir to replace them")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        parser.error(f"--output-dir {out}: cannot make it ({error})")
    if not out.is_dir():
        parser.error(f"--output-dir {out}: is not a directory")
    check_writable_readme(args.readme, parser)
    return settings, text


if __name__ == "__main__":
    raise SystemExit(main())
