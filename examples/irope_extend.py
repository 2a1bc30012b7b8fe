"""Make a LLaMA an iRoPE model (Llama 4's design), extend it to 4x its context, fine-tune it, save and reload it.

    python examples/irope_extend.py [--model DIR] [--steps 20] [--seq-len 256] [--output runs/irope]
    python examples/irope_extend.py --tiny        # a tiny random LLaMA and a byte tokenizer: runs in seconds

iRoPE: every 4th layer drops RoPE (NoPE) and scales its queries by Llama 4's attention temperature
log(floor((pos + 1) / 8192) + 1) * 0.1 + 1; the other layers keep the model's RoPE, which ``extend_context`` scales
with YaRN (the NoPE layers have nothing to scale). The library part is the five lines marked below.
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

import hf_posswap as ps
from hf_posswap.training import FinetuneConfig, finetune


def tiny_llama() -> tuple[LlamaForCausalLM, object]:
    """A 4-layer random LLaMA (64 positions) and hf_posswap's byte tokenizer: no download."""
    from hf_posswap.evaluation import BYTE_VOCAB_SIZE, byte_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=BYTE_VOCAB_SIZE, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64,
                         pad_token_id=BYTE_VOCAB_SIZE - 1, bos_token_id=BYTE_VOCAB_SIZE - 3,
                         eos_token_id=BYTE_VOCAB_SIZE - 3)
    return LlamaForCausalLM(config), byte_tokenizer()


def write_corpus(directory: Path, count: int) -> str:
    """Python's standard library as training text (deterministic, offline); returns the glob."""
    directory.mkdir(parents=True, exist_ok=True)
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:count]:
        (directory / f"{path.stem}.txt").write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    return str(directory / "*.txt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a LLaMA-like checkpoint directory (default: SmolLM2-135M, converted offline)")
    parser.add_argument("--tiny", action="store_true", help="a tiny random LLaMA instead of a checkpoint")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--output", default="runs/irope")
    args = parser.parse_args()
    output = Path(args.output)
    data = write_corpus(output / "corpus", 4 if args.tiny else 40)
    if args.tiny:
        model, tokenizer = tiny_llama()
    else:
        from hf_posswap.persistence.offline_checkpoints import smollm2_dir

        path = args.model or smollm2_dir()
        model, tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    tokenizer.save_pretrained(output / "start")  # the fine-tuning run reads the tokenizer beside the weights

    # --- the library part -------------------------------------------------------------------------------------
    ps.swap(model, ps.llama4_irope(model))  # NoPE + temperature on every 4th layer, RoPE elsewhere
    ps.extend_context(model, 4 * model.config.max_position_embeddings)  # YaRN x4 on the RoPE layers only
    model.save_pretrained(output / "start")
    finetune(FinetuneConfig(model=str(output / "start"), data=[data], output=str(output / "run"), steps=args.steps,
                            seq_len=args.seq_len, batch_size=2, eval_every=0, save_every=args.steps, progress=False))
    reloaded = AutoModelForCausalLM.from_pretrained(output / "run" / "final")
    # ------------------------------------------------------------------------------------------------------------

    print(ps.describe(reloaded))


if __name__ == "__main__":
    main()
