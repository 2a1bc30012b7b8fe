"""Extend SmolLM2-135M from 8,192 to 32,768 tokens with YaRN and fine-tune it briefly with PoSE
(LoRA), in one command (``hf-posswap extend --train``), then measure it against the native and the zero-shot model.

Protocol (docs/benchmarks.md; every number on text the fine-tune did not see):
- reference window: typing.py + argparse.py + tarfile.py, ``tokenizer(text)``, first 16,384 tokens, one forward,
  perplexity of the last 4,096 predictions (native 466, zero-shot YaRN 5.29; target after training <= 5.0);
- inside the trained length: the first 4,096 tokens of the same text, one forward, perplexity of every prediction
  (native 8.57, zero-shot YaRN 9.37; target <= 1.02 x native);
- passkey retrieval (``hf_posswap.evaluation.passkey_accuracy``) at 8,192 and 16,384 tokens, before and after;
- training split: the standard library's top-level modules in sorted order (names not starting with "_"), without
  the three reference files, as many as the training tokens need. The passkey filler is synthetic.

    python scripts/recipes/recipe_extend.py            # full mode (SmolLM2; see FULL for the settings and the budget)
    python scripts/recipes/recipe_extend.py --quick    # a tiny LLaMA built from a config, short lengths: < 60 s, for CI

Writes ``scripts/results/recipe_extend.json`` and ``.md`` (``--quick``: under ``--work-dir``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_posswap as ps
from hf_posswap.cli.main import main as hf_posswap_cli
from hf_posswap.evaluation import corpus_text, passkey_accuracy
from hf_posswap.evaluation.corpora import REFERENCE_FILES
from hf_posswap.persistence.saving import write_file_atomic
from hf_posswap.progress import is_terminal, library_bars

sys.path.extend(str(Path(__file__).resolve().parents[1] / name) for name in ("recipes", "benchmarks", "maintenance"))
from readme_section import replace_section, shown_path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TARGET_WINDOW, TARGET_INSIDE_RATIO = 5.0, 1.02  # the targets: window <= 5.0; inside <= 1.02 x native


@dataclasses.dataclass(frozen=True)
class Settings:
    to: int  # extended length
    steps: int
    seq_len: int
    batch_size: int
    lr: float
    warmup_steps: int
    lora_r: int
    lora_alpha: int
    window: int  # reference window (tokens of one forward) ...
    tail: int  # ... scored on its last `tail` predictions
    inside: int  # perplexity of the first `inside` tokens (inside the trained length)
    passkey_lengths: tuple[int, ...]
    depths: tuple[float, ...]
    trials: int
    chars_per_token: float  # to choose enough training files (measured: SmolLM2 3.9 on stdlib code; bytes 1.0)


# Budget (2 CPU cores): one training step at seq 2,048 (LoRA r 16, batch 1, PoSE) measured 15 s on idle cores
# (141 s on a machine shared with a test run). 144 steps = 295k training tokens: ~36 minutes plus ~1 minute of
# loading, packing, merging and saving -- inside the 45 minutes the recipe is meant to take. The evaluation is
# extra: per model one 4k and one 16k forward, 3 passkey prompts (depths 0, 0.5, 1) at 8k and 3 at 16k (native: 8k
# only), ~30 minutes for the three models on idle cores (--skip-native saves ~5).
FULL = Settings(to=32_768, steps=144, seq_len=2048, batch_size=1, lr=3e-4, warmup_steps=14, lora_r=16, lora_alpha=32,
                window=16_384, tail=4096, inside=4096, passkey_lengths=(8192, 16_384), depths=(0.0, 0.5, 1.0),
                trials=1, chars_per_token=3.9)
QUICK = Settings(to=1024, steps=3, seq_len=64, batch_size=2, lr=1e-3, warmup_steps=0, lora_r=4, lora_alpha=8,
                 window=512, tail=128, inside=128, passkey_lengths=(256, 512), depths=(0.5,), trials=1,
                 chars_per_token=1.0)
QUICK_TRAINED = 256  # the tiny model's trained length (factor 4, as SmolLM2's 8,192 -> 32,768)


def tiny_checkpoint(directory: Path) -> Path:
    """A LLaMA built from a config (2 layers, hidden 64, trained length 256) with the byte tokenizer, saved."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_posswap.evaluation import BYTE_VOCAB_SIZE, byte_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=BYTE_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=QUICK_TRAINED,
                         rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
                         eos_token_id=BYTE_VOCAB_SIZE - 3, bos_token_id=BYTE_VOCAB_SIZE - 3,
                         pad_token_id=BYTE_VOCAB_SIZE - 1)
    LlamaForCausalLM(config).save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return directory


def training_files(settings: Settings) -> list[Path]:
    """The training split: stdlib top-level modules in sorted order (no "_" names, no reference file), enough for
    the run's tokens with a quarter to spare."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    needed = settings.steps * settings.seq_len * settings.batch_size * settings.chars_per_token * 1.25
    files, chars = [], 0
    for path in sorted(stdlib.glob("*.py")):
        if path.name.startswith("_") or path.name in REFERENCE_FILES:
            continue
        files.append(path)
        chars += path.stat().st_size
        if chars >= needed:
            break
    return files


def train(model_dir: Path, output: Path, settings: Settings, files: list[Path], resume: bool) -> dict:
    """``hf-posswap extend --train`` (the command under test); returns its run's result.json. With ``resume`` a
    finished run is reused as it is (only the evaluation is run again)."""
    finished = output / "training" / "result.json"
    if resume and finished.is_file():
        print(f"reusing the finished training run in {output}", flush=True)
        return json.loads(finished.read_text(encoding="utf-8"))
    argv = ["extend", "--model", str(model_dir), "--to", str(settings.to), "--method", "yarn", "--train",
            "--data", *map(str, files), "--steps", str(settings.steps), "--seq-len", str(settings.seq_len),
            "--batch-size", str(settings.batch_size), "--lr", str(settings.lr), "--warmup-steps",
            str(settings.warmup_steps), "--lora-r", str(settings.lora_r), "--lora-alpha", str(settings.lora_alpha),
            "--output", str(output), "--resume" if resume else "--overwrite"]
    print("hf-posswap " + " ".join(argv), flush=True)
    status = hf_posswap_cli(argv)
    if status != 0:
        raise SystemExit(f"hf-posswap extend --train failed with exit status {status}")
    return json.loads((output / "training" / "result.json").read_text(encoding="utf-8"))


@torch.no_grad()
def window_perplexity(model, ids: torch.Tensor, length: int, scored: int) -> float:
    """One forward over ids[:length]; exp(mean NLL) of its last ``scored`` next-token predictions."""
    window = ids[None, :length]  # [1, length]
    logits = model(input_ids=window, logits_to_keep=scored + 1).logits[0, :-1].float()  # [scored, vocab]
    return math.exp(torch.nn.functional.cross_entropy(logits, window[0, -scored:]).item())


def measure(label: str, model, tokenizer, ids: torch.Tensor, settings: Settings) -> dict:
    """The protocol's numbers for one model; passkey lengths past a model's length are not run (``None``)."""
    model.eval()
    limit = int(model.config.max_position_embeddings)
    row: dict = {"model": label, "max_position_embeddings": limit}
    started = time.perf_counter()
    row["inside_perplexity"] = window_perplexity(model, ids, settings.inside, settings.inside - 1)
    row["window_perplexity"] = window_perplexity(model, ids, settings.window, settings.tail)
    row["passkey"] = {}
    for length in settings.passkey_lengths:
        if length > limit:
            row["passkey"][str(length)] = None
            continue
        results = [passkey_accuracy(model, tokenizer, length, depth, settings.trials) for depth in settings.depths]
        row["passkey"][str(length)] = {"accuracy": sum(r.accuracy for r in results) / len(results),
                                       "by_depth": {str(r.depth): r.accuracy for r in results}}
    row["seconds"] = round(time.perf_counter() - started, 1)
    print(f"{label}: inside {row['inside_perplexity']:.2f}, window {row['window_perplexity']:.2f}, passkey "
          f"{ {k: (v['accuracy'] if v else None) for k, v in row['passkey'].items()} } ({row['seconds']:.0f} s)",
          flush=True)
    return row


RELOAD_PROBE = """
import sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
ids = torch.arange(int(sys.argv[2]))[None] % model.config.vocab_size
with torch.no_grad():
    torch.save(model(input_ids=ids).logits, sys.argv[3])
assert not any(name.startswith("hf_posswap") for name in sys.modules), "hf_posswap was imported"
print(type(model).__name__, model.config.rope_parameters)
"""


def reloads_without_hf_posswap(output: Path, model, probe_length: int, scratch: Path) -> dict:
    """Load ``output`` in a fresh interpreter that never imports hf_posswap; its logits against ``model``'s."""
    logits_file = scratch / "vanilla_logits.pt"
    process = subprocess.run([sys.executable, "-c", RELOAD_PROBE, str(output), str(probe_length), str(logits_file)],
                             capture_output=True, text=True, timeout=600)
    if process.returncode != 0:
        return {"ok": False, "error": process.stderr.strip().splitlines()[-1:]}
    ids = torch.arange(probe_length)[None] % model.config.vocab_size
    with torch.no_grad():
        ours = model(input_ids=ids).logits
    difference = float((torch.load(logits_file) - ours).abs().max())
    return {"ok": difference < 1e-4, "max_abs_logit_difference": difference, "loaded_as": process.stdout.strip()}


def fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def markdown(results: dict) -> str:
    settings, rows = results["settings"], results["rows"]
    lengths = [str(length) for length in settings["passkey_lengths"]]
    head = (f"| model | perplexity, first {settings['inside']:,} tokens | reference window (last {settings['tail']:,} "
            f"of {settings['window']:,}) | " + " | ".join(f"passkey {int(n):,}" for n in lengths) + " |")
    lines = [head, "|" + "---|" * (3 + len(lengths))]
    for row in rows:
        keys = [row["passkey"].get(n) for n in lengths]
        cells = [f"{key['accuracy']:.0%}" if key else "n/a (past its length)" for key in keys]
        lines.append(f"| {row['model']} | {fmt(row['inside_perplexity'])} | {fmt(row['window_perplexity'])} | "
                     + " | ".join(cells) + " |")
    training, verdict = results["training"], results["targets"]
    lines += ["", f"Training: {training['steps']} steps x {settings['batch_size']} x {settings['seq_len']:,} tokens = "
              f"{training['tokens']:,} tokens ({training['split']}), {training_time(training)}; "
              f"LoRA r {settings['lora_r']}, lr {settings['lr']:g}, PoSE over {settings['to']:,} positions.",
              f"Targets: reference window <= {TARGET_WINDOW} -> {verdict['window']}; first {settings['inside']:,} "
              f"tokens <= {TARGET_INSIDE_RATIO} x native -> {verdict['inside']} "
              f"(ratio {verdict['inside_ratio']:.3f}). Reloads in plain transformers without hf_posswap: "
              f"{results['reload']['ok']}."]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny LLaMA from a config, short lengths (< 60 s)")
    parser.add_argument("--work-dir", type=Path, help="checkpoints go here (default: outputs/recipe_extend[_quick])")
    parser.add_argument("--results", type=Path, help="JSON results (default: scripts/results/recipe_extend.json; "
                        "--quick: <work-dir>/recipe_extend.json); the markdown table goes beside it (.md)")
    parser.add_argument("--resume", action="store_true", help="continue an interrupted training run in --work-dir")
    parser.add_argument("--skip-native", action="store_true", help="do not measure the native model")
    parser.add_argument("--readme", type=Path,
                        help="page (docs/results.md) to refresh between <!-- recipe-extend:start/end --> markers")
    parser.add_argument("--report", type=Path, metavar="RESULTS_JSON",
                        help="no run: rewrite the table (and --readme) from a finished run's results")
    return parser.parse_args(argv)


def training_time(training: dict) -> str:
    """The training's time per step, over the steps this invocation ran (a resumed run timed only its own part)."""
    first = training.get("first_step", 0)
    ran = max(training["steps"] - first, 1)
    per_step = f"{training['seconds'] / ran:.1f} s per step, including loading and saving"
    if first:
        return f"resumed at step {first}: its last {ran} steps took {training['seconds']:.0f} s ({per_step})"
    return f"{training['seconds']:.0f} s ({per_step})"


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    with library_bars(is_terminal(sys.stderr)):  # transformers' loading bars only on a terminal, not in a log
        return run(args)


def readme_body(results: dict, readme: Path) -> str:
    """The page's section: the command and its table."""
    command = "python scripts/recipes/recipe_extend.py" + (" --quick" if results["mode"] == "quick" else "")
    resumed = " for the resumed part" if results["training"].get("first_step") else ""
    return (f"`{command} --readme {shown_path(readme)}` ({results['seconds'] / 60:.0f} min in all{resumed} on "
            f"{results['threads']} CPU threads, Python {results['python']}):\n\n{markdown(results)}")


def report(args: argparse.Namespace) -> dict:
    """``--report``: the table (.md beside the JSON) and the page's section from a finished run's JSON."""
    results = json.loads(args.report.read_text(encoding="utf-8"))
    write_file_atomic(args.report.with_suffix(".md"), markdown(results))
    if args.readme:
        replace_section(args.readme, "recipe-extend", readme_body(results, args.readme))
    print(markdown(results))
    return results


def run(args: argparse.Namespace) -> dict:
    if args.report:
        return report(args)
    settings = QUICK if args.quick else FULL
    work = args.work_dir or ROOT / "outputs" / ("recipe_extend_quick" if args.quick else "recipe_extend")
    results_path = args.results or (work / "recipe_extend.json" if args.quick
                                    else ROOT / "scripts" / "results" / "recipe_extend.json")
    work.mkdir(parents=True, exist_ok=True)
    results_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if args.quick:
        base = tiny_checkpoint(work / "base")
    else:
        from hf_posswap.persistence.offline_checkpoints import smollm2_dir

        base = smollm2_dir()
    files = training_files(settings)
    output = work / "extended-trained"
    run = train(base, output, settings, files, args.resume)

    tokenizer = AutoTokenizer.from_pretrained(base)
    ids = torch.tensor(tokenizer(corpus_text("reference"))["input_ids"])
    # The trained model first (the number the run is for), then zero-shot, then native; each row is written to
    # <results>.partial.json as soon as it is measured, so an interrupted evaluation keeps what it measured.
    measured: dict[str, dict] = {}
    partial = results_path.with_suffix(".partial.json")

    def record(key: str, row: dict) -> None:
        measured[key] = row
        write_file_atomic(partial, json.dumps({"training": run, "rows": measured}, indent=2) + "\n")

    model = AutoModelForCausalLM.from_pretrained(output, dtype=torch.float32)
    record("trained", measure(f"yarn + PoSE LoRA, {run['steps']} steps", model, tokenizer, ids, settings))
    reload = reloads_without_hf_posswap(output, model, 64, work)
    del model
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    ps.extend_context(model, settings.to, "yarn")
    record("zero_shot", measure("yarn, zero-shot", model, tokenizer, ids, settings))
    del model
    if not args.skip_native:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        record("native", measure("native (no scaling)", model, tokenizer, ids, settings))
    rows = [measured[key] for key in ("native", "zero_shot", "trained") if key in measured]

    native = rows[0] if not args.skip_native else None
    trained_row = rows[-1]
    ratio = trained_row["inside_perplexity"] / native["inside_perplexity"] if native else math.nan
    names = [path.name for path in files]
    results = {
        "mode": "quick" if args.quick else "full",
        "model": str(base),
        "settings": dataclasses.asdict(settings),
        "training": {"steps": run["steps"], "first_step": run.get("first_step", 0),
                     "tokens": run["steps"] * settings.batch_size * settings.seq_len,
                     "seconds": run["train_seconds"], "train_loss": run["train_loss"], "eval_loss": run["eval_loss"],
                     "files": names, "split": f"stdlib top-level modules {names[0]} .. {names[-1]} ({len(names)} "
                     f"files, sorted, no '_' names, without {', '.join(REFERENCE_FILES)})"},
        "rows": rows,
        "targets": {"window": "met" if trained_row["window_perplexity"] <= TARGET_WINDOW else "missed",
                    "inside": "met" if ratio <= TARGET_INSIDE_RATIO else "missed", "inside_ratio": ratio},
        "reload": reload,
        "python": sys.version.split()[0],
        "threads": torch.get_num_threads(),
        "seconds": round(time.perf_counter() - started, 1),
    }
    write_file_atomic(results_path, json.dumps(results, indent=2) + "\n")
    table = markdown(results)
    write_file_atomic(results_path.with_suffix(".md"), table)
    if args.readme:
        replace_section(args.readme, "recipe-extend", readme_body(results, args.readme))
    print(table)
    print(f"wrote {results_path} and {results_path.with_suffix('.md')} ({results['seconds']:.0f} s)")
    return results


if __name__ == "__main__":
    main()
