"""Reporting for ``bench_tiny.py`` (Protocol A): merge the results of runs made for different seeds, write the
markdown table and the plot, refresh the README section. Reads results only (``results.json``), so it can redraw
runs made on another machine; it imports nothing from ``bench_tiny.py``.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from types import SimpleNamespace

from readme_section import replace_section

SCALED_ROWS = ("(zero-shot)", "(fine-tuned)")  # how the rows of the RoPE scalings end


def _cell(values: list[float], fmt: str) -> str:
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(statistics.mean(values), fmt)} ± {format(statistics.stdev(values), fmt)}"


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
    budget = (f"{settings.steps} steps, or more until a training probe retrieved (≥ 90 % in distribution; at most "
              f"{until}, column `steps`)" if until else f"{settings.steps} steps")
    curriculum = getattr(settings, "curriculum", 0.0)
    if curriculum:
        budget += f", the length growing from L/4 to L over the first {curriculum:.0%} of {settings.steps} steps"
    lines = [
        f"Tiny LLaMA-shaped byte-level decoders ({settings.layers} layers, hidden {settings.hidden}, "
        f"{settings.heads} heads of dim {settings.hidden // settings.heads}, {settings.kv_heads} kv heads) trained "
        "from "
        f"scratch at L = {L} for {budget} (batch {settings.batch}, lr {settings.lr}) on pydoc topics + "
        f"{settings.synthetic:.0%} synthetic sequences ({settings.passkey_share:.0%} of them passkey, the rest "
        f"copy); seeds {', '.join(map(str, settings.seeds))}"
        f"{spread if len(settings.seeds) > 1 else ''}. Perplexity on the held-out last 10 % of the topics "
        f"(≤ {settings.max_windows} windows per length); passkey: {settings.trials} keys x depths "
        f"{', '.join(f'{d:g}' for d in settings.depths)}. RoPE scalings extend the RoPE model to "
        f"{settings.extend_factor}L = {settings.extend_factor * L}; fine-tuned = {settings.finetune_steps} steps at "
        f"{settings.extend_factor}L (batch {settings.finetune_batch}, lr {settings.finetune_lr}). `learned` is grown "
        "by tiling its table (`extend_context(..., method='copy')`) to reach past L.",
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
        flag = " ⚠" if statistics.mean(_get(r["passkey"], 1) for r in rows) < 0.9 else ""
        lines.append(f"| {label}{flag} | " + " | ".join(cells) + " |")
    lines += ["", "⚠ = passkey accuracy at 1x below 90 %: the model has not learned retrieval in distribution, so its "
              "retrieval past L says little."]
    return "\n".join(lines)


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
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def merge(parts: list[dict], defaults: dict) -> dict:
    """Results of the same settings run for different seeds or runs (each (run, seed) is trained from its own seed,
    so the parts are what one run over all of them gives): rows concatenated per run, in seed order, runs in the
    order the parts first name them (RoPE scalings last); a (run, seed) found in two parts is refused.
    ``defaults``: every setting at its default, for results written before a setting existed."""
    parts = [{**part, "settings": _with_defaults(part["settings"], defaults)} for part in parts]
    if len(parts) == 1:
        return parts[0]
    _require_one_corpus(parts)
    first = {k: v for k, v in parts[0]["settings"].items() if k != "seeds"}
    for part in parts[1:]:
        other = {k: v for k, v in part["settings"].items() if k != "seeds"}
        if other != first:
            raise SystemExit(f"--report: the results differ in settings other than seeds: {first} vs {other}")
    order = sorted(range(len(parts)), key=lambda i: min(parts[i]["settings"]["seeds"]))
    merged = {**parts[order[0]], "settings": {**parts[0]["settings"], "seeds": []}, "runs": {}}
    seen: dict[str, set] = {}
    for index in order:
        seeds = set(parts[index]["settings"]["seeds"])
        merged["settings"]["seeds"] += sorted(seeds - set(merged["settings"]["seeds"]))
        for label, rows in parts[index]["runs"].items():
            twice = seen.setdefault(label, set()) & seeds
            if twice:
                raise SystemExit(f"--report: run {label!r} seed {min(twice)} is in two of the results; pass each "
                                 "(run, seed) once")
            seen[label] |= seeds
            merged["runs"].setdefault(label, []).extend(rows)
    merged["settings"]["seeds"].sort()
    labels = list(dict.fromkeys(label for part in parts for label in part["runs"]))  # the order they were given in
    scaled = [label for label in labels if label.endswith(SCALED_ROWS)]  # after every trained run, as bench_tiny does
    merged["runs"] = {label: merged["runs"][label] for label in [*(x for x in labels if x not in scaled), *scaled]}
    merged["seconds"] = sum(part.get("seconds", 0.0) for part in parts)
    merged["command"] = " and ".join(f"`{parts[i].get('command', '?')}`" for i in order).strip("`")
    return merged


def _require_one_corpus(parts: list[dict]) -> None:
    """Refuse parts measured on different text: the corpus is Python's pydoc topics, which differ between Python
    versions (a seed run under 3.11 read 4.07 perplexity where the same setting gave 4.68-4.92 under 3.12). Parts
    written before the fingerprint existed are compared by their Python version."""
    def corpus(part: dict) -> str:
        python = part.get("versions", {}).get("python", "?")
        return part.get("corpus") or "Python " + ".".join(python.split(".")[:2])

    found = {corpus(part) for part in parts}
    fingerprints = {part["corpus"] for part in parts if part.get("corpus")}
    pythons = {corpus({"versions": part.get("versions", {})}) for part in parts}
    if len(fingerprints) > 1 or (len(found) > 1 and len(pythons) > 1):
        raise SystemExit(
            f"--report: the results were measured on different corpora ({', '.join(sorted(found))}: pydoc topics "
            "change with the Python version), so their perplexities are not comparable. Run every seed under the "
            "same Python, or report them separately."
        )


def _with_defaults(settings: dict, defaults: dict) -> dict:
    """``settings`` with the settings added since it was written, at their defaults (the values those runs used:
    e.g. ``decay_from`` was 0.8 in the code before it became a setting)."""
    return {**{k: list(v) if isinstance(v, tuple) else v for k, v in defaults.items() if k not in settings},
            **settings}


def _machine(versions: dict) -> str:
    device = versions.get("device", "cpu")
    if device == "cpu":
        return f"{versions['threads']} CPU threads"
    return f"one {device}, {versions.get('jobs', 1)} runs at a time"


def report(results: dict, out: Path, readme: Path | None) -> str:
    """Write results.json / results.md / bench_tiny.png under ``out``; refresh the README section if asked."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2), encoding="utf-8")
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))  # one form: keys are strings
    table = markdown(results)
    (out / "results.md").write_text(table + "\n", encoding="utf-8")
    plot(results, out / "bench_tiny.png")
    if readme is not None:
        plot(results, readme.resolve().parent / "scripts" / "results" / "bench_tiny.png")
        section = (
            f"`{results['command']}` ({results['seconds'] / 60:.0f} min on {_machine(results['versions'])}, "
            f"torch {results['versions']['torch']}):\n\n{table}\n\n"
            "![perplexity and passkey accuracy against length](scripts/results/bench_tiny.png)"
        )
        replace_section(readme, "bench-tiny", section)
    return table


def write_split(results: dict, directory: Path, order: tuple[str, ...]) -> list[Path]:
    """One results file per (run, seed) of ``results`` in ``directory``, as the full mode run in parts writes them:
    ``NN_<run>_seed<S>.json``, NN the run's place in ``order`` (bench_tiny's RUNS; options after ":" aside), so
    that a glob keeps the full mode's order; a seed's RoPE scaling rows go with its RoPE run. Refuses to replace a
    file, and rows whose seed it cannot tell (results written before rows carried it, with a seed missing)."""
    seeds = results["settings"]["seeds"]

    def seed_of(label: str, index: int, rows: list[dict]) -> int:
        if "seed" in rows[index]:
            return rows[index]["seed"]
        if len(rows) != len(seeds):
            raise SystemExit(f"--split: run {label!r} has {len(rows)} rows for seeds {seeds} and no seed in them "
                             "(results written before rows carried their seed); split it by hand")
        return seeds[index]

    parts: dict[Path, dict] = {}
    for label, rows in results["runs"].items():
        if label.endswith(SCALED_ROWS):
            continue
        for index in range(len(rows)):
            seed = seed_of(label, index, rows)
            part_runs = {label: [rows[index]]}
            if label == "rope":
                for scaled, scaled_rows in results["runs"].items():
                    mine = [r for i, r in enumerate(scaled_rows) if seed_of(scaled, i, scaled_rows) == seed]
                    if scaled.endswith(SCALED_ROWS) and mine:
                        part_runs[scaled] = mine
            slug = re.sub(r"[^A-Za-z0-9]+", "_", label).strip("_")
            place = order.index(label.partition(":")[0]) + 1
            path = directory / f"{place:02d}_{slug}_seed{seed}.json"
            seconds = sum(row.get("seconds", 0.0) for found in part_runs.values() for row in found)
            parts[path] = {**results, "settings": {**results["settings"], "seeds": [seed]}, "runs": part_runs,
                           "seconds": seconds}
    existing = [str(path) for path in parts if path.exists()]
    if existing:
        raise SystemExit(f"--split: {', '.join(existing)} already exist; remove them or split into another directory")
    directory.mkdir(parents=True, exist_ok=True)
    for path, part in parts.items():
        temporary = path.with_name(f".{path.name}.tmp")
        temporary.write_text(json.dumps(part, indent=2), encoding="utf-8")
        temporary.replace(path)
    return list(parts)
