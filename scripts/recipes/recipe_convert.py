"""Convert SmolLM2-135M from RoPE to another position scheme and recover with a short fine-tune;
held-out perplexity against training steps for each variant (objective, LoRA or full), measured.

Variants (``--variants`` picks some; default: all):
- ``alibi-plain-lora``, ``alibi-distill-lora``, ``alibi-plain-full``: ALiBi (Press et al. 2022), the causal-LM
  objective or distillation from the unswapped original (KL at temperature 2, mixed half and half with the plain
  loss: Hinton et al. 2015), LoRA or every weight;
- ``none-plain-lora``: no positions at all, "drop the positions after pretraining, then recalibrate" (DroPE,
  SakanaAI/DroPE); causal attention alone tells the tokens' order;
- ``nope-interleaved-plain-lora``: SmolLM3's layout (``ps.smollm3_nope``): every fourth layer without positions,
  the others keep the model's own RoPE.

Every number is on text the fine-tune did not see:
- the curve: the held-out blocks of the packed training files (the last ``eval_blocks`` blocks of seq_len tokens,
  ``FinetuneConfig.eval_fraction``), measured every ``eval_every`` steps by the trainer, and before training;
- after training (reloaded from the saved checkpoint): perplexity of the first 2,048 tokens of the reference text
  (typing.py + argparse.py + tarfile.py; docs/benchmarks.md) and of the tokens 8,192-10,239 of one 10,240-token
  forward over it (past SmolLM2's trained length), against the native model on the same text.

    python scripts/recipes/recipe_convert.py           # full mode (SmolLM2; see FULL for the settings and the budget)
    python scripts/recipes/recipe_convert.py --quick   # a tiny LLaMA built from a config, short lengths: < 60 s, for CI

Writes ``scripts/results/recipe_convert.json``, ``.md`` and ``.png`` (``--quick``: under ``--work-dir``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

sys.path.extend(str(Path(__file__).resolve().parents[1] / name) for name in ("recipes", "benchmarks", "maintenance"))

import torch
from readme_section import picture_link, replace_section, shown_path
from recipe_extend import tiny_checkpoint, training_files, window_perplexity
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_posswap as ps
from hf_posswap.evaluation import corpus_text
from hf_posswap.persistence.saving import write_file_atomic
from hf_posswap.progress import is_terminal, library_bars
from hf_posswap.schemes.presets import nope_layers
from hf_posswap.training import FinetuneConfig, finetune
from hf_posswap.training.data import expand_paths, pack, read_documents, train_eval_split

ROOT = Path(__file__).resolve().parents[2]
TARGET_RATIO = 1.10  # the target: within 10 % of the native perplexity at 2,048 tokens
MAX_GUESS = 100_000  # a fitted step count beyond this is reported as out of reach, not as a number


@dataclasses.dataclass(frozen=True)
class Settings:
    steps: int
    seq_len: int
    batch_size: int
    lr_lora: float
    lr_full: float
    warmup_steps: int
    lora_r: int
    lora_alpha: int
    eval_every: int
    eval_blocks: int  # held-out blocks of seq_len tokens for the curve
    short: int  # perplexity of the first `short` reference tokens ...
    long_window: int  # ... and of the last `long_scored` predictions of one `long_window` forward
    long_scored: int
    nope_interval: int  # the NoPE-interleaved preset's interval
    chars_per_token: float  # to choose enough training files (SmolLM2 3.9 on stdlib code; bytes 1.0)


# Budget (2 CPU cores): a LoRA step at seq 2,048 (batch 1) took 15 s on idle cores in recipe_extend.py; a full step
# is dearer (AdamW over 135M weights), a distillation step adds the teacher's forward. Per variant 20 steps of
# training (~5-8 min), 5 curve points x 2 blocks, the two reference forwards (2,048 and 10,240 tokens) and saving:
# ~7-10 min; the five variants ~40 min. The curves are short: `steps_to_target` extrapolates them.
FULL = Settings(steps=20, seq_len=2048, batch_size=1, lr_lora=5e-4, lr_full=1e-4, warmup_steps=2, lora_r=16,
                lora_alpha=32, eval_every=5, eval_blocks=2, short=2048, long_window=10_240, long_scored=2048,
                nope_interval=4, chars_per_token=3.9)
QUICK = Settings(steps=4, seq_len=64, batch_size=2, lr_lora=1e-3, lr_full=1e-3, warmup_steps=0, lora_r=4,
                 lora_alpha=8, eval_every=2, eval_blocks=2, short=128, long_window=512, long_scored=128,
                 nope_interval=2, chars_per_token=1.0)


@dataclasses.dataclass(frozen=True)
class Variant:
    scheme: str
    scheme_options: dict
    lora: bool
    distill: bool = False

    def finetune_options(self, settings: Settings) -> dict:
        options = {"scheme": self.scheme, "scheme_options": self.scheme_options, "lora": self.lora,
                   "lr": settings.lr_lora if self.lora else settings.lr_full}
        if self.lora:
            options.update(lora_r=settings.lora_r, lora_alpha=settings.lora_alpha, merge_lora=True)
        if self.distill:
            options.update(distill=True, distill_weight=0.5, distill_temperature=2.0)
        return options


def variants(num_layers: int, settings: Settings) -> dict[str, Variant]:
    nope = nope_layers(num_layers, settings.nope_interval)
    return {
        "alibi-plain-lora": Variant("alibi", {}, lora=True),
        "alibi-distill-lora": Variant("alibi", {}, lora=True, distill=True),
        "alibi-plain-full": Variant("alibi", {}, lora=False),
        "none-plain-lora": Variant("none", {}, lora=True),
        "nope-interleaved-plain-lora": Variant("layer_mix", {"default": "rope", "overrides": {"none": nope}},
                                               lora=True),
    }


def held_out_blocks(files: list[Path], tokenizer, settings: Settings) -> tuple[torch.Tensor, float]:
    """The trainer's held-out blocks [eval_blocks, seq_len] and the ``eval_fraction`` that makes them so."""
    ids = pack(read_documents(expand_paths([str(path) for path in files])), tokenizer, settings.seq_len)
    blocks = len(ids) // settings.seq_len
    fraction = (settings.eval_blocks + 0.5) / blocks  # int(blocks * fraction) == eval_blocks
    _, held = train_eval_split(ids, settings.seq_len, fraction)
    return held.blocks, fraction


@torch.no_grad()
def blocks_perplexity(model, blocks: torch.Tensor) -> float:
    """exp(mean next-token loss) over the blocks [N, seq_len], as the trainer's evaluation."""
    model.eval()
    return math.exp(sum(model(input_ids=row[None], labels=row[None]).loss.item() for row in blocks) / len(blocks))


def reference_numbers(model, reference: torch.Tensor, settings: Settings) -> dict:
    return {"short": window_perplexity(model, reference, settings.short, settings.short - 1),
            "long": window_perplexity(model, reference, settings.long_window, settings.long_scored)}


def run_variant(name: str, variant: Variant, base: Path, files: list[Path], fraction: float, blocks: torch.Tensor,
                reference: torch.Tensor, settings: Settings, work: Path) -> dict:
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    ps.swap(model, variant.scheme, **variant.scheme_options)
    curve = [(0, blocks_perplexity(model, blocks))]
    del model
    output = work / name
    started = time.perf_counter()
    config = FinetuneConfig(model=str(base), data=[str(path) for path in files], output=str(output),
                            seq_len=settings.seq_len, batch_size=settings.batch_size, steps=settings.steps,
                            warmup_steps=settings.warmup_steps, eval_fraction=fraction,
                            eval_every=settings.eval_every, save_every=0, overwrite_output_dir=True,
                            **variant.finetune_options(settings))
    result = finetune(config)
    seconds = time.perf_counter() - started
    log = [json.loads(line) for line in (output / "loss_log.jsonl").read_text(encoding="utf-8").splitlines()]
    curve += [(record["step"], math.exp(record["eval_loss"])) for record in log if "eval_loss" in record]
    reloaded = AutoModelForCausalLM.from_pretrained(output / ("merged" if variant.lora else "final"),
                                                    dtype=torch.float32)
    row = {"variant": name, "options": variant.finetune_options(settings), "curve": curve,
           "train_seconds": round(seconds, 1), "seconds_per_step": round(seconds / max(result["steps"], 1), 1),
           "reference": reference_numbers(reloaded, reference, settings)}
    print(f"{name}: curve {[(step, round(value, 2)) for step, value in curve]}, reference "
          f"{ {key: round(value, 2) for key, value in row['reference'].items()} } ({seconds:.0f} s training)",
          flush=True)
    return row


def steps_to_target(curve: list[tuple[int, float]], native: float, seconds_per_step: float) -> dict | None:
    """Extrapolate the curve's last points to the 10 % target: the excess loss log(ppl / native) fitted as a power
    law a * step^-b through the trained points (least squares in log-log). A guess to size the budget; ``None``
    when the fit does not fall."""
    points = [(step, math.log(value / native)) for step, value in curve if step > 0 and value > native]
    if len(points) < 2:
        return None
    xs, ys = [math.log(step) for step, _ in points], [math.log(excess) for _, excess in points]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    if slope >= 0:
        return None
    steps = math.exp(mean_x + (math.log(math.log(TARGET_RATIO)) - mean_y) / slope)
    return {"steps": round(steps), "cpu_hours": round(steps * seconds_per_step / 3600, 1), "power": round(-slope, 3)}


def markdown(results: dict) -> str:
    settings, native = results["settings"], results["native"]
    lines = [f"| variant | held-out perplexity (seq {settings['seq_len']:,}) by step | first {settings['short']:,} "
             f"tokens | tokens {settings['long_window'] - settings['long_scored']:,}-{settings['long_window'] - 1:,} "
             "| s/step | 10 % target (extrapolated) |", "|---|---|---|---|---|---|",
             f"| native (RoPE) | {native['blocks']:.2f} | {native['short']:.2f} | {native['long']:,.2f} | | |"]
    for row in results["rows"]:
        curve = ", ".join(f"{step}: {value:,.2f}" for step, value in row["curve"])
        guess = row["extrapolated"]
        target = ("met" if row["reference"]["short"] <= TARGET_RATIO * native["short"] else
                  f"~{guess['steps']:,} steps, ~{guess['cpu_hours']} CPU h" if guess and guess["steps"] <= MAX_GUESS
                  else "out of reach: the curve flattens (fit > 100,000 steps)" if guess else "no fall to fit")
        lines.append(f"| {row['variant']} | {curve} | {row['reference']['short']:.2f} | "
                     f"{row['reference']['long']:,.2f} | {row['seconds_per_step']} | {target} |")
    lines += ["", f"Settings: {settings['steps']} steps x {settings['batch_size']} x {settings['seq_len']:,} tokens, "
              f"lr {settings['lr_lora']:g} (LoRA r {settings['lora_r']}) / {settings['lr_full']:g} (full), "
              f"{settings['warmup_steps']} warm-up steps, cosine; training split {results['split']}; "
              f"total {results['seconds'] / 60:.0f} min on {results['threads']} threads."]
    return "\n".join(lines) + "\n"


def readme_body(results: dict, results_path: Path, readme: Path) -> str:
    """The page's section: the command, the table, the curves."""
    picture = picture_link(results_path.with_suffix(".png"), readme)
    command = "python scripts/recipes/recipe_convert.py" + (" --quick" if results["mode"] == "quick" else "")
    return (f"`{command} --readme {shown_path(readme)}` ({results['seconds'] / 60:.0f} min on {results['threads']} CPU "
            f"threads, torch {torch.__version__}):\n\n{markdown(results)}\n![held-out perplexity against training "
            f"steps]({picture})\n")


def plot(results: dict, path: Path) -> None:
    from hf_posswap.evaluation.plots import _plain_value_axis, _pyplot, _save

    figure, axis = _pyplot().subplots(figsize=(7, 4.2))
    for row in results["rows"]:
        steps, values = zip(*row["curve"], strict=True)
        axis.plot(steps, values, marker="o", label=row["variant"])
    native = results["native"]["blocks"]
    axis.axhline(native, color="black", linestyle="--", label=f"native RoPE ({native:.2f})")
    axis.axhline(TARGET_RATIO * native, color="grey", linestyle=":", label="native + 10 %")
    values = [value for row in results["rows"] for _, value in row["curve"]] + [native, TARGET_RATIO * native]
    _plain_value_axis(axis, min(values), max(values))
    axis.set_xlabel("training steps")
    axis.set_ylabel(f"held-out perplexity (blocks of {results['settings']['seq_len']:,} tokens)")
    axis.set_title("Converting SmolLM2 away from RoPE: recovery" if results["mode"] == "full"
                   else "recipe_convert --quick (tiny model)")
    axis.legend(fontsize=8)
    _save(figure, path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny LLaMA from a config, short lengths (< 60 s)")
    parser.add_argument("--variants", help="comma-separated names (default: all; see the module docstring)")
    parser.add_argument("--work-dir", type=Path, help="runs go here (default: outputs/recipe_convert[_quick])")
    parser.add_argument("--results", type=Path, help="JSON results (default: scripts/results/recipe_convert.json; "
                        "--quick: <work-dir>/recipe_convert.json); the table (.md) and curves (.png) go beside it")
    parser.add_argument("--readme", type=Path,
                        help="page (docs/results.md) to refresh between <!-- recipe-convert:start/end --> markers")
    return parser.parse_args(argv)


def chosen_variants(names: str | None) -> list[str]:
    known = list(variants(4, QUICK))
    chosen = names.split(",") if names else known
    unknown = [name for name in chosen if name not in known]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; choose from {', '.join(known)} (comma-separated)")
    return chosen


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    chosen_variants(args.variants)  # before any loading
    settings = QUICK if args.quick else FULL
    work = args.work_dir or ROOT / "outputs" / ("recipe_convert_quick" if args.quick else "recipe_convert")
    results_path = args.results or (work / "recipe_convert.json" if args.quick
                                    else ROOT / "scripts" / "results" / "recipe_convert.json")
    work.mkdir(parents=True, exist_ok=True)
    if args.quick:
        base = tiny_checkpoint(work / "base")
    else:
        from hf_posswap.persistence.offline_checkpoints import smollm2_dir

        base = smollm2_dir()
    with library_bars(is_terminal(sys.stderr)):
        return run(args, settings, base, work, results_path)


def run(args: argparse.Namespace, settings: Settings, base: Path, work: Path, results_path: Path) -> dict:
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    table = variants(model.config.num_hidden_layers, settings)
    chosen = chosen_variants(args.variants)
    files = training_files(settings)  # duck-typed: steps, seq_len, batch_size, chars_per_token
    blocks, fraction = held_out_blocks(files, tokenizer, settings)
    reference = torch.tensor(tokenizer(corpus_text("reference"))["input_ids"])
    native = {"blocks": blocks_perplexity(model, blocks), **reference_numbers(model, reference, settings)}
    del model
    print(f"native: held-out {native['blocks']:.2f}, first {settings.short} {native['short']:.2f}, "
          f"past the trained length {native['long']:,.2f}", flush=True)
    results = {"mode": "quick" if args.quick else "full", "model": str(base), "settings": dataclasses.asdict(settings),
               "split": f"{files[0].name} .. {files[-1].name} ({len(files)} stdlib files, sorted, no '_' names, "
               "without the reference files)", "native": native, "rows": [], "threads": torch.get_num_threads()}
    for name in chosen:
        row = run_variant(name, table[name], base, files, fraction, blocks, reference, settings, work)
        row["extrapolated"] = steps_to_target(row["curve"], native["blocks"], row["seconds_per_step"])
        results["rows"].append(row)
        results["seconds"] = round(time.perf_counter() - started, 1)
        write_file_atomic(results_path, json.dumps(results, indent=2) + "\n")  # after every variant
    write_file_atomic(results_path.with_suffix(".md"), markdown(results))
    plot(results, results_path.with_suffix(".png"))
    if args.readme:
        replace_section(args.readme, "recipe-convert", readme_body(results, results_path, args.readme))
    print(markdown(results))
    print(f"wrote {results_path} and its .md / .png ({results['seconds']:.0f} s)")
    return results


if __name__ == "__main__":
    main()
