"""``--accelerate-config``: a user's ``accelerate config`` yaml read for its FSDP settings (passed to
``Accelerator(fsdp_plugin=...)`` on CUDA, refused in one line on CPU before anything loads)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import save_tiny_checkpoint, write_corpus

from hf_posswap.errors import InvalidConfigError
from hf_posswap.training import FinetuneConfig, finetune
from hf_posswap.training.accelerate_config import (
    accelerate_has_fsdp2,
    fsdp_plugin,
    fsdp_plugin_options,
    read_accelerate_config,
)
from hf_posswap.training.config import build_parser, config_from_args

#: what `accelerate config` writes for FSDP2 (accelerate 1.x)
FSDP2_YAML = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:
  fsdp_activation_checkpointing: true
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: true
  fsdp_offload_params: false
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_version: 2
machine_rank: 0
mixed_precision: bf16
num_machines: 1
num_processes: 8
use_cpu: false
"""


@pytest.fixture(autouse=True)
def _environment_kept():
    """Building a plugin sets accelerate's process-wide variables (FSDP_CPU_RAM_EFFICIENT_LOADING, ...): undone after
    each test, as ``finetune`` undoes them after a run."""
    from hf_posswap.training.accelerate_config import accelerate_environment_kept

    with accelerate_environment_kept():
        yield


#: accelerate before 1.6 builds no FSDP2 plugin (the floor, 1.0.1, is one): those files are refused (tested below)
needs_fsdp2 = pytest.mark.skipif(not accelerate_has_fsdp2(), reason="the installed accelerate has no FSDP2 (1.6 on)")


def write(tmp_path: Path, text: str, name: str = "accelerate.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


@needs_fsdp2
def test_fsdp2_settings_become_plugin_arguments(tmp_path: Path) -> None:
    options = fsdp_plugin_options(read_accelerate_config(write(tmp_path, FSDP2_YAML)))
    assert options == {
        "activation_checkpointing": True, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "cpu_ram_efficient_loading": True, "cpu_offload": False, "reshard_after_forward": True,
        "state_dict_type": "SHARDED_STATE_DICT", "transformer_cls_names_to_wrap": ["LlamaDecoderLayer"],
        "fsdp_version": 2,
    }


@needs_fsdp2
def test_the_plugin_is_built_for_cuda(tmp_path: Path) -> None:
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = fsdp_plugin(write(tmp_path, FSDP2_YAML), cuda=True)
    assert isinstance(plugin, FullyShardedDataParallelPlugin)
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert plugin.transformer_cls_names_to_wrap == ["LlamaDecoderLayer"]


@pytest.mark.parametrize(("text", "expected"), [
    ("distributed_type: DEEPSPEED\ndeepspeed_config: {zero_stage: 3}\n", "DeepSpeed"),
    pytest.param("distributed_type: FSDP\nfsdp_config: {fsdp_shard_everything: true}\n", "fsdp_shard_everything",
                 marks=needs_fsdp2),
    ("distributed_type: MULTI_GPU\nfsdp_config: {fsdp_version: 2}\n", "distributed_type: FSDP"),
    pytest.param("distributed_type: FSDP\nfsdp_config: {fsdp_version: 1}\n", "fsdp_version 1: .*FSDP2 only",
                 marks=needs_fsdp2),
    ("- a list\n", "mapping"),
    ("distributed_type: [FSDP\n", "cannot be read"),
], ids=["deepspeed", "unknown-key", "fsdp-section-without-fsdp", "fsdp1", "not-a-mapping", "bad-yaml"])
def test_files_that_cannot_shard_are_refused_in_one_line(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(InvalidConfigError, match=expected) as error:
        fsdp_plugin(write(tmp_path, text), cuda=True)
    assert "\n" not in str(error.value)


def test_an_accelerate_without_fsdp2_is_refused_with_the_upgrade(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import hf_posswap.training.accelerate_config as accelerate_config

    monkeypatch.setattr(accelerate_config, "accelerate_has_fsdp2", lambda: False)
    with pytest.raises(InvalidConfigError, match=r"has no FSDP2.*pip install -U accelerate.*shard_model") as error:
        fsdp_plugin(write(tmp_path, FSDP2_YAML), cuda=True)
    assert "\n" not in str(error.value)


def test_a_file_without_fsdp_gives_no_plugin(tmp_path: Path) -> None:
    assert fsdp_plugin(write(tmp_path, "distributed_type: MULTI_GPU\nnum_processes: 2\n"), cuda=False) is None


def test_on_cpu_fsdp_is_refused_before_loading_and_names_shard_model(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import hf_posswap.training.loop as loop

    save_tiny_checkpoint("llama", tmp_path / "model")
    (tmp_path / "corpus").mkdir()
    write_corpus(tmp_path / "corpus", documents=2)
    monkeypatch.setattr(loop.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(loop, "_load_model", lambda *a, **k: pytest.fail("loaded a model before refusing"))
    config = FinetuneConfig(model=str(tmp_path / "model"), data=[str(tmp_path / "corpus" / "*.txt")],
                            output=str(tmp_path / "run"), accelerate_config=str(write(tmp_path, FSDP2_YAML)))
    refusal = r"needs CUDA.*shard_model" if accelerate_has_fsdp2() else r"has no FSDP2.*shard_model"
    with pytest.raises(InvalidConfigError, match=refusal) as error:
        finetune(config)
    assert "\n" not in str(error.value)


def test_command_line_passes_the_file(tmp_path: Path) -> None:
    args = build_parser().parse_args(["--model", "m", "--data", "d.txt", "--output", "o",
                                      "--accelerate-config", "fsdp.yaml"])
    assert config_from_args(args).accelerate_config == "fsdp.yaml"
    with pytest.raises(InvalidConfigError, match="accelerate_config"):
        FinetuneConfig(model="m", data=["d"], output="o", accelerate_config=" ")


@needs_fsdp2
def test_mixed_precision_leaves_the_casts_to_the_layers(tmp_path: Path) -> None:
    """accelerate's own bf16 policy casts layer inputs by rebuilding dataclasses (the position context among them):
    the plugin's policy casts nothing and each layer casts its own tensor arguments."""
    import torch
    from conftest import swapped

    from hf_posswap.training.accelerate_config import fit_layers_for_fsdp
    from hf_posswap.training.sharding import CastInputs, transformer_layers

    plugin = fsdp_plugin(write(tmp_path, FSDP2_YAML), cuda=True, mixed_precision="bf16")
    policy = plugin.mixed_precision_policy
    assert (policy.param_dtype, policy.reduce_dtype, policy.cast_forward_inputs) == (torch.bfloat16, torch.float32,
                                                                                     False)
    model = swapped("llama", "t5")
    fit_layers_for_fsdp(model, "bf16", plugin, torch.device("cpu"))
    layers = transformer_layers(model)
    assert len(layers) == 2
    assert all(any(isinstance(hook, CastInputs) for hook in layer._forward_pre_hooks.values()) for layer in layers)
    assert not plugin.ignored_modules, "T5 tables are sharded like any weight"


@needs_fsdp2
def test_fire_modules_are_kept_whole(tmp_path: Path) -> None:
    """``fully_shard`` cannot shard FIRE's 0-dim parameters: their modules join the plugin's ignored modules (and
    train replicated: tests/training/test_accelerate_fsdp.py); a pattern there cannot be extended and is refused."""
    import torch
    from conftest import swapped

    from hf_posswap.training.accelerate_config import fit_layers_for_fsdp

    plugin = fsdp_plugin(write(tmp_path, FSDP2_YAML.replace("loading: true", "loading: false")), cuda=True)
    model = swapped("llama", "fire")
    fit_layers_for_fsdp(model, "no", plugin, torch.device("cpu"))
    scalars = {id(p) for p in model.parameters() if p.ndim == 0}
    kept = {id(p) for module in plugin.ignored_modules for p in module.parameters(recurse=False)}
    assert scalars and scalars <= kept
    plugin.ignored_modules = "model.layers.0.mlp"
    with pytest.raises(InvalidConfigError, match="fsdp_ignored_modules 'model.layers.0.mlp' is a pattern"):
        fit_layers_for_fsdp(swapped("llama", "fire"), "no", plugin, torch.device("cpu"))


@needs_fsdp2
@pytest.mark.parametrize(("scheme", "held"), [("alibi", "persistent buffers"), ("fire", "0-dim parameters")])
def test_efficient_loading_of_position_state_it_cannot_refill_is_refused(tmp_path: Path, scheme: str,
                                                                         held: str) -> None:
    """accelerate's meta-device refill stops at a persistent buffer and loses the FIRE modules it was told to ignore
    (both seen over 2 gloo processes): refused with the setting to change. T5 and KERPLE load that way
    (tests/training/test_accelerate_fsdp.py)."""
    import torch
    from conftest import swapped

    from hf_posswap.training.accelerate_config import fit_layers_for_fsdp

    plugin = fsdp_plugin(write(tmp_path, FSDP2_YAML), cuda=True)
    assert plugin.cpu_ram_efficient_loading
    with pytest.raises(InvalidConfigError, match=f"{held}.*set fsdp_cpu_ram_efficient_loading: false"):
        fit_layers_for_fsdp(swapped("llama", scheme), "no", plugin, torch.device("cpu"))
    fit_layers_for_fsdp(swapped("llama", "kerple"), "no", plugin, torch.device("cpu"))
