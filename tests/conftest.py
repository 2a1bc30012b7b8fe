"""Tiny models built from configs (2 layers, 64 hidden) for the family x scheme matrix; no hub access."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch
from transformers import (
    BertConfig,
    BertForMaskedLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    RobertaConfig,
    RobertaForMaskedLM,
)

import hf_posswap as ps
from hf_posswap.evaluation import BYTE_VOCAB_SIZE, byte_tokenizer

#: the behaviour folders (tests/schemes, tests/core, ...): test modules import shared checks from each other by
#: basename (``from test_export import load_without_hf_posswap``), whichever folder runs first or alone, so every
#: folder is on the import path and a basename stands in one folder only (checked here, before collection)
TESTS = Path(__file__).resolve().parent
TEST_FOLDERS = sorted(p for p in TESTS.iterdir() if p.is_dir() and p.name.isidentifier() and not p.name.startswith("_"))
sys.path[1:1] = [str(folder) for folder in TEST_FOLDERS if str(folder) not in sys.path]


def _repeated_basenames() -> list[str]:
    """Test files whose name stands in two folders: one would shadow the other on the import path."""
    names = [path.name for folder in [TESTS, *TEST_FOLDERS] for path in folder.glob("*.py")]
    return sorted({name for name in names if names.count(name) > 1})


if _repeated_basenames():
    raise ImportError(f"tests/: one name, two test files (rename one): {_repeated_basenames()}")


VOCAB = 96
MAX_POSITIONS = 64
FAMILIES = ["gpt2", "bert", "llama", "gemma3_text", "phi3", "gpt_neox", "roberta"]
CAUSAL_FAMILIES = ["gpt2", "llama", "gemma3_text", "phi3", "gpt_neox"]
SCHEMES = ps.available_schemes()
#: (family, scheme) swaps that transformers expresses natively (saved as the family's own rope_parameters);
#: tests/persistence/test_checkpoints.py checks this against describe().native for every pair
NATIVE_PAIRS = {(f, "rope") for f in ("llama", "gemma3_text", "phi3", "gpt_neox")} | {
    ("llama", "proportional"),
    ("gpt_neox", "proportional"),
}


def tiny_config(family: str):
    if family == "gpt2":
        return GPT2Config(
            vocab_size=VOCAB, n_positions=MAX_POSITIONS, n_embd=64, n_layer=2, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )
    if family == "bert":
        return BertConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=MAX_POSITIONS, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            pad_token_id=0,
        )
    if family == "llama":
        return LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, max_position_embeddings=MAX_POSITIONS, rope_theta=10_000.0,
            pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )
    if family == "gemma3_text":  # one local (sliding, θ 1e4) and one global (θ 1e6) layer, as Gemma 3 mixes them
        return Gemma3TextConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=128, max_position_embeddings=MAX_POSITIONS, query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention"], sliding_window=16,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                             "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}},
            pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )
    if family == "phi3":  # half of each head rotated
        return Phi3Config(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, max_position_embeddings=MAX_POSITIONS,
            original_max_position_embeddings=MAX_POSITIONS,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5},
            resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=None,
        )
    if family == "gpt_neox":  # Pythia's layout: a quarter of each head rotated, parallel residual
        return GPTNeoXConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=MAX_POSITIONS, rotary_pct=0.25, use_parallel_residual=True,
            hidden_dropout=0.0, attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )
    if family == "roberta":  # RoBERTa's numbering: positions start at pad_token_id + 1 = 2, table 2 rows longer
        return RobertaConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=MAX_POSITIONS + 2, type_vocab_size=1, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        )
    if family == "olmo2":  # LLaMA's adapter (q/k norm over whole projections, before RoPE); not in FAMILIES (CI time)
        return Olmo2Config(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, max_position_embeddings=MAX_POSITIONS, rope_theta=10_000.0,
            pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )
    raise ValueError(family)


MODEL_CLASSES = {"gpt2": GPT2LMHeadModel, "bert": BertForMaskedLM, "llama": LlamaForCausalLM,
                 "gemma3_text": Gemma3ForCausalLM, "phi3": Phi3ForCausalLM, "gpt_neox": GPTNeoXForCausalLM,
                 "roberta": RobertaForMaskedLM, "olmo2": Olmo2ForCausalLM}


def make_model(family: str, attn: str = "sdpa", seed: int = 0) -> torch.nn.Module:
    """A tiny random model; the same seed gives the same weights whatever the attention implementation."""
    torch.manual_seed(seed)
    config = tiny_config(family)
    config._attn_implementation = attn
    model = MODEL_CLASSES[family](config).eval()
    # Randomise LayerNorm/bias terms and the lm head a little so that positions matter in logits.
    with torch.no_grad():
        for _name, param in model.named_parameters():
            if param.dim() == 1:
                param.add_(0.1 * torch.randn_like(param))
    return model


def scheme_config(scheme: str) -> ps.SchemeConfig:
    """Each scheme with settings that make its effect visible right after the swap."""
    if scheme == "t5":
        return ps.T5BiasConfig(num_buckets=16, max_distance=32)
    if scheme == "alibi":
        return ps.AlibiConfig()
    if scheme == "fire":  # a threshold L inside the test rows, so psi(max(i, L)) reads the query's position
        return ps.FireConfig(init_threshold=8.0)
    from hf_posswap.schemes import SCHEME_REGISTRY

    return SCHEME_REGISTRY.get(scheme)()


def swapped(family: str, scheme: str, attn: str = "sdpa", seed: int = 0) -> torch.nn.Module:
    model = make_model(family, attn, seed)
    ps.swap(model, scheme_config(scheme))
    if scheme == "t5":  # zero-initialised tables carry no signal: give them one so tests can see the bias
        with torch.no_grad():
            table = model.base_model.posswap_positions.tables[0].weight
            table.copy_(torch.randn_like(table))
    if scheme == "fire":  # likewise FIRE's zero-initialised output layer (and then every parameter gets a gradient)
        with torch.no_grad():
            for param in model.base_model.posswap_positions.functions[0].mlp[2].parameters():
                param.copy_(torch.randn_like(param))
    return model


def left_padded(rows: list[torch.Tensor], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` of token ids right-aligned in one batch: (input_ids [len(rows), length], attention_mask), pads 0."""
    batch = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros_like(batch)
    for i, row in enumerate(rows):
        batch[i, length - len(row):], mask[i, length - len(row):] = row, 1
    return batch, mask


def padding_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Padding-aware position ids, built as generate() builds them."""
    position_ids = attention_mask.long().cumsum(-1) - 1
    return position_ids.masked_fill(attention_mask == 0, 1)


@pytest.fixture(params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    return request.param


BYTE_VOCAB = BYTE_VOCAB_SIZE


def save_tiny_checkpoint(family: str, directory, seed: int = 0, **config_overrides):
    """A tiny random model of ``family`` with the byte tokenizer, saved as a plain HF directory."""
    torch.manual_seed(seed)
    config = tiny_config(family)
    for key, value in config_overrides.items():
        setattr(config, key, value)
    config.vocab_size = BYTE_VOCAB
    config.pad_token_id = BYTE_VOCAB - 1
    if family != "bert":
        config.eos_token_id = config.bos_token_id = BYTE_VOCAB - 3
    model = MODEL_CLASSES[family](config)
    model.save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return directory


def save_tiny_adapter(root: Path) -> Path:
    """A LoRA adapter (with trained T5 tables) over the tiny LLaMA saved at ``root / "llama"``, as ``finetune --lora``
    writes it, at ``root / "adapter"``."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(root / "llama")
    ps.swap(base, "t5", num_buckets=16, max_distance=32)
    model = get_peft_model(base, ps.lora_config(base))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or "posswap_positions" in name:
                param.add_(0.5 * torch.randn_like(param))
    ps.save_adapter(model, root / "adapter")
    byte_tokenizer().save_pretrained(root / "adapter")
    return root / "adapter"


def edit_config(directory: Path, edit) -> None:
    """Apply ``edit`` to the dict of ``directory``'s config.json and write it back."""
    config = json.loads((directory / "config.json").read_text())
    edit(config)
    (directory / "config.json").write_text(json.dumps(config))


def write_corpus(directory, documents: int = 40) -> list[str]:
    """Deterministic text files from Python's own documentation topics (no download)."""
    from pydoc_data.topics import topics

    names = sorted(topics)[:documents]
    paths = []
    for index, name in enumerate(names):
        path = directory / f"doc{index:03d}.txt"
        path.write_text(topics[name][:4000], encoding="utf-8")
        paths.append(str(path))
    return paths


# --- the default run: a fast suite -------------------------------------------------------------------------------
# `pytest` runs `-m 'not slow'` (pyproject.toml); CI runs everything (`-m "slow or not slow"`). Whole tests that start
# subprocesses, train, or load real checkpoints carry @pytest.mark.slow in their files. Parametrized matrices are cut
# here: the default run keeps the ids below (together every family, every scheme and both RoPE placements), the
# others are marked slow, so a broken area still fails in the fast run and the full matrix runs in CI.
DIAGONAL = {"gpt2-learned", "gpt2-rope", "bert-alibi", "bert-sinusoidal", "llama-t5", "llama-none"}
NEW_FAMILIES = {"gemma3_text-alibi", "phi3-t5", "gpt_neox-rope", "roberta-learned"}  # one id per added family
FAST_SUBSET = {
    "test_matrix.py::test_forward_backward": DIAGONAL | NEW_FAMILIES,
    "test_matrix.py::test_eager_matches_sdpa": {"gpt2-rope", "bert-alibi", "llama-t5", "llama-kerple", "bert-sandwich",
                                                "gpt2-fire"},
    "test_matrix.py::test_cached_generation_equals_recompute": {"sdpa-gpt2-rope", "eager-llama-t5", "sdpa-gpt2-xpos"},
    "test_matrix.py::test_static_cache_equals_dynamic": {"llama-alibi"},
    "test_matrix.py::test_left_padded_generation_equals_rows_alone": {"llama-alibi"},
    "test_matrix.py::test_left_padded_forward_equals_rows_alone": {"gpt2-rope", "bert-alibi", "llama-t5"},
    "test_matrix.py::test_inputs_longer_than_trained_length": {"gpt2-sinusoidal", "bert-alibi", "llama-t5"},
    "test_matrix.py::test_output_attentions_include_the_scheme": {"gpt2-rope", "bert-t5", "llama-alibi"},
    "test_matrix.py::test_explicit_position_ids_reach_attention": {"bert-rope", "llama-t5"},
    "test_matrix.py::test_packed_sequences_equal_each_sequence_alone": {"llama-fire", "gpt2-alibi", "phi3-t5"},
    "test_matrix.py::test_position_ids_that_restart_never_show_a_query_later_tokens": {
        "sdpa-llama-alibi", "sdpa-gpt2-t5", "eager-llama-fire", "sdpa-gemma3_text-kerple"},
    "test_call_paths_forward.py::test_every_call_path_runs_the_scheme": DIAGONAL,
    "test_compiled_decoding.py::test_decoding_compiles_to_one_graph_and_never_recompiles": {
        "llama-alibi", "llama-t5", "llama-fire"},
    "test_call_paths_generate.py::test_cached_generation_equals_uncached_for_every_scheme": {"llama-alibi-beams"},
    "test_call_paths_generate.py::test_cached_generation_equals_uncached_past_the_original_length": {
        "gpt2-yarn-greedy"},
    "test_call_paths_forward.py::test_gradient_checkpointing_trains_position_parameters": {"reentrant-llama-t5"},
    "test_call_paths_copies_and_wrappers.py::test_deepcopy_is_independent_and_can_be_unswapped": {"llama-alibi"},
    "test_call_paths_copies_and_wrappers.py::test_torch_save_of_a_whole_swapped_model_round_trips": {"bert-rope"},
    "test_call_paths_copies_and_wrappers.py::test_swap_and_unswap_through_a_peft_wrapper": {"gpt2"},
    "test_call_paths_forward.py::test_peft_wrapped_model_runs_the_scheme_on_every_path": {"t5"},
    "test_call_paths_generate.py::test_self_extend_with_explicit_position_ids": {"llama"},
    "test_context_parallel.py::test_the_ring_uses_given_position_ids_as_one_process_does": {
        "alibi-causal-3", "alibi-bidirectional-5", "t5-causal-2", "t5-bidirectional-3", "xpos-causal-5",
        "xpos-bidirectional-2", "self-extend-causal-3", "self-extend-bidirectional-2"},
    "test_identity.py::test_unswap_restores_exactly": DIAGONAL | NEW_FAMILIES,
    "test_bias_schemes.py::test_attention_weights_are_the_peers_bias": {  # the families it had; new ones in CI
        f"{f}-{s}" for f in ("gpt2", "bert", "llama") for s in ("kerple", "sandwich", "fire")},
    "test_checkpoints.py::test_round_trip_through_auto_classes": DIAGONAL | {"gpt2-proportional"},
    "test_checkpoints.py::test_extended_models_round_trip": {"gpt2-rope-256-yarn", "bert-learned-160-interpolate",
                                                             "llama-t5-300-lift"},
    "test_reloaded_checkpoints.py::test_reloaded_model_unswaps_to_the_native_structure": {"gpt2-rope", "bert-learned",
                                                                                       "llama-t5"},
    "test_reloaded_checkpoints.py::test_reloaded_model_swaps_again_extends_and_saves": {"bert-t5"},
    "test_matrix.py::test_sinusoidal_in_half_precision": {"bf16-llama"},
    "test_extend.py::test_cached_generation_past_the_original_length": {"native-linear"},
    "test_llama_like.py::test_llama_like_families": {"mistral-learned", "qwen2-t5", "qwen3-alibi"},
    # eager Self-Extend and explicit position ids run fast in test_self_extend_memory.py and test_call_paths_generate.py
    "test_self_extend_authors.py::test_cached_decode_equals_the_authors_decode_and_a_recompute": {"sdpa"},
    "test_self_extend_authors.py::test_left_padded_rows_equal_the_authors_formula_row_by_row": {"mask-only"},
    "test_call_paths_copies_and_wrappers.py::test_removing_an_accelerate_hook_added_before_the_swap_keeps_the_scheme":
        {"llama-alibi"},
}


def refuses(family: str | None, scheme: str | None) -> bool:
    """Whether ``swap`` refuses this pair: causal-only schemes (xpos) on encoders. Their matrix ids are skipped;
    tests/schemes/test_rotary_schemes.py checks the refusal for every encoder family."""
    from hf_posswap.schemes import SCHEME_REGISTRY

    if family not in FAMILIES or family in CAUSAL_FAMILIES or scheme not in SCHEMES:
        return False
    return bool(getattr(SCHEME_REGISTRY.get(scheme), "causal_only", False))


@pytest.hookimpl(tryfirst=True)  # before `-m 'not slow'` deselects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark slow the matrix ids that ``FAST_SUBSET`` leaves out of the default run; skip pairs ``swap`` refuses."""
    seen: dict[str, set[str]] = {}
    for item in items:
        callspec = getattr(item, "callspec", None)
        params = getattr(callspec, "params", {})
        if refuses(params.get("family"), params.get("scheme")):
            item.add_marker(pytest.mark.skip(reason=f"{params['scheme']} is causal only: swap refuses "
                                             f"{params['family']} (tests/schemes/test_rotary_schemes.py checks it)"))
        name = f"{item.path.name}::{getattr(item, 'originalname', item.name)}"
        if callspec is None or name not in FAST_SUBSET:
            continue
        seen.setdefault(name, set()).add(callspec.id)
        if callspec.id not in FAST_SUBSET[name]:
            item.add_marker(pytest.mark.slow)
    if config.option.keyword or any("::" in arg for arg in config.args):
        return  # only part of a matrix was asked for
    for name, ids in seen.items():  # a renamed test id would silently leave the default run
        if FAST_SUBSET[name] - ids:
            raise pytest.UsageError(f"tests/conftest.py FAST_SUBSET names ids that {name} does not have: "
                                    f"{sorted(FAST_SUBSET[name] - ids)}")
