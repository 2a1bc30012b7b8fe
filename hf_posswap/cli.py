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


COMMANDS = {"demo": _demo, "export": _export, "finetune": _finetune, "schemes": _schemes}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: hf-posswap {demo,export,finetune,schemes} [options]\n\n"
            "  demo     swap the built-in SmolLM2 checkpoint to several schemes and compare them\n"
            "  export   write a trust_remote_code checkpoint that loads without hf_posswap\n"
            "  finetune fine-tune a model with swapped positions (accelerate; LoRA via peft)\n"
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
