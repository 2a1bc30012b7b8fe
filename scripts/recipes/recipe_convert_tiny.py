"""The conversion recipe at the scale of Protocol A: convert a RoPE model after training, recalibrate briefly, measure.

A tiny byte-level LLaMA is trained from scratch with RoPE exactly as in bench_tiny's full mode (L = 256, 10,000
steps; docs/benchmarks.md, Protocol A), then swapped to another position scheme with ``hf_posswap.swap`` and
recalibrated at L only, on the same mix of text and synthetic passkey/copy sequences, for a fifth of its
pretraining steps. Each variant is measured before and during the recalibration (in-distribution passkey and
held-out perplexity at L) and after it at 1x-8x L with bench_tiny's evaluation. This is the DroPE recipe (Gelberg
et al. 2026, arXiv 2512.12167: drop the positional embeddings after pretraining, then recalibrate; SakanaAI/DroPE)
at a size a CPU trains in minutes, next to ALiBi and SmolLM3's NoPE-interleaved layout, with the plain causal-LM
objective against distillation from the RoPE model (KL at temperature T, Hinton et al. 2015), and a control: the
RoPE model trained for the same extra steps without a swap. SmolLM2 itself is in ``recipe_convert.py``.

    python scripts/recipes/recipe_convert_tiny.py            # full (seed 2; about 1 h on one CPU thread)
    python scripts/recipes/recipe_convert_tiny.py --quick    # tiny settings, for CI (seconds)
    python scripts/recipes/recipe_convert_tiny.py --readme docs/results.md   # also refresh the section and plot there

Writes ``scripts/results/recipe_convert_tiny.json``, ``.md`` and ``.png`` (``--quick``: under ``--work-dir``).
A rerun reuses the trained RoPE model and the variants already measured in ``--work-dir``.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import shlex
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.extend(str(Path(__file__).resolve().parents[1] / name) for name in ("recipes", "benchmarks", "maintenance"))
import bench_tiny  # noqa: E402
from readme_section import picture_link, replace_section  # noqa: E402

import hf_posswap as ps  # noqa: E402
from hf_posswap.evaluation import byte_tokenizer  # noqa: E402
from hf_posswap.persistence.saving import write_file_atomic  # noqa: E402
from hf_posswap.training.losses import distillation_kl  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TARGET_RATIO = 1.10  # the target: within 10 % of the native perplexity in distribution


@dataclasses.dataclass(frozen=True)
class Settings:
    model: bench_tiny.Settings  # the RoPE model's training and the evaluation, as bench_tiny
    seed: int
    recalibration_steps: int
    recalibration_lr: float
    curve_every: int
    temperature: float  # distillation: KL(teacher || student) at this temperature, times T^2
    distill_weight: float  # ... mixed with the causal-LM loss: (1 - w) * LM + w * KL


FULL = Settings(model=dataclasses.replace(bench_tiny.FULL, seeds=(2,)), seed=2, recalibration_steps=2000,
                recalibration_lr=1e-3, curve_every=250, temperature=2.0, distill_weight=0.5)
QUICK = Settings(model=bench_tiny.Settings(length=16, hidden=32, heads=2, kv_heads=1, steps=8, trials=1,
                                           max_windows=1, factors=(1, 2), depths=(0.5,), seeds=(0,)),
                 seed=0, recalibration_steps=4, recalibration_lr=1e-3, curve_every=2, temperature=2.0,
                 distill_weight=0.5)


@dataclasses.dataclass(frozen=True)
class Variant:
    run: str  # a bench_tiny run label: what the RoPE model is swapped to ("rope": no swap, the control)
    distill: bool = False
    temperature: float | None = None  # distillation's T and w, when not the settings' (the levers of item 2)
    distill_weight: float | None = None


VARIANTS = {
    "rope-continued": Variant("rope"),
    "none-plain": Variant("none"),
    "none-distill": Variant("none", distill=True),
    "alibi-plain": Variant("alibi"),
    "alibi-distill": Variant("alibi", distill=True),
    "alibi-distill-t1": Variant("alibi", distill=True, temperature=1.0),
    "alibi-distill-t4": Variant("alibi", distill=True, temperature=4.0),
    "alibi-distill-w09": Variant("alibi", distill=True, distill_weight=0.9),
    "nope-interleaved-plain": Variant("nope-interleaved"),
}


def convert(model: torch.nn.Module, run: str) -> torch.nn.Module:
    """Swap the trained RoPE model to ``run``'s scheme (bench_tiny's labels; "rope" leaves it as it is)."""
    if run == "nope-interleaved":
        ps.swap(model, ps.smollm3_nope(model, no_rope_layer_interval=2))
    elif run != "rope":
        ps.swap(model, run)
    return model


class Distilled(torch.nn.Module):
    """The student, whose loss mixes its causal-LM loss with distillation from a frozen teacher (Hinton et al. 2015):
    ``(1 - weight) * LM + weight * T^2 KL(teacher_T || student_T)``. The teacher is kept outside the module tree, so
    training, gradient clipping and ``parameters()`` see the student alone."""

    def __init__(self, student: torch.nn.Module, teacher: torch.nn.Module, weight: float, temperature: float) -> None:
        super().__init__()
        self.student = student
        self._teacher = [teacher.eval().requires_grad_(False)]  # a list: not a submodule
        self.weight, self.temperature = weight, temperature

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> SimpleNamespace:
        output = self.student(input_ids=input_ids, labels=labels)
        with torch.no_grad():
            teacher_logits = self._teacher[0](input_ids=input_ids).logits  # [B, L, V]
        kl = distillation_kl(output.logits, teacher_logits, self.temperature)
        return SimpleNamespace(loss=(1 - self.weight) * output.loss + self.weight * kl, logits=output.logits)


def claim_work_dir(work: Path, settings: Settings) -> None:
    """Mark ``work`` as holding runs of ``settings`` on this Python's text; refuse (one line) one that holds runs of
    other settings or text, whose RoPE model and variants would otherwise be reused as if they were these (a
    --quick run's, say)."""
    marker = work / "settings.json"
    wanted = json.dumps({"settings": dataclasses.asdict(settings), "corpus": bench_tiny.corpus_fingerprint()},
                        indent=2, sort_keys=True) + "\n"
    try:
        work.mkdir(parents=True, exist_ok=True)
        found = marker.read_bytes().decode("utf-8") if marker.exists() else None
    except (OSError, UnicodeDecodeError) as error:
        raise SystemExit(f"recipe_convert_tiny: --work-dir {work}: cannot use it ({error})") from None
    if found is not None and found != wanted:
        raise SystemExit(f"recipe_convert_tiny: --work-dir {work} holds runs made with other settings or text "
                         f"({marker}); choose another --work-dir, or remove that one to start again")
    write_file_atomic(marker, wanted)


def read_done(path: Path, needs: tuple[str, ...] = ("windows", "passkey")) -> dict | None:
    """A finished step's record, or None if it is missing, unreadable or not such a record (a run killed while
    writing, a file put there by hand: redo it)."""
    try:
        record = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and all(key in record for key in needs) else None


def loads_state(path: Path) -> bool:
    """Whether ``path`` holds weights torch can read (a truncated file does not)."""
    try:
        torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 -- any failure to read means: train again
        return False
    return True


def rope_model(settings: Settings, work: Path, device: str) -> tuple[Path, dict]:
    """Train the RoPE model as bench_tiny does (or reuse the one in ``work``): its weights and its measurement."""
    state, row_path = work / f"rope-seed{settings.seed}.pt", work / f"rope-seed{settings.seed}.json"
    row = read_done(row_path)
    if row is not None and state.exists() and loads_state(state):  # the record is written after the weights
        return state, row
    row = bench_tiny.train_and_measure(settings.model, bench_tiny.Task("rope", settings.seed), device,
                                       settings.curve_every * 4, work)  # writes rope-seed<S>.pt
    write_file_atomic(row_path, json.dumps(row, indent=2) + "\n")
    return state, row


def distillation(variant: Variant, settings: Settings) -> tuple[float, float]:
    """(weight w, temperature T) of ``variant``'s distillation: its own where it sets them, else the settings'."""
    weight = settings.distill_weight if variant.distill_weight is None else variant.distill_weight
    return weight, settings.temperature if variant.temperature is None else variant.temperature


def run_variant(name: str, settings: Settings, state: Path, data: tuple, device: str) -> dict:
    """Swap, recalibrate at L with probes (passkey, held-out and training perplexity at L), measure at 1x-8x L."""
    tokenizer, train_ids, heldout = data
    started = time.time()
    variant = VARIANTS[name]
    model = bench_tiny.build_model(settings.model, "rope", settings.seed, device)
    model.load_state_dict(torch.load(state, map_location=device, weights_only=True))  # written by bench_tiny
    convert(model, variant.run)
    probe = bench_tiny.make_probe(model, tokenizer, train_ids, heldout, settings.model.length)
    model.eval()
    before = bench_tiny.measure(model, tokenizer, heldout, settings.model)  # the swap alone, zero-shot
    curve = [[0, *probe()]]
    trained: torch.nn.Module = model
    if variant.distill:
        teacher = bench_tiny.build_model(settings.model, "rope", settings.seed, device)
        teacher.load_state_dict(torch.load(state, map_location=device, weights_only=True))
        trained = Distilled(model, teacher, *distillation(variant, settings))
    batches = bench_tiny.batches(tokenizer, train_ids, settings.model.length, settings.model.batch,
                                 settings.model.synthetic, settings.seed + 2000, settings.model.passkey_share)
    _, probes, _ = bench_tiny.train(trained, batches, settings.recalibration_steps, settings.recalibration_lr,
                                    name, probe, settings.curve_every, settings.model.decay_from)
    row = bench_tiny.measure(model, tokenizer, heldout, settings.model)
    row.update(variant=name, run=variant.run, distill=variant.distill, before=before, curve=curve + probes,
               seconds=round(time.time() - started, 1))
    if variant.distill:
        row["distill_weight"], row["temperature"] = distillation(variant, settings)
    return row


def verdict(row: dict, native: dict) -> tuple[bool, bool]:
    """(within 10 % of the native perplexity at 1x, better than the native model at the largest length)."""
    largest = max(native["windows"], key=int)
    return (row["windows"]["1"] <= TARGET_RATIO * native["windows"]["1"],
            row["windows"][largest] < native["windows"][largest])


def markdown(results: dict) -> str:
    settings, native = results["settings"], results["native"]
    model = settings["model"]
    factors = [str(f) for f in model["factors"]]
    head = (f"| variant | swapped, not recalibrated: ppl 1x / {factors[-1]}x, passkey 1x | "
            + " | ".join(f"ppl {f}x" for f in factors) + " | "
            + " | ".join(f"passkey {f}x" for f in factors) + " | within 10 % at 1x | better at "
            + f"{factors[-1]}x |")
    lines = [head, "|---" * (3 + 2 * len(factors)) + "|---|",
             "| native RoPE | | " + " | ".join(f"{native['windows'][f]:.2f}" for f in factors) + " | "
             + " | ".join(f"{100 * native['passkey'][f]:.0f} %" for f in factors) + " | | |"]
    for row in results["rows"]:
        within, better = verdict(row, native)
        before = row["before"]
        lines.append(f"| {row['variant']} | {before['windows']['1']:.2f} / {before['windows'][factors[-1]]:.2f}, "
                     f"{100 * before['passkey']['1']:.0f} % | "
                     + " | ".join(f"{row['windows'][f]:.2f}" for f in factors) + " | "
                     + " | ".join(f"{100 * row['passkey'][f]:.0f} %" for f in factors)
                     + f" | {'yes' if within else 'no'} | {'yes' if better else 'no'} |")
    lines += ["", f"RoPE model: trained from scratch as bench_tiny trains, seed {settings['seed']}, "
              f"L = {model['length']}, {native.get('steps', model['steps'])} steps. Recalibration: "
              f"{settings['recalibration_steps']} steps "
              f"at L ({settings['recalibration_steps'] / model['steps']:.0%} of the pretraining steps; batch "
              f"{model['batch']}, lr {settings['recalibration_lr']:g}, the same text and synthetic mix); distill = "
              f"(1 - {settings['distill_weight']:g}) LM + {settings['distill_weight']:g} KL at T = "
              f"{settings['temperature']:g} from the RoPE model (-t1, -t4: T = 1, 4; -w09: w = 0.9). "
              f"Perplexity on the held-out last 10 % of the topics "
              f"(≤ {model['max_windows']} windows a length); passkey: {model['trials']} keys x "
              f"{len(model['depths'])} depths. "
              f"{results['seconds'] / 60:.0f} min on {results['threads']} CPU threads."]
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    model = results["settings"]["model"]
    factors = model["factors"]
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    native = results["native"]
    for row in results["rows"]:
        steps = [point[0] for point in row["curve"]]
        left.plot(steps, [point[2] for point in row["curve"]], marker="o", label=row["variant"])
        right.plot([f * model["length"] for f in factors], [row["windows"][str(f)] for f in factors], marker="o",
                   label=row["variant"])
    lines = [left.axhline(native["windows"]["1"], color="black", linestyle="--", label="native RoPE"),
             left.axhline(TARGET_RATIO * native["windows"]["1"], color="grey", linestyle=":", label="native + 10 %")]
    left.legend(handles=lines, fontsize=8, loc="upper right")
    right.plot([f * model["length"] for f in factors], [native["windows"][str(f)] for f in factors], "k--",
               marker="s", label="native RoPE")
    left.set(yscale="log", xlabel="recalibration steps", ylabel=f"held-out perplexity at L = {model['length']}",
             title="Recalibration after the swap")
    right.set(xscale="log", yscale="log", xlabel="context length (bytes)", ylabel="perplexity (windows)",
              title="After recalibration: perplexity against length")
    right.set_xscale("log", base=2)
    right.axvline(model["length"], color="grey", linestyle=":", linewidth=1)
    for axis in (left, right):
        axis.grid(True, alpha=0.3)
    right.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    figure.tight_layout()
    picture = io.BytesIO()
    figure.savefig(picture, format="png", dpi=110)
    plt.close(figure)
    write_file_atomic(path, picture.getvalue())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny settings, for CI (seconds)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), help="default: all")
    parser.add_argument("--work-dir", type=Path,
                        help="the RoPE model and finished variants (default: outputs/recipe_convert_tiny[_quick])")
    parser.add_argument("--results", type=Path, help="JSON results (default: scripts/results/recipe_convert_tiny"
                        ".json; --quick: <work-dir>/recipe_convert_tiny.json); .md and .png go beside it")
    parser.add_argument("--readme", type=Path, help="page (docs/results.md) to refresh between its markers")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    return parser.parse_args(argv)


def check_outputs(args: argparse.Namespace, work: Path, results_path: Path) -> None:
    """Refuse, before any training, what would fail or overwrite something at the end: the variants given twice, a
    results path that is a directory, one of the work directory's records or cannot be made, a README without the
    section's markers."""
    if args.variants and len(set(args.variants)) != len(args.variants):
        raise SystemExit(f"recipe_convert_tiny: --variants {' '.join(args.variants)}: a variant is given twice")
    records = {"settings.json", *(f"{name}.json" for name in VARIANTS)}
    record = results_path.resolve().parent == work.resolve() and (
        results_path.name in records or results_path.name.startswith("rope-seed"))
    if results_path.is_dir() or record:
        raise SystemExit(f"recipe_convert_tiny: --results {results_path}: is a directory or one of --work-dir's "
                         "records of the runs; choose another file")
    try:
        results_path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise SystemExit(f"recipe_convert_tiny: --results {results_path}: cannot write there ({error})") from None
    if args.readme is not None:
        try:
            text = args.readme.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise SystemExit(f"recipe_convert_tiny: --readme {args.readme}: cannot read it ({error})") from None
        if "<!-- recipe-convert-tiny:start -->" not in text or "<!-- recipe-convert-tiny:end -->" not in text:
            raise SystemExit(f"recipe_convert_tiny: --readme {args.readme}: has no <!-- recipe-convert-tiny:start/end "
                             "--> markers to write between")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    settings = QUICK if args.quick else FULL
    work = args.work_dir or ROOT / "outputs" / ("recipe_convert_tiny_quick" if args.quick else "recipe_convert_tiny")
    results_path = args.results or (work / "recipe_convert_tiny.json" if args.quick
                                    else ROOT / "scripts" / "results" / "recipe_convert_tiny.json")
    check_outputs(args, work, results_path)
    claim_work_dir(work, settings)
    tokenizer = byte_tokenizer()
    data = (tokenizer, *bench_tiny.corpus_split(tokenizer))
    state, native = rope_model(settings, work, args.device)
    results = {"settings": dataclasses.asdict(settings), "native": native, "rows": [],
               "corpus": bench_tiny.corpus_fingerprint(), "threads": torch.get_num_threads(),
               "command": shlex.join(["python", "scripts/recipes/recipe_convert_tiny.py",
                                      *(argv if argv is not None else sys.argv[1:])])}
    for name in args.variants or list(VARIANTS):
        done = work / f"{name}.json"
        row = read_done(done, ("windows", "passkey", "before", "curve", "seconds")) or run_variant(
            name, settings, state, data, args.device)
        write_file_atomic(done, json.dumps(row, indent=2) + "\n")
        results["rows"].append(row)
        print(f"{name}: ppl " + ", ".join(f"{f}x {v:.2f}" for f, v in row["windows"].items()) + "; passkey "
              + ", ".join(f"{f}x {v:.0%}" for f, v in row["passkey"].items()), flush=True)
    # the compute each part took when it ran (a rerun that reuses them adds only its own reading and drawing)
    results["seconds"] = round(native.get("seconds", 0.0) + sum(row["seconds"] for row in results["rows"]), 1)
    results = json.loads(json.dumps(results))  # one form: per-length keys are strings, as read back
    write_file_atomic(results_path, json.dumps(results, indent=2) + "\n")
    table = markdown(results)
    write_file_atomic(results_path.with_suffix(".md"), table)
    plot(results, results_path.with_suffix(".png"))
    if args.readme is not None:
        picture = picture_link(results_path.with_suffix(".png"), args.readme)
        replace_section(args.readme, "recipe-convert-tiny", f"`{results['command'].strip()}`:\n\n{table}\n"
                        f"![recalibration curves and perplexity against length]({picture})\n")
    print(table)
    return results


if __name__ == "__main__":
    main()
