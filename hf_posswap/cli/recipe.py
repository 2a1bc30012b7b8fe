"""``hf-posswap extend ... --train``: extend the context, fine-tune briefly with PoSE, write one checkpoint.

The recipe of YaRN (Peng et al. 2023, §4: scale RoPE, then a short fine-tune) and PoSE (Zhu et al. 2024,
arXiv:2309.10400: train at a short length with position ids that skip ahead, so the target length is covered
without sequences that long). The steps:

1. every value is checked from the command line and the small files of ``--model`` alone (the training settings,
   the extension and its options, ``--output``), before any model is loaded;
2. ``finetune`` runs in ``<output>/training`` (loads, extends, trains LoRA adapters or the full model; resumable
   checkpoints there; ``--resume`` continues an interrupted run);
3. the merged model (LoRA merged into the weights) and its tokenizer are moved into ``<output>`` with
   ``config.json`` last, so ``<output>`` holds a complete checkpoint or none. A LLaMA-like model extended with a
   RoPE scaling stays a plain transformers checkpoint (``rope_parameters`` in its config): it reloads without
   hf_posswap. The run's resumable checkpoints are then removed; its settings, loss log and adapter stay.

The parser half (``add_training_options``) imports neither torch nor transformers (``--help`` answers at once).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import InvalidConfigError, PosSwapError, one_line
from .wording import in_cli_words

#: the run directory inside ``--output``, and the file that marks its run finished (written after the model)
RUN_DIR = "training"
RESULT_FILE = "result.json"
#: warm-up steps of the recipe unless --warmup-steps says otherwise (fewer when the run is shorter)
DEFAULT_WARMUP_STEPS = 10
#: (flag, type, default, help) of the training options; a default of None is computed (see the help)
TRAIN_OPTIONS: tuple[tuple[str, type, Any, str], ...] = (
    ("steps", int, 100, "optimizer steps"),
    ("seq-len", int, 2048, "tokens per training sequence (PoSE spreads their position ids over --pose-target)"),
    ("batch-size", int, 1, "sequences per batch"),
    ("grad-accum", int, 1, "batches accumulated per optimizer step"),
    ("lr", float, 2e-4, "AdamW learning rate"),
    ("warmup-steps", int, None, "steps of linear learning-rate warm-up, then cosine decay (default: 10, or --steps "
                                "when fewer)"),
    ("lora-r", int, 8, "LoRA rank"),
    ("lora-alpha", int, 16, "LoRA scaling alpha"),
    ("pose-target", int, None, "PoSE: position ids of each sequence span this many tokens (default: --to)"),
    ("eval-fraction", float, 0.02, "share of the packed data held out for the closing held-out loss (0: none)"),
    ("save-every", int, 25, "write a resumable checkpoint every N steps"),
    ("seed", int, 0, "random seed (data order, PoSE skips, LoRA initialisation)"),
)
TRAIN_FLAGS = (
    ("full", "train every weight instead of LoRA adapters (the checkpoint is then the trained model itself)"),
    ("no-pose", "train with plain positions 0..seq-len-1 instead of PoSE"),
    ("gradient-checkpointing", "recompute activations in backward (less memory, more time)"),
    ("resume", "continue the interrupted run in <output>/training from its newest valid checkpoint"),
)
#: every training option's argparse ``dest`` (given without --train, they are refused)
TRAIN_NAMES = ("data", *(flag.replace("-", "_") for flag, *_ in TRAIN_OPTIONS),
               *(flag.replace("-", "_") for flag, _ in TRAIN_FLAGS))


def add_training_options(parser: argparse.ArgumentParser) -> None:
    """``--train`` and its options, as one group of ``hf-posswap extend --help``. Their defaults are filled in by
    :func:`training_settings`, so that an option given without ``--train`` can be told apart and refused."""
    group = parser.add_argument_group(
        "extend and train (--train)",
        "After extending, fine-tune briefly with PoSE (LoRA by default) and write the merged model to --output; "
        "the run itself (settings, loss log, resumable checkpoints, the LoRA adapter) goes to <output>/training.")
    group.add_argument("--train", action="store_true", help="fine-tune the extended model before saving it")
    group.add_argument("--data", nargs="+", default=argparse.SUPPRESS, metavar="FILE",
                       help="training text: text/jsonl files or globs (required with --train); use text your "
                            "evaluation does not")
    for flag, kind, default, text in TRAIN_OPTIONS:
        shown = f" (default: {default})" if default is not None else ""
        group.add_argument(f"--{flag}", type=kind, default=argparse.SUPPRESS, help=text + shown)
    for flag, text in TRAIN_FLAGS:
        group.add_argument(f"--{flag}", action="store_true", default=argparse.SUPPRESS, help=text)


def given_training_options(args: argparse.Namespace) -> list[str]:
    """The training options present on the command line (``--steps`` and so on)."""
    return [f"--{name.replace('_', '-')}" for name in TRAIN_NAMES if hasattr(args, name)]


def training_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The training options with their defaults filled in (``pose_target`` defaults to ``--to``, ``warmup_steps`` to
    10 or the whole run when it is shorter)."""
    settings: dict[str, Any] = {flag.replace("-", "_"): default for flag, _, default, _ in TRAIN_OPTIONS}
    settings.update({flag.replace("-", "_"): False for flag, _ in TRAIN_FLAGS})
    settings.update({name: getattr(args, name) for name in TRAIN_NAMES if hasattr(args, name)})
    if settings["pose_target"] is None and not settings["no_pose"]:
        settings["pose_target"] = args.to
    if settings["warmup_steps"] is None:
        settings["warmup_steps"] = min(DEFAULT_WARMUP_STEPS, settings["steps"])
    return settings


# --- checks before anything loads --------------------------------------------------------------------------------


def check_run_output(output: str, resume: bool, overwrite: bool) -> None:
    """``--output`` can take this run: new or empty; an interrupted run only with ``--resume`` (or ``--overwrite``
    to start again); a finished one only with ``--overwrite``."""
    from ..persistence.saving import check_output_dir
    from ..training.guards import previous_run_files
    from ..training.run_checkpoints import has_checkpoint_dirs

    if resume and overwrite:
        raise InvalidConfigError("--resume and --overwrite exclude each other: --resume continues the run in "
                                 "<output>/training, --overwrite starts it again. Pick one.")
    target, run = Path(output), Path(output) / RUN_DIR
    previous = previous_run_files(run) if run.is_dir() else []
    finished = (run / RESULT_FILE).is_file() and (target / "config.json").is_file() and not has_checkpoint_dirs(run)
    if resume and finished:
        raise InvalidConfigError(f"--resume: the run in {output!r} finished (its model is there); nothing to "
                                 "continue. Pass --overwrite to train again, or another --output.")
    if resume and (target / "config.json").is_file() and not previous:
        raise InvalidConfigError(f"--resume: {output!r} holds a checkpoint but no run to continue "
                                 f"({RUN_DIR}/ is missing); pass --overwrite to replace it, or another --output.")
    if finished and not (resume or overwrite):
        raise InvalidConfigError(
            f"--output {output!r} holds a finished extend --train run (its model is there, and {RUN_DIR}/ its "
            "settings and loss log); pass another --output, or --overwrite to train again in its place.")
    if previous and not (resume or overwrite):
        raise InvalidConfigError(
            f"--output {output!r} holds an interrupted extend --train run ({RUN_DIR}/: {', '.join(previous)}); "
            "pass --resume to continue it, --overwrite to start again, or another --output.")
    check_output_dir(output, overwrite=overwrite or resume)


def finetune_config(args: argparse.Namespace, options: dict[str, Any], settings: dict[str, Any]):
    """The ``FinetuneConfig`` of the run (validates every number; errors in the command's words)."""
    from ..training.config import FinetuneConfig

    if not settings.get("data"):
        raise InvalidConfigError("--train needs --data: the text files to fine-tune on (text the evaluation does "
                                 "not use).")
    lora_options = [f"--{name.replace('_', '-')}" for name in ("lora_r", "lora_alpha") if hasattr(args, name)]
    if settings["full"] and lora_options:
        raise InvalidConfigError(f"--full and {' and '.join(lora_options)} exclude each other: --full trains every "
                                 "weight, with no LoRA adapters to size. Drop one.")
    if settings["no_pose"] and hasattr(args, "pose_target"):
        raise InvalidConfigError("--pose-target and --no-pose exclude each other: --no-pose trains with plain "
                                 "positions. Pick one.")
    pose_target = None if settings["no_pose"] else settings["pose_target"]
    if pose_target is not None and pose_target > args.to:
        raise InvalidConfigError(f"--pose-target {pose_target} is past --to {args.to}: PoSE covers the extended "
                                 f"length, not more. Pass --pose-target {args.to} or less (or leave it out).")
    try:
        return FinetuneConfig(
            model=args.model, data=list(settings["data"]), output=str(Path(args.output) / RUN_DIR),
            extend_to=args.to, extend_method=args.method, extend_options=dict(options), objective="auto",
            seq_len=settings["seq_len"], batch_size=settings["batch_size"], grad_accum=settings["grad_accum"],
            steps=settings["steps"], lr=settings["lr"], lr_schedule="cosine", warmup_steps=settings["warmup_steps"],
            lora=not settings["full"], lora_r=settings["lora_r"], lora_alpha=settings["lora_alpha"],
            merge_lora=not settings["full"], pose_target=pose_target, eval_fraction=settings["eval_fraction"],
            eval_every=0, save_every=settings["save_every"], resume=settings["resume"],
            overwrite_output_dir=bool(args.overwrite), seed=settings["seed"],
            gradient_checkpointing=settings["gradient_checkpointing"], progress=not args.no_progress)
    except PosSwapError as error:
        raise _in_extend_words(error) from error


def _in_extend_words(error: PosSwapError) -> PosSwapError:
    """A fine-tuning error with the options of ``extend --train`` (``--overwrite``, ``--to``, ``--method``)."""
    message = in_cli_words("finetune", one_line(error))
    named = re.match(r"(\w+) must ", message)  # "lr must be a finite number ...": the setting is an option here
    if named and named.group(1) in TRAIN_NAMES:
        message = f"--{named.group(1).replace('_', '-')}{message[len(named.group(1)):]}"
    for old, new in (("--overwrite-output-dir", "--overwrite"), ("--extend-to", "--to"),
                     ("--extend-method", "--method"), ("pose_target=", "--pose-target "), ("seq_len=", "--seq-len ")):
        message = message.replace(old, new)
    try:
        return type(error)(message)
    except TypeError:  # an error class with another constructor: the message is what the command prints
        return InvalidConfigError(message)


# --- the run -----------------------------------------------------------------------------------------------------


def extend_and_train(args: argparse.Namespace, options: dict[str, Any]) -> int:
    """Check everything, train in ``<output>/training``, publish the merged model into ``<output>``."""
    from .checks import check_extension

    settings = training_settings(args)
    check_run_output(args.output, settings["resume"], bool(args.overwrite))
    check_extension(args.model, args.to, args.method, options, train=True)
    config = finetune_config(args, options, settings)
    from ..training.data import expand_paths
    from ..training.loop import finetune

    expand_paths(config.data)  # a --data pattern that matches nothing (finetune reads the files themselves)

    run = Path(config.output)
    what = f"LoRA (r {config.lora_r}, merged)" if config.lora else "every weight"
    pose = f"PoSE over {config.pose_target:,} positions" if config.pose_target else "plain positions"
    _say(f"extend --train: extending to {args.to:,} ({args.method or 'the default method'}), then {config.steps} "
         f"steps on {what}, sequences of {config.seq_len:,} tokens with {pose}; the run goes to {run}.")
    if args.overwrite:
        (run / RESULT_FILE).unlink(missing_ok=True)  # the finished mark of the run being replaced
    existed = {path for path in (Path(args.output), run) if path.exists()}
    started = time.perf_counter()
    try:
        result = finetune(config)
    except PosSwapError as error:
        _forget_failed_start(run, Path(args.output), existed)
        raise _in_extend_words(error) from error
    except KeyboardInterrupt:
        print(f"hf-posswap extend: interrupted; no new model was written to {args.output}, and the checkpoints "
              f"written so far in {run} are kept: rerun the command with --resume (in place of --overwrite) to "
              "continue.", file=sys.stderr)
        return 130
    result["train_seconds"] = round(time.perf_counter() - started, 1)  # this invocation's (a resumed run: since then)
    result["resumed"] = config.resume
    written = publish_result(run, Path(args.output), config.lora, result)
    print(f"trained {result['steps']} steps: train loss {result['train_loss']:.4g}"
          + (f", held-out loss {result['eval_loss']:.4g}" if result.get("eval_loss") is not None else ""))
    print(f"wrote {args.output} ({written}); the run's settings, loss log"
          + (" and LoRA adapter" if config.lora else "") + f" are in {run}")
    return 0


def _forget_failed_start(run: Path, output: Path, existed: set[Path]) -> None:
    """A run refused before it wrote a run file (an extension option only ``extend_context`` checks, such as a
    ReRoPE window past the trained length) leaves neither its lock nor the directories it made: the corrected
    command then runs without ``--overwrite``."""
    from ..training.guards import LOCK_FILE, previous_run_files

    if run in existed or previous_run_files(run):
        return
    (run / LOCK_FILE).unlink(missing_ok=True)
    for directory in (run, output):
        if directory not in existed and directory.is_dir() and not any(directory.iterdir()):
            directory.rmdir()


def publish_result(run: Path, output: Path, lora: bool, result: dict[str, Any]) -> str:
    """Move the trained checkpoint from the run into ``output`` (``config.json`` last: until it arrives nothing
    loads), mark the run finished (``result.json``: steps, losses, seconds), then drop its resumable checkpoints.
    A crash in between leaves the checkpoints, so ``--resume`` writes the model again. Returns how it loads."""
    from ..persistence.saving import publish, write_file_atomic
    from ..training.run_checkpoints import CHECKPOINTS

    source = run / ("merged" if lora else "final")
    publish(source, output)
    shutil.rmtree(source, ignore_errors=True)
    write_file_atomic(run / RESULT_FILE, json.dumps(result, indent=2) + "\n")
    shutil.rmtree(run / CHECKPOINTS, ignore_errors=True)
    model_type = str(json.loads((output / "config.json").read_text(encoding="utf-8")).get("model_type", ""))
    if model_type.startswith("hf_posswap_"):
        return "loads with AutoModel*.from_pretrained after `import hf_posswap`"
    return "a plain transformers checkpoint: AutoModel*.from_pretrained loads it without hf_posswap"


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
