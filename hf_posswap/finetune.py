"""``python -m hf_posswap.finetune`` / ``hf-posswap finetune`` / ``accelerate launch -m hf_posswap.finetune``."""

from __future__ import annotations

import sys

from .training.config import FinetuneConfig, build_parser, config_from_args
from .training.loop import finetune

__all__ = ["FinetuneConfig", "finetune", "main"]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    result = finetune(config_from_args(args))
    print(f"finished {result['steps']} steps: train loss {result['train_loss']:.4f}, "
          f"eval loss {result['eval_loss']}, written to {result['output']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
