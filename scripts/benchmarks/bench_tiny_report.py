"""Reporting for ``bench_tiny.py`` (Protocol A): merge the results of runs made for different seeds, write the
markdown table and the plot, refresh the section in docs/results.md. Reads results only (``results.json``), so it
can redraw runs made on another machine; it imports nothing from ``bench_tiny.py``.
"""

from __future__ import annotations

import io
import json
import math
import re
import statistics
import sys
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace

sys.path.extend(str(Path(__file__).resolve().parents[1] / name) for name in ("recipes", "benchmarks", "maintenance"))

from bench_tiny_curves import has_curves, ngram_perplexities, plot_curves
from readme_section import picture_link, project_root, replace_section

from hf_posswap.persistence.saving import write_file_atomic

SCALED_ROWS = ("(zero-shot)", "(fine-tuned)")  # how the rows of the RoPE scalings end


def _cell(values: list[float], fmt: str) -> str:
    """One table cell: the value, or mean ± std over seeds; a value that is not finite (a diverged run) shows as
    such and is never averaged into a number."""
    if not values or not all(math.isfinite(value) for value in values):
        return "not finite ✗"
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(statistics.mean(values), fmt)} ± {format(statistics.stdev(values), fmt)}"


def load_parts(paths: list[Path]) -> list[dict]:
    """Results files for ``--report``, each checked for what the report reads; raises SystemExit with one line
    naming the file and what is wrong with it."""
    parts = []
    for path in paths:
        try:
            part = json.loads(path.read_bytes().decode("utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as error:
            raise SystemExit(f"--report {path}: cannot read it as bench_tiny results ({error})") from None
        if not isinstance(part, dict) or not isinstance(part.get("settings"), dict) or not isinstance(
                part.get("runs"), dict):
            raise SystemExit(f"--report {path}: not bench_tiny results (no 'settings' and 'runs')")
        empty = [label for label, rows in part["runs"].items() if not isinstance(rows, list) or not rows]
        if empty:
            raise SystemExit(f"--report {path}: run {empty[0]!r} has no rows")
        loose = next((label for label, rows in part["runs"].items() for row in rows if not isinstance(row, dict)), None)
        if loose is not None:
            raise SystemExit(f"--report {path}: run {loose!r} has a row that is not an object of measurements")
        bad = next((label for label, rows in part["runs"].items() for row in rows if not _probes_readable(row)), None)
        if bad is not None:
            raise SystemExit(f"--report {path}: run {bad!r} has a row whose 'probe' is not a list of [step, passkey, "
                             "held-out ppl, training ppl]")
        if "parts" in part and not _provenance_readable(part["parts"]):
            raise SystemExit(f"--report {path}: its 'parts' is not a list of objects with 'seeds' (a list) and "
                             "'versions' (an object), as a merge writes it; restore the file from the merge")
        parts.append(part)
    return parts


def _provenance_readable(entries: object) -> bool:
    """A merge's ``parts``: a non-empty list of {seeds: [...], versions: {...}, ...}."""
    return isinstance(entries, list) and bool(entries) and all(
        isinstance(entry, dict) and isinstance(entry.get("seeds"), list) and isinstance(entry.get("versions"), dict)
        for entry in entries)


def _probes_readable(row: dict) -> bool:
    """A row's training probes (if any) are lists of at least [step, passkey, held-out ppl]."""
    probes = row.get("probe", [])
    return isinstance(probes, list) and all(
        isinstance(probe, list) and len(probe) >= 3
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in probe) for probe in probes)


def markdown(results: dict) -> str:
    settings = SimpleNamespace(**results["settings"])
    factors = settings.factors
    L = settings.length
    counts = {label: len(rows) for label, rows in results["runs"].items()}
    uneven = len(set(counts.values())) > 1  # some runs have more seeds (a later part for a few of them)
    spread = " (mean ± std; column `seeds`: how many of them each run has)" if uneven else " (mean ± std)"
    steps_of = {label: [row.get("steps", settings.steps) for row in rows] for label, rows in results["runs"].items()}
    for label in steps_of:  # a scaling's rows are the trained RoPE model's, extended: its steps
        if label.endswith(SCALED_ROWS) and len(steps_of.get("rope", [])) == len(steps_of[label]):
            steps_of[label] = steps_of["rope"]
    varied = any(steps != settings.steps for values in steps_of.values() for steps in values)
    until = getattr(settings, "until_retrieval", 0)
    confirm = getattr(settings, "confirm_retrieval", 1)  # results written before it was a setting: 1
    probes = "a training probe" if confirm == 1 else f"{confirm} training probes in a row"
    budget = (f"{settings.steps} steps, or more until {probes} retrieved (≥ 90 % in distribution; at most "
              f"{until}, column `steps`)" if until else f"{settings.steps} steps")
    curriculum = getattr(settings, "curriculum", 0.0)
    if curriculum:
        budget += f", the length growing from L/4 to L over the first {curriculum:.0%} of {settings.steps} steps"
    weight_decay = getattr(settings, "weight_decay", 0.01)  # results written before it was a setting: 0.01
    decay = "" if weight_decay == 0.01 else f", weight decay {weight_decay}"
    lines = [
        f"Tiny LLaMA-shaped byte-level decoders ({settings.layers} layers, hidden {settings.hidden}, "
        f"{settings.heads} heads of dim {settings.hidden // settings.heads}, {settings.kv_heads} kv heads) trained "
        "from "
        f"scratch at L = {L} for {budget} (batch {settings.batch}, lr {settings.lr}{decay}) on pydoc topics + "
        f"{settings.synthetic:.0%} synthetic sequences ({settings.passkey_share:.0%} of them passkey, the rest "
        f"copy); seeds {', '.join(map(str, settings.seeds))}"
        f"{spread if len(settings.seeds) > 1 else ''}. Perplexity on the held-out last 10 % of the topics "
        f"(≤ {settings.max_windows} windows per length); passkey: {settings.trials} keys x depths "
        f"{', '.join(f'{d:g}' for d in settings.depths)}.{_extension_notes(settings, results['runs'])}",
        "",
        "| run | " + " | ".join(f"ppl {f}x" for f in factors) + " | "
        + " | ".join(f"tail ppl {f}x" for f in factors if f > 1) + " | "
        + " | ".join(f"passkey {f}x" for f in factors) + " |",
        "|---" * (1 + 2 * len(factors) + len([f for f in factors if f > 1])) + "|",
    ]
    extra = [name for name, shown in (("seeds", uneven), ("steps", varied or until)) if shown]
    lines[-2] = lines[-2].replace("| run |", "| run |" + "".join(f" {name} |" for name in extra))
    lines[-1] += "---|" * len(extra)
    for label, rows in results["runs"].items():
        cells = [str(counts[label])] if uneven else []
        cells += [_cell(steps_of[label], ".0f")] if "steps" in extra else []
        cells += [_cell([_get(r["windows"], f) for r in rows], ".2f") for f in factors]
        cells += [_cell([_get(r["tail"], f) for r in rows], ".2f") for f in factors if f > 1]
        cells += [_cell([100 * _get(r["passkey"], f) for r in rows], ".0f") + " %" for f in factors]
        flag = "" if statistics.mean(_get(r["passkey"], 1) for r in rows) >= 0.9 else " ⚠"  # NaN: flagged
        lines.append(f"| {label}{flag} | " + " | ".join(cells) + " |")
    lines += ["", "⚠ = passkey accuracy at 1x below 90 %: the model has not learned retrieval in distribution, so its "
              "retrieval past L says little."]
    return "\n".join(lines)


def _extension_notes(settings: SimpleNamespace, labels) -> str:
    """How rows past L were made, said only for the runs the table has (RoPE scalings, the learned tables)."""
    notes = ""
    if any(label.endswith(SCALED_ROWS) for label in labels):
        factor = settings.extend_factor
        notes += (f" RoPE scalings extend the RoPE model to {factor}L = {factor * settings.length}; fine-tuned = "
                  f"{settings.finetune_steps} steps at {factor}L (batch {settings.finetune_batch}, lr "
                  f"{settings.finetune_lr}).")
    if any(label.startswith("learned") for label in labels):  # the rule bench_tiny tiles by
        notes += " `learned` is grown by tiling its table (`extend_context(..., method='copy')`) to reach past L."
    return notes


def _get(mapping: dict, factor: int):
    """A per-factor value from results read back from JSON (whose keys are strings)."""
    return mapping[str(factor)]


def plot(results: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = results["settings"]
    factors = settings["factors"]
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    colors = [*plt.cm.tab20.colors, *plt.cm.tab20b.colors]  # 20+ runs: one colour each
    for axis in (left, right):
        axis.set_prop_cycle(color=colors)
    for label, rows in results["runs"].items():
        if "zero-shot" in label:
            continue
        style = "--" if "fine-tuned" in label else "-"
        lengths = [f * settings["length"] for f in factors]
        ppl = [statistics.mean(_get(r["windows"], f) for r in rows) for f in factors]
        keys = [statistics.mean(_get(r["passkey"], f) for r in rows) for f in factors]
        if not all(math.isfinite(value) for value in ppl + keys):  # a diverged run: in the table, not drawn
            continue
        left.plot(lengths, ppl, style, marker="o", label=label)
        right.plot(lengths, keys, style, marker="o", label=label)
    for axis in (left, right):
        axis.axvline(settings["length"], color="grey", linestyle=":", linewidth=1)
        axis.set_xscale("log", base=2)
        axis.grid(True, alpha=0.3)
        axis.set_xlabel("context length (bytes)")
    left.set(yscale="log", ylabel="perplexity (non-overlapping windows)", title="Perplexity against length")
    right.set(ylim=(-0.05, 1.05), ylabel="passkey accuracy", title="Passkey retrieval against length")
    right.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    picture = io.BytesIO()
    figure.savefig(picture, format="png", dpi=110)
    plt.close(figure)
    write_file_atomic(path, picture.getvalue())
    return path


def merge(parts: list[dict], defaults: dict) -> dict:
    """Results of the same settings run for different seeds or runs (each (run, seed) is trained from its own seed,
    so the parts are what one run over all of them gives): rows gathered per run in seed order, runs in the order
    the parts first name them (RoPE scalings last); a (run, seed) found twice is refused. Each row carries its
    seed (rows written before rows carried it get their part's seeds, in order). ``defaults``: every setting at its
    default, for results written before a setting existed."""
    parts = [{**part, "settings": _with_defaults(part["settings"], defaults),
              "runs": {label: _seeded(label, rows, part["settings"]["seeds"]) for label, rows in part["runs"].items()}}
             for part in parts]
    _require_one_corpus(parts)
    first = {k: v for k, v in parts[0]["settings"].items() if k != "seeds"}
    for part in parts[1:]:
        other = {k: v for k, v in part["settings"].items() if k != "seeds"}
        differ = sorted(key for key in {*first, *other} if first.get(key) != other.get(key))
        if differ:
            raise SystemExit("--report: the results differ in settings other than seeds: " + "; ".join(
                f"{key} {first.get(key)!r} against {other.get(key)!r}" for key in differ))
    runs: dict[str, list[dict]] = {}
    for part in parts:
        for label, rows in part["runs"].items():
            found = runs.setdefault(label, [])
            twice = {row["seed"] for row in found} & {row["seed"] for row in rows}
            if twice:
                raise SystemExit(f"--report: run {label!r} seed {min(twice)} is in two of the results; pass each "
                                 "(run, seed) once")
            found.extend(rows)
    labels = list(runs)  # the order they were given in
    scaled = [label for label in labels if label.endswith(SCALED_ROWS)]  # after every trained run, as bench_tiny does
    order = sorted(range(len(parts)), key=lambda i: min(parts[i]["settings"]["seeds"], default=0))
    merged = {**parts[order[0]], "settings": {**parts[0]["settings"]}, "runs": {
        label: sorted(runs[label], key=lambda row: row["seed"]) for label in [
            *(x for x in labels if x not in scaled), *scaled]}}
    merged["settings"]["seeds"] = sorted({row["seed"] for rows in runs.values() for row in rows})
    if len(parts) > 1:
        merged["seconds"] = sum(part.get("seconds", 0.0) for part in parts)
        merged["command"] = " and ".join(f"`{parts[i].get('command', '?')}`" for i in order).strip("`")
        merged["parts"] = [entry for i in order for entry in _provenance(parts[i])]
        merged["versions"] = _shared(entry.get("versions", {}) for entry in merged["parts"])
    return merged


def _provenance(part: dict) -> list[dict]:
    """Where ``part``'s rows were made: its seeds, command, seconds and versions (torch, Python, device), or the
    entries it already carries when it is itself a merge; kept so that a merge of runs made on different machines
    says so instead of naming the first one's machine for all."""
    if "parts" in part:
        return part["parts"]
    return [{"seeds": part["settings"]["seeds"], "runs": list(part["runs"]), "command": part.get("command", "?"),
             "seconds": part.get("seconds", 0.0), "versions": part.get("versions", {})}]


def _origin(results: dict, label: str, seed: int) -> dict:
    """The command and versions of the part of a merge that made (``label``, ``seed``); {} for unmerged results."""
    for entry in results.get("parts", []):
        if seed in entry["seeds"] and label in entry.get("runs", [label]):
            return {"command": entry.get("command", "?"), "versions": entry["versions"]}
    return {}


def _shared(versions: Iterable[dict]) -> dict:
    """The entries every one of ``versions`` has with the same value (what is true of the whole merge)."""
    versions = list(versions)
    return {key: value for key, value in versions[0].items() if all(v.get(key) == value for v in versions[1:])}


def _seeded(label: str, rows: list[dict], seeds: list[int]) -> list[dict]:
    """``rows`` with their seed: their own, or (rows written before they carried it) the part's seeds in order,
    which is how bench_tiny wrote them; refused when that cannot tell."""
    if all("seed" in row for row in rows):
        seen = [row["seed"] for row in rows]
        if len(set(seen)) != len(seen):
            raise SystemExit(f"--report: run {label!r} has two rows of one seed ({seen}); pass each (run, seed) once")
        return rows
    if len(rows) != len(seeds):
        raise SystemExit(f"--report: run {label!r} has {len(rows)} rows for seeds {seeds} and no seed in them "
                         "(results written before rows carried their seed, with a seed missing); which row is which "
                         "seed cannot be told")
    return [{**row, "seed": seed} for row, seed in zip(rows, seeds, strict=True)]


def _require_one_corpus(parts: list[dict]) -> None:
    """Refuse parts measured on different text: the corpus is Python's pydoc topics, which differ between Python
    versions (a seed run under 3.11 read 4.07 perplexity where the same setting gave 4.68-4.92 under 3.12), unless
    a run read another Python's topics with ``--corpus-file``. Results carry a fingerprint of the text read;
    results written before the fingerprint existed read their own Python's topics, known here only if that is
    this Python (otherwise only such results of the same Python merge with each other)."""
    def corpus(part: dict) -> str:
        if part.get("corpus"):
            return part["corpus"]
        python = ".".join(part.get("versions", {}).get("python", "?").split(".")[:2])
        return _this_pythons_fingerprint() if python == _this_python() else f"Python {python}'s topics"

    found = {corpus(part) for part in parts}
    if len(found) > 1:
        raise SystemExit(
            f"--report: the results were measured on different text ({', '.join(sorted(found))}: pydoc topics "
            "change with the Python version), so their perplexities are not comparable. Run every seed on the same "
            "text (the same Python, or the same --corpus-file), or report them separately."
        )


def _this_python() -> str:
    import sys

    return f"{sys.version_info.major}.{sys.version_info.minor}"


def _this_pythons_fingerprint() -> str:
    """sha256 (16 hex digits) of this Python's topics, as bench_tiny.corpus_fingerprint computes it."""
    import hashlib

    from hf_posswap.evaluation import corpus_text

    return hashlib.sha256(corpus_text("pydoc").encode("utf-8")).hexdigest()[:16]


def _with_defaults(settings: dict, defaults: dict) -> dict:
    """``settings`` with the settings added since it was written, at their defaults (the values those runs used:
    e.g. ``decay_from`` was 0.8 in the code before it became a setting)."""
    return {**{k: list(v) if isinstance(v, tuple) else v for k, v in defaults.items() if k not in settings},
            **settings}


def machines(results: dict) -> str:
    """Where ``results`` ran, in words: one machine, or each machine of a merge with the seeds it ran."""
    entries = results.get("parts") or [{"seeds": results["settings"]["seeds"], "versions": results.get("versions", {})}]
    seeds_by_machine: dict[str, list[int]] = {}
    for entry in entries:
        seeds_by_machine.setdefault(_machine(entry["versions"]), []).extend(entry["seeds"])
    if len(seeds_by_machine) == 1:
        return next(iter(seeds_by_machine))
    return " and ".join(f"{machine} (seeds {', '.join(map(str, sorted(set(seeds))))})"
                        for machine, seeds in seeds_by_machine.items())


def _machine(versions: dict) -> str:
    device = versions.get("device", "cpu")
    torch_version = f", torch {versions['torch']}" if "torch" in versions else ""
    if device == "cpu":
        threads = versions.get("threads", "?")
        return f"{threads} CPU thread{'' if threads == 1 else 's'}{torch_version}"
    return f"one {device}, {versions.get('jobs', 1)} runs at a time{torch_version}"


def learning_curves(results: dict, path: Path) -> Path | None:
    """The training probes' curves (runs made with ``--probe-every``; None: no run has them), with the n-gram
    references when the results read this Python's topics (otherwise the text is not here to fit them on)."""
    if not has_curves(results):
        return None
    references = None
    if results.get("corpus") == _this_pythons_fingerprint():
        from hf_posswap.evaluation import corpus_text

        try:
            references = ngram_perplexities(corpus_text("pydoc"), results["settings"]["length"])
        except ValueError:  # windows longer than the held-out text can give: the curves without references
            references = None
    return plot_curves(results, path, references)


def report(results: dict, out: Path, readme: Path | None) -> str:
    """Write results.json / results.md / bench_tiny.png (and learning_curves.png, with training probes) under
    ``out`` (each atomically); refresh the page's section if asked."""
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(results, indent=2)
    write_file_atomic(out / "results.json", text)
    results = json.loads(text)  # one form: keys are strings
    table = markdown(results)
    write_file_atomic(out / "results.md", table + "\n")
    plot(results, out / "bench_tiny.png")
    learning_curves(results, out / "learning_curves.png")
    if readme is not None:
        picture = project_root(readme) / "scripts" / "results" / "bench_tiny.png"
        plot(results, picture)
        section = (
            f"`{results['command']}` ({results['seconds'] / 60:.0f} min on {machines(results)}):\n\n{table}\n\n"
            f"![perplexity and passkey accuracy against length]({picture_link(picture, readme)})"
        )
        replace_section(readme, "bench-tiny", section)
    return table


def write_split(results: dict, directory: Path, order: tuple[str, ...]) -> list[Path]:
    """One results file per (run, seed) of ``results`` (as :func:`merge` returns them: every row with its seed) in
    ``directory``, as the full mode run in parts writes them: ``NN_<run>_seed<S>.json``, NN the run's place in
    ``order`` (bench_tiny's RUNS; options after ":" aside), so that a glob keeps the full mode's order; a seed's
    RoPE scaling rows go with its RoPE run. Refuses, before writing anything, what would lose or mislabel a row:
    an existing file, a run outside ``order``, scaling rows of a seed with no RoPE row, nothing to split."""
    trained = {label: rows for label, rows in results["runs"].items() if not label.endswith(SCALED_ROWS)}
    scaled = {label: rows for label, rows in results["runs"].items() if label.endswith(SCALED_ROWS)}
    unknown = [label for label in trained if label.partition(":")[0] not in order]
    if unknown:
        raise SystemExit(f"--split: run {unknown[0]!r} is not one of bench_tiny's runs ({', '.join(order)})")
    rope_seeds = {row["seed"] for row in trained.get("rope", [])}
    orphans = sorted({row["seed"] for rows in scaled.values() for row in rows} - rope_seeds)
    if orphans:
        raise SystemExit(f"--split: RoPE scaling rows of seed {orphans[0]} have no RoPE row to go with; split "
                         "results that hold the RoPE run of every seed they scale")
    if not trained:
        raise SystemExit("--split: the results hold no runs; nothing to split")
    parts: dict[Path, dict] = {}
    for label, rows in trained.items():
        for row in rows:
            part_runs = {label: [row]}
            if label == "rope":
                part_runs.update({name: [r for r in found if r["seed"] == row["seed"]] for name, found in scaled.items()
                                  if any(r["seed"] == row["seed"] for r in found)})
            slug = re.sub(r"[^A-Za-z0-9]+", "_", label).strip("_")
            path = directory / f"{order.index(label.partition(':')[0]) + 1:02d}_{slug}_seed{row['seed']}.json"
            seconds = sum(found.get("seconds", 0.0) for runs in part_runs.values() for found in runs)
            unmerged = {key: value for key, value in results.items() if key != "parts"}
            parts[path] = {**unmerged, "settings": {**results["settings"], "seeds": [row["seed"]]}, "runs": part_runs,
                           "seconds": seconds, **_origin(results, label, row["seed"])}
    existing = [str(path) for path in parts if path.exists()]
    if existing:
        raise SystemExit(f"--split: {', '.join(existing)} already exist; remove them or split into another directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for path, part in parts.items():
            write_file_atomic(path, json.dumps(part, indent=2))
    except OSError as error:
        raise SystemExit(f"--split {directory}: cannot write there ({error})") from None
    return list(parts)
