"""Progress of long work (evaluation windows, passkey trials, the demo's steps, fine-tuning steps) on stderr.

On a terminal it is a tqdm bar with the elapsed time and an ETA; anywhere else (a log file, CI, a pipe) it is one
plain line per finished step, plus a line every ``interval`` seconds inside a long step, each with the elapsed time
and an ETA, never carriage-return bars. ``enabled=False`` (the library's ``progress=False``) or ``TQDM_DISABLE=1``
turns it off. A single forward pass of a long window can take minutes on a CPU, so :meth:`Progress.watch` also
counts the model's layers as they run: the bar moves, and the ETA holds, inside one step.

>>> with Progress("perplexity at 4096", steps=4, unit="window") as progress, progress.watch(model):  # doctest: +SKIP
...     for window in windows:
...         run(window)
...         progress.step()
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:  # torch is imported on first use: the command line's --help imports this module without it
    from torch import nn

_TICKS = 1000  # bar resolution per unit of weight: layers move the bar inside a step
_BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}{postfix}]"


def progress_disabled_by_environment() -> bool:
    """``TQDM_DISABLE`` set to a true value turns off the plain lines as it turns off tqdm's bars."""
    return os.environ.get("TQDM_DISABLE", "").strip().lower() in ("1", "true", "yes", "on")


def duration(seconds: float) -> str:
    """``42 s``, ``3 min 05 s``, ``1 h 02 min``."""
    seconds = max(int(round(seconds)), 0)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def repeated_layers(model: nn.Module) -> list[nn.Module]:
    """The model's stack of blocks (``model.layers``, ``transformer.h``, ``encoder.layer``): the ``ModuleList`` of
    one module type with the most items, ties broken by parameter count; empty when the model has none."""
    from torch import nn

    best: list[nn.Module] = []
    best_key = (0, 0)
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 1 and len({type(m) for m in module}) == 1:
            key = (len(module), sum(p.numel() for p in module.parameters()))
            if key > best_key:
                best, best_key = list(module), key
    return best


class Progress:
    """Counted steps of work, optionally weighted by their expected cost (``weights``, one per step), reported on
    ``stream`` (default: stderr at the time of the call). ``unit`` names a step in the lines ("window", "trial").
    ``start``: steps already done before this process began (a resumed run); the ETA counts only the time since.

    Plain lines: one per finished step (steps that end less than ``min_gap`` seconds after the previous line are
    folded into the next line, except the first and the last), and one every ``interval`` seconds inside a step."""

    def __init__(
        self,
        desc: str,
        steps: int,
        *,
        unit: str = "step",
        weights: Sequence[float] | None = None,
        enabled: bool = True,
        stream: TextIO | None = None,
        interval: float = 10.0,
        min_gap: float = 1.0,
        start: int = 0,
    ) -> None:
        if weights is not None and len(weights) != steps:
            raise ValueError(f"Progress: {len(weights)} weights for {steps} steps.")
        if not 0 <= start <= steps:
            raise ValueError(f"Progress: start {start} outside 0..{steps}.")
        self.desc, self.steps, self.unit, self.interval, self.min_gap = desc, steps, unit, interval, min_gap
        self.weights = [float(w) for w in weights] if weights is not None else [1.0] * steps
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled and steps > 0 and not progress_disabled_by_environment()
        self.done = self._start = start  # finished steps (``start`` of them before this process began)
        self.within = 0.0  # share of the current step done (from the layers that ran)
        self._start_fraction = self._fraction()
        self.started = self._last_line = time.perf_counter()
        self._layers, self._layer_calls = 0, 0
        self._bar = None
        if self.enabled and _is_terminal(self.stream):
            from tqdm import tqdm

            total = round(sum(self.weights) * _TICKS)
            self._bar = tqdm(total=total, initial=round(self._start_fraction * total), desc=self._bar_label(),
                             file=self.stream, leave=False, bar_format=_BAR_FORMAT, dynamic_ncols=True, smoothing=0)

    # -- reporting -------------------------------------------------------------------------------------------------

    def step(self, note: str = "") -> None:
        """One step finished (``note``: what it was, e.g. a scheme name or the loss, shown in the plain line and
        beside the bar)."""
        if not self.enabled:
            return
        self.done, self.within, self._layer_calls = min(self.done + 1, self.steps), 0.0, 0
        if self._bar is not None:
            self._bar.set_description_str(self._bar_label(), refresh=False)
            if note:
                self._bar.set_postfix_str(note, refresh=False)
            self._move_bar()
        elif self.done in (self._start + 1, self.steps) or time.perf_counter() - self._last_line >= self.min_gap:
            suffix = f" ({note})" if note else ""
            self._line(f"{self.unit} {self.done}/{self.steps} done{suffix}")

    def advance_within(self, share: float) -> None:
        """``share`` (0..1) of the current step is done; the bar moves, a plain line is printed every ``interval``."""
        if not self.enabled or self.done >= self.steps:
            return
        self.within = min(max(share, 0.0), 0.999)  # the step itself says when it is finished
        if self._bar is not None:
            self._move_bar()
        elif time.perf_counter() - self._last_line >= self.interval:
            layer = f", layer {self._layer_calls}/{self._layers}" if self._layers else ""
            self._line(f"{self._position()}, {int(self.within * 100)}% of it{layer}")

    def write(self, text: str) -> None:
        """Print ``text`` on stdout without tearing the bar (tqdm clears and redraws it around the text)."""
        if self._bar is not None:
            from tqdm import tqdm

            tqdm.write(text, file=sys.stdout)
            sys.stdout.flush()
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- layers ----------------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def watch(self, model: nn.Module) -> Iterator[None]:
        """While inside, every block of ``model`` that finishes moves the current step on by one block's share.
        The hooks are removed on exit, also after an error."""
        layers = repeated_layers(model) if self.enabled else []
        handles = [layer.register_forward_hook(self._layer_finished) for layer in layers]
        self._layers, self._layer_calls = len(layers), 0
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self._layers = 0

    def _layer_finished(self, *_: object) -> None:
        self._layer_calls += 1
        self.advance_within(self._layer_calls / self._layers)

    # -- helpers ---------------------------------------------------------------------------------------------------

    def _fraction(self) -> float:
        total = sum(self.weights)
        finished = sum(self.weights[: self.done])
        current = self.weights[self.done] * self.within if self.done < self.steps else 0.0
        return (finished + current) / total if total > 0 else 1.0

    def _position(self) -> str:
        current = min(self.done + 1, self.steps)
        return f"{self.unit} {current}/{self.steps}" if self.done < self.steps else f"{self.steps} {self.unit}s done"

    def _bar_label(self) -> str:
        return f"{self.desc} ({self._position()})"

    def _move_bar(self) -> None:
        self._bar.n = round(self._fraction() * self._bar.total)
        self._bar.refresh()

    def _line(self, what: str) -> None:
        now = time.perf_counter()
        elapsed, fraction = now - self.started, self._fraction()
        if self.done >= self.steps:
            timing = f"finished in {duration(elapsed)}"
        else:
            progressed = fraction - self._start_fraction  # of the work done in this process
            eta = duration(elapsed * (1 - fraction) / progressed) if progressed > 0 else "unknown"
            timing = f"{duration(elapsed)} elapsed, ETA {eta}"
        print(f"{self.desc}: {what}; {timing}", file=self.stream, flush=True)
        self._last_line = now


@contextlib.contextmanager
def library_bars(show: bool) -> Iterator[None]:
    """transformers' own bars ("Loading weights", "Writing model shards") hidden while inside unless ``show``;
    restored on exit. Callers pass ``show=False`` with ``progress=False`` or when stderr is not a terminal (a log
    gets no carriage returns). transformers is imported only when there is something to hide."""
    if show:
        yield
        return
    from transformers.utils import logging as transformers_logging

    was_enabled = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            transformers_logging.enable_progress_bar()


def is_terminal(stream: TextIO | None) -> bool:
    """Whether ``stream`` is an open terminal (a bar would show there); ``False`` for files, pipes and ``None``."""
    return _is_terminal(stream)


def _is_terminal(stream: TextIO | None) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except (OSError, ValueError):  # a closed or detached stream
        return False
