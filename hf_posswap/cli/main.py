"""``hf-posswap``: the command line.

Error policy: every user error (a bad value, a missing or corrupt file, an output that cannot be written) is a
:class:`~hf_posswap.errors.PosSwapError` raised by validation before expensive work starts; ``main`` prints it as
one line on stderr and exits 1 (2 for a malformed command line). ``OSError`` (a full disk, a permission) is also
printed as one line, and so is a failed allocation (:mod:`~hf_posswap.cli.console`). Anything else is a bug and
keeps its traceback.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

from ..errors import InvalidConfigError, PosSwapError, one_line
from .console import (
    library_bars_for,
    one_line_warning,
    out_of_memory,
    out_of_memory_message,
    program_notes_hidden,
)
from .parser import INSPECT_LENGTH, MAX_INSPECT_LENGTH, PARSERS, UsageError, wants_help
from .recipe import given_training_options
from .wording import in_cli_words


def _schemes(argv: list[str]) -> int:
    PARSERS["schemes"]().parse_args(argv)
    from .matrix import scheme_options_text, support_matrix_markdown

    print(support_matrix_markdown())
    print()
    print(scheme_options_text())
    return 0


def _doctor(argv: list[str]) -> int:
    PARSERS["doctor"]().parse_args(argv)
    from ..evaluation.self_check import self_check

    report = self_check()
    print(report.table())
    return 0 if report.ok else 1


def _demo(argv: list[str]) -> int:
    if not wants_help(argv):  # the demo loads checkpoints with transformers' Auto classes itself
        from ..persistence.autoload import register

        register()
    from .demo import main as demo_main

    return demo_main(argv)


def _finetune(argv: list[str]) -> int:
    from .finetune import main as finetune_main

    return finetune_main(argv)  # checks --model (and everything else) itself, before anything runs


def _options(items: list[str]) -> dict[str, Any]:
    from ..training.config import parse_options

    options = parse_options(items)
    for key in options:
        if not key.isidentifier():
            raise InvalidConfigError(f"--option {key!r}: option names are identifiers, as in --option factor=4.0.")
    return options


def _warn_replacing(model, scheme: str) -> None:
    """The command replaces a swap the checkpoint already carries (as ``replace=True``): say so, and what is lost."""
    from ..core.state import swap_state

    state = swap_state(model)
    if state is not None:
        trained = ", ".join(name for name, _, trainable in state.new_parameters if trainable)
        lost = f" (its parameters {trained} are dropped)" if trained else ""
        print(f"hf-posswap swap: warning: the checkpoint already carries '{state.config.name}'; replacing it with "
              f"'{scheme}'{lost}.", file=sys.stderr)


def _check_scheme(name: str, options: dict[str, Any]) -> None:
    """An unknown scheme or a bad option fails here, before a model is loaded."""
    from ..schemes.base import SCHEME_REGISTRY

    try:
        SCHEME_REGISTRY.get(name).from_options(**options)
    except PosSwapError:
        raise
    except (TypeError, ValueError) as error:
        raise InvalidConfigError(f"--scheme {name} with options {options}: {error}") from error


def _load(path: str, task: str = "saved", merge: bool = True):
    """(model, tokenizer or None, source) for a checked ``--model`` path; adapters are merged unless asked not to."""
    from ..persistence.loading import inspect_model_path, load_model, load_tokenizer

    source = inspect_model_path(path)
    return load_model(source, task, merge=merge), load_tokenizer(source), source


def _save(model, tokenizer, output: str, overwrite: bool) -> None:
    """``save_pretrained`` (and the tokenizer) into a staging directory beside ``output``, then moved into place."""
    from ..persistence.saving import check_finite_weights, staged_directory

    check_finite_weights(model)
    with staged_directory(output, overwrite) as staging:
        model.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)


def _export(argv: list[str]) -> int:
    args = PARSERS["export"]().parse_args(argv)
    from ..persistence.export import export_standalone
    from ..persistence.loading import inspect_model_path
    from .checks import check_checkpoint_output, check_exportable

    check_checkpoint_output(args.output, args.overwrite, flag="output")
    check_exportable(inspect_model_path(args.checkpoint, flag="checkpoint"), args.checkpoint)
    model, tokenizer, _ = _load(args.checkpoint)
    path = export_standalone(model, args.output, overwrite=args.overwrite, tokenizer=tokenizer)
    print(f"wrote {path} ({type(model).__name__}); load it with trust_remote_code=True")
    return 0


def _eval(argv: list[str]) -> int:
    args = PARSERS["eval"]().parse_args(argv)
    from ..evaluation import check_passkey_lengths, evaluate
    from ..evaluation.checks import check_results_output, check_settings
    from ..evaluation.corpora import tokenize_once
    from ..persistence.loading import inspect_model_path, load_model, load_tokenizer
    from ..persistence.user_files import read_text_files
    from .checks import check_learned_table, check_text_covers, write_results

    check_settings(args.lengths, args.mode, args.stride, args.tail_from, args.max_windows, args.passkey_lengths,
                   args.depths, args.trials)
    if args.output is not None:
        check_results_output(args.output)
    elif sys.stdout is None:  # started with stdout closed (`>&-`): the results would be computed and thrown away
        raise InvalidConfigError("stdout is closed and no --output was given, so the results would be lost; pass "
                                 "--output results.json or leave stdout open.")
    text = read_text_files(args.text) if args.text else None
    source = inspect_model_path(args.model)
    if not source.is_causal():
        raise InvalidConfigError(
            f"--model {args.model!r} is a {source.model_type} encoder (bidirectional attention): next-token "
            "perplexity and passkey retrieval do not apply to it. Evaluate a causal LM (GPT-2, LLaMA, ...)."
        )
    check_learned_table(source, args.lengths)
    tokenizer = load_tokenizer(source, required=True)
    with tokenize_once():  # the length check and the evaluation read the same tokens
        # needs only the tokenizer: before the model loads
        check_text_covers(tokenizer, text, args.corpus, args.lengths)
        check_passkey_lengths(tokenizer, args.passkey_lengths, args.depths, args.trials)
        model = load_model(source, "causal", dtype=args.dtype)
        results = evaluate(model, tokenizer, args.lengths, text=text, corpus=args.corpus, modes=args.mode,
                           stride=args.stride, tail_from=args.tail_from, max_windows=args.max_windows or None,
                           passkey_lengths=args.passkey_lengths, depths=args.depths, trials=args.trials,
                           progress=not args.no_progress)
    for row in results["perplexity"]:
        print(f"perplexity  length {row['length']:>6}  {row['mode']:<8} {row['perplexity']:10.3f}  "
              f"({row['tokens']} tokens)")
    for row in results["passkey"]:
        print(f"passkey     length {row['length']:>6}  depth {row['depth']:.2f}  accuracy {row['accuracy']:.2f}")
    if args.output is not None:  # written last: a failed write prints the results as JSON first
        write_results(results, args.output)
    return 0


def _swap_command(argv: list[str]) -> int:
    args = PARSERS["swap"]().parse_args(argv)
    from ..core.state import swap_state
    from ..core.swap import swap

    options = _options(args.option)
    _check_scheme(args.scheme, options)

    def change(model) -> None:
        _warn_replacing(model, args.scheme)
        swap(model, args.scheme, replace=swap_state(model) is not None, **options)

    return _load_change_save(args, change)


def _extend_command(argv: list[str]) -> int:
    args = PARSERS["extend"]().parse_args(argv)
    from ..core.extend import available_extension_methods, extend_context

    if args.to < 1:
        raise InvalidConfigError(f"--to {args.to}: the new context length must be a positive number of tokens.")
    if args.method is not None and args.method not in available_extension_methods():
        raise InvalidConfigError(f"--method {args.method!r} is unknown; choose from "
                                 f"{', '.join(available_extension_methods())}.")
    from .checks import check_checkpoint_output

    options = _options(args.option)
    given = given_training_options(args)
    check_checkpoint_output(args.output, args.overwrite, run=args.train)
    if args.train:
        from .recipe import extend_and_train

        return extend_and_train(args, options)
    if given:
        raise UsageError(f"{', '.join(given)} {'is an option' if len(given) == 1 else 'are options'} of training; "
                         "add --train to fine-tune after extending (see hf-posswap extend --help)")
    from .checks import check_extension

    check_extension(args.model, args.to, args.method, options, train=False)
    return _load_change_save(args, lambda model: extend_context(model, args.to, args.method, **options))


def _load_change_save(args, change) -> int:
    """``swap`` and ``extend``: check the output, load ``--model``, change it, save it with its tokenizer, describe."""
    from ..core.describe import describe
    from .checks import check_checkpoint_output

    check_checkpoint_output(args.output, args.overwrite)
    model, tokenizer, _ = _load(args.model)
    change(model)
    _save(model, tokenizer, args.output, args.overwrite)
    print(describe(model))
    print(f"wrote {args.output}")
    return 0


def _inspect(argv: list[str]) -> int:
    args = PARSERS["inspect"]().parse_args(argv)
    from ..core.state import swap_state
    from ..core.swap import swap
    from ..evaluation.checks import check_lengths_fit, learned_table_size
    from ..evaluation.plots import position_pictures
    from ..persistence.saving import check_output_dir

    if args.scheme:
        _check_scheme(args.scheme, {})
    from ..persistence.output_names import check_output_given
    from .checks import check_drawable, check_inspect_length

    check_inspect_length(args.length, MAX_INSPECT_LENGTH)
    check_output_given(args.output, example="pictures/")
    check_drawable(args.model, args.scheme)
    if Path(args.output).exists() and not Path(args.output).is_dir():
        raise InvalidConfigError(f"--output {args.output!r} is a file; give a directory for the PNG files.")
    check_output_dir(args.output, overwrite=True, kind="files")  # the pictures replace only their own files
    model, _, _ = _load(args.model)
    if args.scheme:
        swap(model, args.scheme, replace=swap_state(model) is not None)
    length = args.length
    if length is None:  # the default, shortened to a learned table that holds fewer positions
        table = learned_table_size(model)
        length = min(INSPECT_LENGTH, table[1]) if table is not None else INSPECT_LENGTH
    check_lengths_fit(model, length)
    Path(args.output).mkdir(exist_ok=True)
    paths = position_pictures(model, args.output, length)
    for path in paths:
        print(f"wrote {path}")
    if not paths:  # NoPE: nothing carries position, so there is no picture to draw
        scheme = swap_state(model).config.name if swap_state(model) is not None else "native"
        print(f"hf-posswap inspect: scheme '{scheme}' carries no position signal to draw; nothing was written.",
              file=sys.stderr)
        return 1
    return 0


def _plot(argv: list[str]) -> int:
    args = PARSERS["plot"]().parse_args(argv)
    from ..evaluation.plots import check_picture_output, load_runs, plot_passkey, plot_perplexity
    from ..evaluation.results_files import has_perplexity

    if args.trained_length is not None and args.trained_length < 1:
        raise InvalidConfigError(f"--trained-length {args.trained_length}: give a positive number of tokens.")
    check_picture_output(args.output)
    if args.passkey_output:
        check_picture_output(args.passkey_output, flag="--passkey-output")
        if Path(args.passkey_output).resolve() == Path(args.output).resolve():
            raise InvalidConfigError(f"--passkey-output {args.passkey_output!r} is also --output: the heatmap would "
                                     "replace the perplexity picture; give it another file name.")
    runs = load_runs(args.runs, args.mode, passkey=bool(args.passkey_output))
    if has_perplexity(runs):
        print(f"wrote {plot_perplexity(runs, args.output, args.mode, args.trained_length)}")
    elif not args.passkey_output:  # passkey-only results and no heatmap asked for: nothing would be drawn
        raise InvalidConfigError(f"{', '.join(repr(run) for run in args.runs)}: no perplexity rows to draw (eval ran "
                                 "without --lengths); draw the passkey results with --passkey-output passkey.png.")
    else:  # a passkey-only eval: its heatmap is what there is to draw
        print(f"skipped {args.output}: the results hold no perplexity rows (eval ran without --lengths)")
    if args.passkey_output:
        label, results = next(iter(runs.items()))  # the first run: the picture names it
        print(f"wrote {plot_passkey(results, args.passkey_output, title=f'Passkey retrieval: {label}')}")
    return 0


COMMANDS = {
    "demo": _demo,
    "doctor": _doctor,
    "eval": _eval,
    "export": _export,
    "extend": _extend_command,
    "finetune": _finetune,
    "inspect": _inspect,
    "plot": _plot,
    "schemes": _schemes,
    "swap": _swap_command,
}

USAGE = """usage: hf-posswap {demo,doctor,eval,export,extend,finetune,inspect,plot,schemes,swap} [options]

  demo     swap the built-in SmolLM2 checkpoint to several schemes and compare them
  doctor   check that hf_posswap computes the right numbers with the installed transformers, torch, peft
  eval     perplexity against length and passkey retrieval, as JSON
  swap     swap a checkpoint's position scheme and save it
  extend   extend a checkpoint's context length and save it (--train: and fine-tune it, PoSE + LoRA)
  export   write a trust_remote_code checkpoint that loads without hf_posswap
  finetune fine-tune a model with swapped positions (accelerate; LoRA via peft)
  inspect  pictures of a position scheme (cosine distances, RoPE q.k, bias heads)
  plot     perplexity-against-length and passkey pictures from `eval` results
  schemes  print the family x scheme support matrix

Run `hf-posswap COMMAND --help` for the options of one command; `hf-posswap --version` prints the version."""


def main(argv: list[str] | None = None) -> int:
    """Run one command; the exit status (0, 1 for a user error, 2 for a malformed command line).

    Run as the program (``argv`` None: the console script, ``python -m hf_posswap``), Python warnings are printed as
    one line each (``hf-posswap plot: warning: ...``), and the warning machinery is restored on return; DeepSpeed's
    note on CPU machines is hidden (``console.program_notes_hidden``). A caller
    that passes ``argv`` keeps its own display of warnings (``catch_warnings(record=True)`` still records them)."""
    program = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = f"hf-posswap {argv[0]}" if argv and argv[0] in COMMANDS else "hf-posswap"
    with warnings.catch_warnings(), program_notes_hidden(program):
        if program:
            warnings.showwarning = one_line_warning(prog)
        try:
            return _run(argv)
        except BrokenPipeError:  # `hf-posswap ... | head` closed our stdout: stop quietly, as other commands do
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 141


def _run(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv[0] in ("-V", "--version"):
        from ..version import __version__

        print(f"hf-posswap {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"hf-posswap: unknown command '{command}'; choose from {', '.join(COMMANDS)}.", file=sys.stderr)
        return 2
    try:
        with library_bars_for(command, rest):
            return COMMANDS[command](rest)
    except UsageError as error:
        print(f"hf-posswap {command}: {error}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        raise
    except (PosSwapError, OSError) as error:
        print(f"hf-posswap {command}: {in_cli_words(command, one_line(error))}", file=sys.stderr)
        return 1
    except (MemoryError, RuntimeError) as error:
        if not out_of_memory(error):
            raise
        print(f"hf-posswap {command}: {out_of_memory_message(error)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"hf-posswap {command}: interrupted; outputs are written atomically, so nothing half-written was "
              "left.", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
