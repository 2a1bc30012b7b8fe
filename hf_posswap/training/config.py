"""``FinetuneConfig``: every option of a fine-tuning run, validated, and its command-line form."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from ..errors import InvalidConfigError

#: transformers scheduler names that run from (optimizer, warmup, total steps) alone; the others need a metric or
#: extra arguments this command does not take.
LR_SCHEDULES = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                "inverse_sqrt")
#: where transformers' ``polynomial`` schedule ends (its ``lr_end`` default); it refuses a starting lr at or below it
POLYNOMIAL_END_LR = 1e-7


@dataclass
class FinetuneConfig:
    """A fine-tuning run of a (swapped) model with accelerate.

    Args:
        model: checkpoint directory to start from.
        data: text / jsonl / json files (globs allowed) or ``datasets`` directories saved with ``save_to_disk``.
        output: run directory: checkpoints, loss log, final model or adapter.
        scheme, scheme_options: swap to this scheme first (``None``: train the model's current positions).
        extend_to, extend_method, extend_options: extend the context first (``hf_posswap.extend_context``; the
            options are the method's, e.g. ``beta_fast`` for yarn).
        objective: ``causal``, ``mlm`` or ``auto`` (causal for decoders, masked LM for BERT encoders).
        seq_len, batch_size, grad_accum, steps: sequence length, per-process batch, accumulation, optimizer steps.
        lr, lr_schedule, warmup_steps, weight_decay, max_grad_norm: AdamW and a transformers scheduler name.
        mixed_precision: ``no``, ``fp16`` or ``bf16`` (accelerate). gradient_checkpointing: trade compute for memory.
        lora, lora_r, lora_alpha, lora_dropout, merge_lora: LoRA through peft; position modules are trained and
            saved with the adapter; ``merge_lora`` also writes the merged full model.
        distill, distill_weight, distill_temperature: train towards the unswapped original (KL on logits for LMs,
            final-hidden-state MSE for encoders), mixed with the plain objective by ``distill_weight``.
        pose_target: PoSE: position ids of the short training sequences span this length.
        eval_fraction, eval_every: held-out share of the packed data and how often to measure it.
        save_every: checkpoint every N steps (atomic; ``resume`` continues from the newest valid one).
        resume: continue the run in ``output``; only ``RESUME_SAFE`` settings may differ from the recorded ones.
        overwrite_output_dir: replace a previous run in ``output`` (only the files a run writes are removed).
        accelerate_config: an ``accelerate config`` file (yaml) whose FSDP settings (``distributed_type: FSDP``,
            ``fsdp_config``) are passed to ``Accelerator(fsdp_plugin=...)``; needs CUDA (on CPU the run is refused:
            use ``hf_posswap.training.sharding.shard_model``). Or its DeepSpeed settings (``distributed_type:
            DEEPSPEED``, ``deepspeed_config``), passed to ``Accelerator(deepspeed_plugin=...)``, on CUDA or CPU
            (see :mod:`hf_posswap.training.deepspeed_config`).
        progress: report the steps on stderr (a bar on a terminal, plain lines with the loss, elapsed time and ETA
            in a log), from the local main process only; ``False`` (``--no-progress``) for silence.
    """

    model: str
    data: list[str]
    output: str
    scheme: str | None = None
    scheme_options: dict[str, Any] = field(default_factory=dict)
    extend_to: int | None = None
    extend_method: str | None = None
    extend_options: dict[str, Any] = field(default_factory=dict)
    objective: Literal["auto", "causal", "mlm"] = "auto"
    seq_len: int = 512
    batch_size: int = 4
    grad_accum: int = 1
    steps: int = 100
    lr: float = 1e-4
    lr_schedule: str = "cosine"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    mixed_precision: Literal["no", "fp16", "bf16"] = "no"
    gradient_checkpointing: bool = False
    lora: bool = False
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    merge_lora: bool = False
    distill: bool = False
    distill_weight: float = 1.0
    distill_temperature: float = 1.0
    pose_target: int | None = None
    mlm_probability: float = 0.15
    text_field: str = "text"
    eval_fraction: float = 0.05
    eval_every: int = 50
    save_every: int = 100
    resume: bool = False
    overwrite_output_dir: bool = False
    seed: int = 0
    accelerate_config: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.data, (str, os.PathLike)):
            self.data = [self.data]
        # pathlib paths are paths too; stored as strings (the recorded settings are JSON)
        for name in ("model", "output", "accelerate_config"):
            if isinstance(getattr(self, name), os.PathLike):
                setattr(self, name, os.fspath(getattr(self, name)))
        if isinstance(self.data, (list, tuple)):
            self.data = [os.fspath(item) if isinstance(item, os.PathLike) else item for item in self.data]
        self._check_paths()
        self._check_integers()
        self._check_numbers()
        self._check_choices()

    def _check_paths(self) -> None:
        for name in ("model", "output"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise InvalidConfigError(f"FinetuneConfig.{name} must be a non-empty path, got {value!r}.")
        if self.accelerate_config is not None and (
                not isinstance(self.accelerate_config, str) or not self.accelerate_config.strip()):
            raise InvalidConfigError(
                f"FinetuneConfig.accelerate_config must be a file path or None, got {self.accelerate_config!r}.")
        if not self.data or not all(isinstance(item, str) and item.strip() for item in self.data):
            raise InvalidConfigError(f"FinetuneConfig.data must name files or globs, got {self.data!r}.")

    def _check_integers(self) -> None:
        for name in ("seq_len", "batch_size", "grad_accum", "steps", "lora_r"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidConfigError(f"FinetuneConfig.{name} must be a positive integer, got {value!r}.")
        for name in ("eval_every", "save_every", "warmup_steps", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidConfigError(f"FinetuneConfig.{name} must be an integer >= 0, got {value!r}.")
        for name in ("extend_to", "pose_target"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise InvalidConfigError(f"FinetuneConfig.{name} must be a positive integer or None, got {value!r}.")
        if self.warmup_steps > self.steps:
            raise InvalidConfigError(
                f"FinetuneConfig.warmup_steps {self.warmup_steps} is more than FinetuneConfig.steps {self.steps}: the "
                f"learning rate would still be warming up when training ends and never reach lr={self.lr!r}; pass "
                f"FinetuneConfig.warmup_steps {self.steps} or less, or more FinetuneConfig.steps."
            )
        if self.pose_target is not None and self.seq_len < 2:
            raise InvalidConfigError(
                "FinetuneConfig.pose_target needs FinetuneConfig.seq_len 2 or more (PoSE cuts each sequence into "
                f"two chunks), got {self.seq_len}."
            )
        if self.pose_target is not None and self.pose_target <= self.seq_len:
            raise InvalidConfigError(
                f"pose_target={self.pose_target} must exceed seq_len={self.seq_len}: PoSE spreads short sequences "
                "over a longer target length."
            )

    def _check_choices(self) -> None:
        if self.objective not in ("auto", "causal", "mlm"):
            raise InvalidConfigError(f"objective must be auto, causal or mlm, got {self.objective!r}.")
        if self.mixed_precision not in ("no", "fp16", "bf16"):
            raise InvalidConfigError(f"mixed_precision must be no, fp16 or bf16, got {self.mixed_precision!r}.")
        if self.lr_schedule not in LR_SCHEDULES:
            raise InvalidConfigError(
                f"lr_schedule {self.lr_schedule!r} is not supported; choose one of {', '.join(LR_SCHEDULES)}."
            )
        if self.lr_schedule == "polynomial" and self.lr <= POLYNOMIAL_END_LR:
            raise InvalidConfigError(
                f"FinetuneConfig.lr_schedule 'polynomial' decays to {POLYNOMIAL_END_LR:g}, so FinetuneConfig.lr must "
                f"be above it, got {self.lr!r}; pass a larger FinetuneConfig.lr or another FinetuneConfig.lr_schedule."
            )
        if self.extend_method is not None and self.extend_to is None:
            raise InvalidConfigError(
                f"extend_method={self.extend_method!r} needs extend_to (the new context length): pass --extend-to N."
            )
        if self.extend_options and self.extend_to is None:
            raise InvalidConfigError(
                f"extend_options {self.extend_options} need extend_to (the new context length): pass --extend-to N."
            )
        if self.scheme_options and self.scheme is None:
            raise InvalidConfigError(
                f"scheme_options {self.scheme_options} need a scheme to apply to (they would be ignored): pass "
                "--scheme NAME with --scheme-option."
            )
        if self.merge_lora and not self.lora:
            raise InvalidConfigError("merge_lora needs lora=True.")
        if self.resume and self.overwrite_output_dir:
            raise InvalidConfigError("resume and overwrite_output_dir exclude each other: pick one.")

    def _check_numbers(self) -> None:
        """Float settings: finite and inside the range where training can work (a zero temperature or masking
        probability, or an infinite learning rate, gives NaN weights)."""
        checks = (  # name, lowest, lowest allowed?, highest, highest allowed?, advice
            ("lr", 0.0, False, 1.0, True, "a learning rate such as 1e-4"),  # AdamW steps move weights by ~lr
            ("weight_decay", 0.0, True, math.inf, False, "0.0 or a small value such as 0.01"),
            ("max_grad_norm", 0.0, True, math.inf, False, "1.0, or 0 for no clipping"),
            ("lora_alpha", 0.0, False, math.inf, False, "e.g. 16"),
            ("lora_dropout", 0.0, True, 1.0, False, "e.g. 0.05"),
            ("distill_weight", 0.0, True, 1.0, True, "e.g. 0.5"),
            # outside [0.01, 100] the T^2-scaled KL underflows to 0 (nothing trains) or overflows to NaN
            ("distill_temperature", 0.01, True, 100.0, True, "e.g. 1.0 or 2.0"),
            ("mlm_probability", 0.0, False, 1.0, True, "e.g. 0.15"),
            ("eval_fraction", 0.0, True, 1.0, False, "e.g. 0.05, or 0 for no held-out data"),
        )
        for name, low, low_ok, high, high_ok, advice in checks:
            value = getattr(self, name)
            number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
            inside = math.isfinite(number) and (number >= low if low_ok else number > low)
            inside = inside and (number <= high if high_ok else number < high)
            if not inside:
                interval = f"{'[' if low_ok else '('}{low:g}, {high:g}{']' if high_ok else ')'}"
                raise InvalidConfigError(f"{name} must be a finite number in {interval}, got {value!r}; use {advice}.")


#: settings that may differ when a run is resumed: how long to train and how often to measure and save.
#: Changing ``steps`` recomputes a decaying learning-rate schedule for the new total from the resumed step on.
RESUME_SAFE = ("steps", "eval_every", "save_every")
#: run-control flags that are not settings of the run (a resume may change them)
RUN_CONTROL = ("resume", "overwrite_output_dir", "progress")


class _OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad command line on one stderr line (no usage block) and exits with 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


#: (flag, type, default, help) of the numeric options, in --help order
NUMERIC_OPTIONS = (
    ("seq-len", int, 512, "tokens per training sequence"),
    ("batch-size", int, 4, "sequences per batch and process"),
    ("grad-accum", int, 1, "batches accumulated per optimizer step"),
    ("steps", int, 100, "optimizer steps to train"),
    ("lr", float, 1e-4, "AdamW learning rate"),
    ("warmup-steps", int, 0, "steps of linear learning-rate warm-up"),
    ("weight-decay", float, 0.0, "AdamW weight decay"),
    ("max-grad-norm", float, 1.0, "clip the gradient norm to this (0: no clipping)"),
    ("lora-r", int, 8, "LoRA rank (with --lora)"),
    ("lora-alpha", int, 16, "LoRA scaling alpha (with --lora)"),
    ("lora-dropout", float, 0.0, "dropout on the LoRA path (with --lora)"),
    ("distill-weight", float, 1.0, "share of the distillation loss in [0, 1] (with --distill)"),
    ("distill-temperature", float, 1.0, "softmax temperature of the distillation KL (with --distill)"),
    ("pose-target", int, None, "PoSE: spread the position ids of each sequence over this many tokens"),
    ("mlm-probability", float, 0.15, "share of tokens masked for the masked-LM objective"),
    ("eval-fraction", float, 0.05, "share of the packed data held out for evaluation (0: none)"),
    ("eval-every", int, 50, "measure the held-out loss every N steps (0: only at the end)"),
    ("save-every", int, 100, "write a checkpoint every N steps (0: only at the end)"),
    ("seed", int, 0, "random seed (data order, initialisation, masking)"),
)
#: the on/off flags
FLAGS = (
    ("gradient-checkpointing", "recompute activations in backward (less memory, more time)"),
    ("lora", "train LoRA adapters (peft) plus the position modules"),
    ("merge-lora", "also save the merged full model (with --lora)"),
    ("distill", "distil from the unswapped original"),
    ("resume", "continue from the newest valid checkpoint in --output"),
    ("overwrite-output-dir", "replace a previous run in --output (removes only run files)"),
)


def build_parser(prog: str = "hf-posswap finetune",
                 formatter_class: type[argparse.HelpFormatter] = argparse.HelpFormatter) -> argparse.ArgumentParser:
    """The ``finetune`` command line; needs no torch, so ``--help`` answers at once."""
    parser = _OneLineParser(prog=prog, description="Fine-tune a model with swapped positions (accelerate).",
                            formatter_class=formatter_class)
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--data", nargs="+", required=True,
                        help="text / jsonl / json files (globs) or datasets directories")
    parser.add_argument("--output", required=True, help="run directory")
    parser.add_argument("--scheme", help="swap to this scheme first (see `hf-posswap schemes`)")
    parser.add_argument("--scheme-option", action="append", default=[], metavar="KEY=JSON",
                        help="an option of the scheme, e.g. --scheme-option num_buckets=64 (repeatable)")
    parser.add_argument("--extend-to", type=int, help="extend the context to this many tokens first")
    parser.add_argument("--extend-method", help="extension method (default: yarn for RoPE, interpolate for tables)")
    parser.add_argument("--extend-option", action="append", default=[], metavar="KEY=JSON",
                        help="an option of the extension method, e.g. --extend-option beta_fast=16 (repeatable)")
    parser.add_argument("--objective", choices=["auto", "causal", "mlm"], default="auto",
                        help="causal (next token) or mlm (masked LM); auto: mlm for BERT encoders, else causal")
    for name, kind, default, text in NUMERIC_OPTIONS:
        parser.add_argument(f"--{name}", type=kind, default=default, help=text)
    parser.add_argument("--lr-schedule", default="cosine", help=f"one of {', '.join(LR_SCHEDULES)}")
    parser.add_argument("--mixed-precision", choices=["no", "fp16", "bf16"], default="no",
                        help="train in reduced precision through accelerate")
    parser.add_argument("--accelerate-config", metavar="YAML",
                        help="an `accelerate config` file whose FSDP (CUDA) or DeepSpeed settings shard the model")
    parser.add_argument("--text-field", default="text", help="jsonl / json / datasets field holding the text")
    for flag, text in FLAGS:
        parser.add_argument(f"--{flag}", action="store_true", help=text)
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress on stderr (a bar on a terminal, plain lines in a log); TQDM_DISABLE=1 too")
    return parser


def parse_options(items: list[str]) -> dict[str, Any]:
    """``["num_buckets=64", "scaling={...}"]`` -> dict; values are JSON when they parse (Python's ``True``,
    ``False`` and ``None`` are read as JSON's ``true``, ``false`` and ``null``), else strings."""
    options: dict[str, Any] = {}
    python_words = {"True": True, "False": False, "None": None}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise InvalidConfigError(f"Options are KEY=VALUE, got {item!r}.")
        if key in options:
            raise InvalidConfigError(f"Option {key!r} is given twice ({item!r} after an earlier {key}=...); give it "
                                     "once.")
        if value in python_words:
            options[key] = python_words[value]
            continue
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def config_from_args(args: argparse.Namespace) -> FinetuneConfig:
    options = parse_options(args.scheme_option)
    extend_options = parse_options(getattr(args, "extend_option", []))
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(FinetuneConfig) if hasattr(args, f.name)}
    return FinetuneConfig(**{**values, "scheme_options": options, "extend_options": extend_options,
                             "progress": not getattr(args, "no_progress", False)})
