"""Protocol A's learning curves (``bench_tiny.py --probe-every N``): what the training probes read, per run and seed,
against the perplexity of n-gram models fitted on the same training text. They answer "why does this scheme not
retrieve": a model whose held-out perplexity stays at the bigram model's has not learned which token came before
the last one, which is what retrieval (an induction circuit) is built on.

Reads results only; imports neither torch nor ``bench_tiny.py``.
"""

from __future__ import annotations

import collections
import io
import math
from pathlib import Path

from hf_posswap.persistence.saving import write_file_atomic

PROBE_WINDOWS = 8  # bench_tiny_training.PROBE_WINDOWS: the held-out windows of L each probe reads
HELDOUT_SHARE = 0.1  # bench_tiny_training.corpus_split: the last 10 % of the topics are held out
SMOOTHING = 0.1  # add-k smoothing of the n-gram counts
VOCABULARY = 256  # bytes: the byte tokenizer maps each UTF-8 byte to one token


def ngram_perplexities(text: str, length: int, orders: tuple[int, ...] = (2, 3)) -> dict[int, float]:
    """Held-out perplexity of add-k smoothed byte n-gram models (order n: the next byte from the n - 1 before it)
    fitted on the training 90 % of ``text``, scored on the probes' targets: the first PROBE_WINDOWS windows of
    ``length`` bytes of the held-out 10 %, every byte after a window's first (near a window's start the context is
    what the window holds, as for the models). The byte tokenizer is one token per byte, so these are the models'
    units. ``{order: perplexity}``."""
    data = text.encode("utf-8")
    cut = int((1 - HELDOUT_SHARE) * len(data))
    train, heldout = data[:cut], data[cut:]
    if len(heldout) < PROBE_WINDOWS * length:
        raise ValueError(f"the held-out text ({len(heldout):,} bytes) is shorter than {PROBE_WINDOWS} windows of "
                         f"{length}")
    # counts[n - 1]: the training text's n-grams, counted once for every order asked
    counts = [collections.Counter(train[i : i + n] for i in range(len(train) - n + 1))
              for n in range(1, max(orders) + 1)]
    result = {}
    for order in orders:
        total, scored = 0.0, 0
        for start in range(0, PROBE_WINDOWS * length, length):
            window = heldout[start : start + length]
            for position in range(1, length):
                n = min(order, position + 1)  # the n-gram ending at `position`, within the window
                gram = window[position - n + 1 : position + 1]
                context = counts[n - 2][gram[:-1]] if n > 1 else len(train)
                total -= math.log((counts[n - 1][gram] + SMOOTHING) / (context + SMOOTHING * VOCABULARY))
                scored += 1
        result[order] = math.exp(total / scored)
    return result


def has_curves(results: dict) -> bool:
    """Whether any trained row carries training probes (runs made with ``--probe-every``)."""
    return any(row.get("probe") for rows in results["runs"].values() for row in rows)


def plot_curves(results: dict, path: Path, references: dict[int, float] | None) -> Path:
    """One panel per trained run: held-out perplexity (left axis, log) and in-distribution passkey accuracy (right
    axis) at each probe, one colour per seed; the n-gram ``references`` as grey lines (None: not drawn)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {label: rows for label, rows in results["runs"].items() if any(row.get("probe") for row in rows)}
    columns = min(4, len(runs))
    rows_of_panels = -(-len(runs) // columns)
    width, height = max(4 * columns, 10), 3 * rows_of_panels + 1  # the legend and title need 10 x 1 inches
    figure, axes = plt.subplots(rows_of_panels, columns, figsize=(width, height), squeeze=False, sharex=True)
    seeds = sorted({row["seed"] for rows in runs.values() for row in rows})
    drawn = [probe[2] for rows in runs.values() for row in rows for probe in row.get("probe") or []]
    drawn = [value for value in [*drawn, *(references or {}).values()] if math.isfinite(value) and value > 0]
    limits = (0.9 * min(drawn), 1.1 * max(drawn)) if drawn else (1.0, 10.0)  # one scale: the panels compare
    colors = {seed: plt.cm.tab10(i % 10) for i, seed in enumerate(seeds)}
    for axis, (label, rows) in zip(axes.flat, runs.items(), strict=False):
        retrieval = axis.twinx()
        for row in rows:
            probes = row.get("probe") or []  # [[step, passkey, held-out ppl, training ppl], ...]
            steps = [probe[0] for probe in probes]
            axis.plot(steps, [probe[2] for probe in probes], "-", color=colors[row["seed"]], linewidth=1.2)
            retrieval.plot(steps, [probe[1] for probe in probes], ":", color=colors[row["seed"]], linewidth=1.2)
        for order, value in (references or {}).items():
            axis.axhline(value, color="grey", linewidth=0.8, linestyle="--")
            axis.annotate(f"{order}-gram", (1.0, value), xycoords=("axes fraction", "data"), fontsize=6,
                          color="grey", ha="right", va="bottom")
        axis.set_yscale("log")
        axis.set_ylim(*limits)
        axis.set_title(label, fontsize=9)
        axis.grid(True, alpha=0.3)
        retrieval.set_ylim(-0.05, 1.05)
        retrieval.tick_params(labelsize=7)
        axis.tick_params(labelsize=7)
    for axis in axes.flat[len(runs):]:
        axis.set_visible(False)
    handles = [plt.Line2D([], [], color=colors[seed], label=f"seed {seed}") for seed in seeds]
    handles += [plt.Line2D([], [], color="black", linestyle="-", label="held-out perplexity (left, log)"),
                plt.Line2D([], [], color="black", linestyle=":", label="passkey at L, training probe (right)")]
    legend_rows = -(-len(handles) // 5)
    figure.legend(handles=handles, loc="lower center", ncol=min(len(handles), 5), fontsize=8)
    figure.suptitle("Training probes against steps; dashed grey: byte n-gram models fitted on the training text",
                    fontsize=10)
    figure.tight_layout(rect=(0, 0.25 * legend_rows / height, 1, 1 - 0.4 / height))
    picture = io.BytesIO()
    figure.savefig(picture, format="png", dpi=90)
    plt.close(figure)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file_atomic(path, picture.getvalue())
    return path
