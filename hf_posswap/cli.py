"""``hf-posswap``: the command line. Subcommands: ``demo`` (the main job), ``schemes`` (the support matrix)."""

from __future__ import annotations

import argparse
import sys

from .errors import PosSwapError


def _schemes(argv: list[str]) -> int:
    from .matrix import support_matrix_markdown

    argparse.ArgumentParser(prog="hf-posswap schemes", description="Print the family x scheme matrix.").parse_args(argv)
    print(support_matrix_markdown())
    return 0


def _demo(argv: list[str]) -> int:
    from .demo import main as demo_main

    return demo_main(argv)


def _finetune(argv: list[str]) -> int:
    from .finetune import main as finetune_main

    return finetune_main(argv)


def _export(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="hf-posswap export",
        description="Write a trust_remote_code copy of an hf_posswap checkpoint that loads without hf_posswap.",
    )
    parser.add_argument("checkpoint", help="a checkpoint saved from a swapped model")
    parser.add_argument("output", help="directory to write")
    args = parser.parse_args(argv)
    from transformers import AutoConfig

    from .autoload import AUTO_CLASSES
    from .export import export_standalone

    config = AutoConfig.from_pretrained(args.checkpoint)
    model = _auto_class_for(config, AUTO_CLASSES).from_pretrained(args.checkpoint)
    path = export_standalone(model, args.output)
    print(f"wrote {path} ({type(model).__name__}); load it with trust_remote_code=True")
    return 0


def _auto_class_for(config, auto_classes) -> type:
    """The Auto class whose model for this config is the saved architecture (AutoModel when none matches)."""
    architecture = (getattr(config, "architectures", None) or [""])[0].removeprefix("PosSwap")
    for auto in auto_classes:
        try:
            model_class = auto._model_mapping[type(config)]
        except KeyError:
            continue
        if model_class.__name__.removeprefix("PosSwap") == architecture:
            return auto
    return auto_classes[0]


def _eval(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hf-posswap eval", description="Perplexity against length and passkey.")
    parser.add_argument("--model", required=True, help="checkpoint directory (hf_posswap or plain)")
    parser.add_argument("--lengths", nargs="*", type=int, default=[], help="context lengths for perplexity")
    parser.add_argument("--mode", nargs="+", default=["windows"], choices=["windows", "sliding", "tail"])
    parser.add_argument("--stride", type=int, help="sliding-window stride (default: length / 2)")
    parser.add_argument("--tail-from", type=int, help="tail NLL: score positions from here (default: trained length)")
    parser.add_argument("--max-windows", type=int, default=4, help="windows per length (0: all)")
    parser.add_argument("--text", nargs="*", help="text files to evaluate on (default: a built-in corpus)")
    parser.add_argument("--corpus", default="reference", choices=["reference", "pydoc", "stdlib"])
    parser.add_argument("--passkey-lengths", nargs="*", type=int, default=[])
    parser.add_argument("--depths", nargs="*", type=float, default=[0.0, 0.5, 1.0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--output", help="write the results as JSON here")
    args = parser.parse_args(argv)
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .evaluation import evaluate

    text = "\n\n".join(Path(p).read_text(encoding="utf-8") for p in args.text) if args.text else None
    model = AutoModelForCausalLM.from_pretrained(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    results = evaluate(model, tokenizer, args.lengths, text=text, corpus=args.corpus, modes=args.mode,
                       stride=args.stride, tail_from=args.tail_from, max_windows=args.max_windows or None,
                       passkey_lengths=args.passkey_lengths, depths=args.depths, trials=args.trials,
                       output=args.output)
    for row in results["perplexity"]:
        print(f"perplexity  length {row['length']:>6}  {row['mode']:<8} {row['perplexity']:10.3f}  "
              f"({row['tokens']} tokens)")
    for row in results["passkey"]:
        print(f"passkey     length {row['length']:>6}  depth {row['depth']:.2f}  accuracy {row['accuracy']:.2f}")
    return 0


def _load_any(path: str):
    """A checkpoint through the Auto class of its saved architecture."""
    from transformers import AutoConfig

    from .autoload import AUTO_CLASSES

    return _auto_class_for(AutoConfig.from_pretrained(path), AUTO_CLASSES).from_pretrained(path)


def _save_with_tokenizer(model, source: str, output: str) -> None:
    model.save_pretrained(output)
    try:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(source).save_pretrained(output)
    except (OSError, ValueError):
        pass  # a checkpoint without a tokenizer stays without one


def _swap_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hf-posswap swap", description="Swap a checkpoint's positions and save it.")
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--scheme", required=True, help="scheme name (see `hf-posswap schemes`)")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=JSON", help="a scheme option")
    parser.add_argument("--output", required=True, help="directory to write")
    args = parser.parse_args(argv)
    from .describe import describe
    from .swap import swap, swap_state
    from .training.config import parse_options

    model = _load_any(args.model)
    swap(model, args.scheme, replace=swap_state(model) is not None, **parse_options(args.option))
    _save_with_tokenizer(model, args.model, args.output)
    print(describe(model))
    print(f"wrote {args.output}")
    return 0


def _extend_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hf-posswap extend", description="Extend a checkpoint's context and save.")
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--to", type=int, required=True, help="new context length in tokens")
    parser.add_argument("--method", help="yarn, dynamic, linear, ntk, longrope, llama3, self_extend, interpolate, ...")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=JSON", help="a method option")
    parser.add_argument("--output", required=True, help="directory to write")
    args = parser.parse_args(argv)
    from .describe import describe
    from .extend import extend_context
    from .training.config import parse_options

    model = _load_any(args.model)
    extend_context(model, args.to, args.method, **parse_options(args.option))
    _save_with_tokenizer(model, args.model, args.output)
    print(describe(model))
    print(f"wrote {args.output}")
    return 0


def _inspect(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hf-posswap inspect", description="Pictures of a model's position scheme.")
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--scheme", help="swap to this scheme first (default: what the checkpoint carries)")
    parser.add_argument("--length", type=int, default=256, help="positions to draw")
    parser.add_argument("--output", default="inspect", help="directory for the PNG files")
    args = parser.parse_args(argv)
    from transformers import AutoModel

    from .evaluation.plots import position_pictures
    from .swap import swap, swap_state

    model = AutoModel.from_pretrained(args.model)
    if args.scheme:
        swap(model, args.scheme, replace=swap_state(model) is not None)
    for path in position_pictures(model, args.output, args.length):
        print(f"wrote {path}")
    return 0


def _plot(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hf-posswap plot", description="Plot `hf-posswap eval` results.")
    parser.add_argument("runs", nargs="+", help="results.json files, optionally labelled: label=results.json")
    parser.add_argument("--mode", default="windows", choices=["windows", "sliding", "tail"])
    parser.add_argument("--trained-length", type=int, help="draw a line at the trained length")
    parser.add_argument("--output", default="perplexity.png")
    parser.add_argument("--passkey-output", help="also draw the passkey heatmap of the first run here")
    args = parser.parse_args(argv)
    from .evaluation.plots import load_runs, plot_passkey, plot_perplexity

    runs = load_runs(args.runs)
    print(f"wrote {plot_perplexity(runs, args.output, args.mode, args.trained_length)}")
    if args.passkey_output:
        print(f"wrote {plot_passkey(next(iter(runs.values())), args.passkey_output)}")
    return 0


COMMANDS = {
    "demo": _demo,
    "eval": _eval,
    "export": _export,
    "extend": _extend_command,
    "finetune": _finetune,
    "inspect": _inspect,
    "plot": _plot,
    "schemes": _schemes,
    "swap": _swap_command,
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: hf-posswap {demo,eval,export,extend,finetune,inspect,plot,schemes,swap} [options]\n\n"
            "  demo     swap the built-in SmolLM2 checkpoint to several schemes and compare them\n"
            "  eval     perplexity against length and passkey retrieval, as JSON\n"
            "  swap     swap a checkpoint's position scheme and save it\n"
            "  extend   extend a checkpoint's context length and save it\n"
            "  export   write a trust_remote_code checkpoint that loads without hf_posswap\n"
            "  finetune fine-tune a model with swapped positions (accelerate; LoRA via peft)\n"
            "  inspect  pictures of a position scheme (cosine distances, RoPE q.k, bias heads)\n"
            "  plot     perplexity-against-length and passkey pictures from `eval` results\n"
            "  schemes  print the family x scheme support matrix\n\n"
            "Run `hf-posswap COMMAND --help` for the options of one command."
        )
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"hf-posswap: unknown command '{command}'; choose from {', '.join(COMMANDS)}.", file=sys.stderr)
        return 2
    try:
        return COMMANDS[command](rest)
    except (PosSwapError, FileNotFoundError, RuntimeError) as error:
        print(f"hf-posswap {command}: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
