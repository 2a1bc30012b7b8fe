"""The DeepSpeed settings of an ``accelerate config`` file: read into plugin options, refused in one line that names
a bad value, and DeepSpeed's checkpoint files accepted by ``--resume`` exactly as DeepSpeed writes them. (Training
under ZeRO-3: test_deepspeed_training.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import swapped

from hf_posswap.errors import InvalidConfigError
from hf_posswap.training.deepspeed_config import (
    asks_for_deepspeed,
    deepspeed_plugin_options,
    hold_scalars_as_vectors,
    missing_checkpoint_files,
    restore_scalars,
)
from hf_posswap.training.run_checkpoints import TrainingCheckpointError, _check_files


def options(section: dict, grad_accum: int = 1, max_grad_norm: float = 1.0) -> dict:
    return deepspeed_plugin_options({"distributed_type": "DEEPSPEED", "deepspeed_config": section}, grad_accum,
                                    max_grad_norm)


def test_the_files_settings_become_plugin_arguments() -> None:
    section = {"zero_stage": 3, "offload_optimizer_device": "CPU", "offload_param_device": "none",
               "zero3_init_flag": False, "zero3_save_16bit_model": False, "gradient_accumulation_steps": 2,
               "deepspeed_multinode_launcher": "standard"}
    assert options(section, grad_accum=2) == {
        "zero_stage": 3, "offload_optimizer_device": "cpu", "offload_param_device": "none", "zero3_init_flag": False,
        "zero3_save_16bit_model": False, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
    }
    assert options({}, grad_accum=4, max_grad_norm=0.0) == {
        "zero_stage": 3, "gradient_accumulation_steps": 4, "gradient_clipping": "auto"}


def test_a_deepspeed_json_is_passed_alone(tmp_path: Path) -> None:
    json_file = tmp_path / "ds.json"
    json_file.write_text("{}")
    assert options({"deepspeed_config_file": str(json_file)}) == {"hf_ds_config": str(json_file)}
    with pytest.raises(InvalidConfigError, match="zero_stage: put those settings in the DeepSpeed json"):
        options({"deepspeed_config_file": str(json_file), "zero_stage": 3})


@pytest.mark.parametrize(("section", "expected"), [
    ({"zero_stage": 4}, r"zero_stage 4: choose one of \(0, 1, 2, 3\)"),
    ({"offload_param_device": "gpu"}, "offload_param_device 'gpu': choose one of none, cpu, nvme"),
    ({"zero3_init_flag": "yes"}, "zero3_init_flag 'yes': write true or false"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps 0: a positive integer or auto"),
    ({"gradient_accumulation_steps": 3}, "gradient_accumulation_steps 3 differs from --grad-accum 1"),
    ({"gradient_clipping": -1}, "gradient_clipping -1: a positive number or auto"),
    ({"deepspeed_config_file": "/nonexistent/ds.json"}, "'/nonexistent/ds.json' is not a file"),
    ({"zero_stages": 3}, "key 'zero_stages' is not a DeepSpeed setting of accelerate"),
], ids=["stage", "offload-device", "flag", "accumulation", "accumulation-mismatch", "clipping", "json-file",
        "unknown-key"])
def test_bad_values_are_named_in_one_line(section: dict, expected: str) -> None:
    with pytest.raises(InvalidConfigError, match=expected) as error:
        options(section)
    assert "\n" not in str(error.value)


def test_the_plugin_trains_a_torch_optimizer_and_gathers_the_final_model(monkeypatch: pytest.MonkeyPatch) -> None:
    import hf_posswap.training.deepspeed_config as deepspeed_config

    monkeypatch.setattr(deepspeed_config, "deepspeed_installed", lambda: True)  # accelerate builds it without
    section = {"zero_stage": 3, "offload_optimizer_device": "cpu", "zero3_save_16bit_model": False}
    plugin = deepspeed_config.deepspeed_plugin({"deepspeed_config": section}, grad_accum=2, max_grad_norm=0.5)
    settings = plugin.deepspeed_config
    assert settings["zero_optimization"]["stage"] == 3
    assert settings["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert settings["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    assert settings["zero_force_ds_cpu_optimizer"] is False
    assert settings["gradient_accumulation_steps"] == 2 and settings["gradient_clipping"] == 0.5


def test_a_missing_deepspeed_is_named_with_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import hf_posswap.training.deepspeed_config as deepspeed_config

    monkeypatch.setattr(deepspeed_config, "deepspeed_installed", lambda: False)
    with pytest.raises(InvalidConfigError, match=r"DeepSpeed, which is not installed: pip install deepspeed") as error:
        deepspeed_config.deepspeed_plugin({"distributed_type": "DEEPSPEED"}, 1, 1.0)
    assert "\n" not in str(error.value)


def test_which_files_ask_for_deepspeed() -> None:
    assert asks_for_deepspeed({"distributed_type": "DEEPSPEED"})
    assert asks_for_deepspeed({"deepspeed_config": {"zero_stage": 3}})
    assert not asks_for_deepspeed({"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2}})
    with pytest.raises(InvalidConfigError, match="distributed_type MULTI_GPU; set distributed_type: DEEPSPEED"):
        deepspeed_plugin_options({"distributed_type": "MULTI_GPU", "deepspeed_config": {"zero_stage": 3}}, 1, 1.0)


def test_fire_scalars_are_held_as_vectors_and_saved_back_as_scalars() -> None:
    model, reference = swapped("llama", "fire").eval(), swapped("llama", "fire").eval()
    tokens = torch.randint(3, 90, (2, 16), generator=torch.Generator().manual_seed(0))
    held = hold_scalars_as_vectors(model)
    assert held == ["model.posswap_positions.functions.0.c", "model.posswap_positions.functions.0.threshold_scale"]
    assert all(model.get_parameter(name).shape == (1,) for name in held)
    with torch.no_grad():  # FIRE reads them as scalars either way
        torch.testing.assert_close(model(input_ids=tokens).logits, reference(input_ids=tokens).logits, rtol=0, atol=0)
    restored = restore_scalars(model, model.state_dict())
    assert {name: value.shape for name, value in restored.items()} == {
        name: value.shape for name, value in reference.state_dict().items()}
    assert hold_scalars_as_vectors(swapped("llama", "kerple")) == []


def _deepspeed_checkpoint(path: Path, processes: int = 2, optimizer_prefix: str = "", stage: int = 3) -> Path:
    """The files accelerate's save_state writes under DeepSpeed (names as DeepSpeed 0.19 writes them)."""
    (path / "pytorch_model").mkdir(parents=True)
    if stage < 3:
        torch.save({}, path / "pytorch_model" / "mp_rank_00_model_states.pt")
    for rank in range(processes):
        if stage == 3:
            torch.save({}, path / "pytorch_model" / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
        torch.save({}, path / "pytorch_model" / f"{optimizer_prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
        torch.save({}, path / f"random_states_{rank}.pkl")
    torch.save({}, path / "scheduler.bin")
    (path / "latest").write_text("pytorch_model")
    return path


@pytest.mark.parametrize(("prefix", "stage"), [("", 3), ("bf16_", 3), ("", 2)], ids=["fp32", "bf16", "zero2"])
def test_a_deepspeed_checkpoint_is_complete(tmp_path: Path, prefix: str, stage: int) -> None:
    checkpoint = _deepspeed_checkpoint(tmp_path / "step-2", optimizer_prefix=prefix, stage=stage)
    assert missing_checkpoint_files(checkpoint) == []
    _check_files(checkpoint)
    assert missing_checkpoint_files(tmp_path) is None  # not a DeepSpeed checkpoint


def test_a_deepspeed_checkpoint_without_a_file_is_passed_over(tmp_path: Path) -> None:
    checkpoint = _deepspeed_checkpoint(tmp_path / "step-2")
    (checkpoint / "pytorch_model" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    (checkpoint / "scheduler.bin").unlink()
    with pytest.raises(TrainingCheckpointError, match="lacks pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt,"
                                                      " scheduler.bin; it cannot be resumed"):
        _check_files(checkpoint)


def test_a_process_whose_files_are_all_gone_is_missed(tmp_path: Path) -> None:
    checkpoint = _deepspeed_checkpoint(tmp_path / "step-2")
    (checkpoint / "pytorch_model" / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    (checkpoint / "pytorch_model" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    assert missing_checkpoint_files(checkpoint) == ["pytorch_model/zero_pp_rank_1_mp_rank_00_model_states.pt",
                                                    "pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt"]


def test_a_zero2_checkpoint_needs_every_processs_optimizer_states(tmp_path: Path) -> None:
    checkpoint = _deepspeed_checkpoint(tmp_path / "step-2", stage=2)
    (checkpoint / "pytorch_model" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    assert missing_checkpoint_files(checkpoint) == ["pytorch_model/zero_pp_rank_0_mp_rank_00_optim_states.pt"]


def test_the_finite_check_reads_zero3_partitions() -> None:
    """Under ZeRO-3 a parameter is an empty placeholder and this process's values sit in ``ds_tensor``: a NaN there
    must stop the run before it is saved (checking the placeholder finds nothing)."""
    import torch

    from hf_posswap.training.guards import all_finite

    placeholder = torch.nn.Parameter(torch.empty(0))
    placeholder.ds_tensor = torch.tensor([1.0, float("nan")])
    assert not all_finite([placeholder])
    placeholder.ds_tensor = torch.tensor([1.0, 2.0])
    assert all_finite([placeholder, torch.nn.Parameter(torch.ones(3))])
