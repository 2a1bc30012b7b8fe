"""``import hf_posswap`` costs what a user's script imports anyway: no modeling file and none of transformers'
model-loading machinery is imported until a family is used, and swapped checkpoints still load through the Auto
classes in a fresh process (the registration is lazy, not missing). Timing itself is measured by
``scripts/benchmarks/bench_cli.py``; these tests check the imports, which decide it."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import pytest
import torch
from conftest import swapped

PROBE = """
import json, sys
import torch
from transformers import AutoModelForCausalLM, AutoModel  # what a script that loads a model imports anyway
before = set(sys.modules)
import hf_posswap
heavy = sorted(m for m in set(sys.modules) - before
               if (m.startswith("transformers.models.") and ".modeling_" in m)
               or m == "transformers.modeling_utils" or m.startswith("torch.distributed.tensor"))
print(json.dumps(heavy))
"""


def test_import_adds_no_modeling_file_to_what_a_script_imports_anyway() -> None:
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


@pytest.mark.slow
def test_a_fresh_process_loads_a_swapped_checkpoint_through_the_auto_class(tmp_path) -> None:
    model = swapped("llama", "alibi")
    model.save_pretrained(tmp_path)
    input_ids = torch.arange(3, 19)[None]
    expected = model(input_ids=input_ids).logits[0, -1].tolist()
    script = f"""
import json, torch, hf_posswap
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})
print(json.dumps(model(input_ids=torch.arange(3, 19)[None]).logits[0, -1].tolist()))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    torch.testing.assert_close(torch.tensor(json.loads(result.stdout.strip().splitlines()[-1])),
                               torch.tensor(expected), atol=1e-5, rtol=1e-5)


def test_a_pickled_config_unpickles_in_a_fresh_process() -> None:
    """pickle names ``hf_posswap.core.state.PosSwap<Config>``: the class is built on that lookup."""
    config = swapped("gpt2", "t5").config
    script = "import pickle, sys; config = pickle.loads(sys.stdin.buffer.read()); print(type(config).__name__, " \
             "config.posswap['scheme'])"
    result = subprocess.run([sys.executable, "-c", script], input=pickle.dumps(config), capture_output=True,
                            check=True)
    assert result.stdout.decode().split() == ["PosSwapGPT2Config", "t5"]


def test_a_swapped_config_builds_a_model_through_the_auto_class_at_once() -> None:
    """No checkpoint is read, so no stand-in resolves: the swap itself registers its family's classes."""
    script = """
import hf_posswap as ps
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
config = LlamaConfig(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64)
model = ps.swap(LlamaForCausalLM(config), "alibi")
print(type(AutoModelForCausalLM.from_config(model.config)).__name__, ps.describe(model).scheme)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["PosSwapLlamaForCausalLM", "alibi"]
