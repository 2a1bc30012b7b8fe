"""save_adapter writes like every other save (checked target, staged, atomic) and never over a full checkpoint or
a file of yours; load_adapter names a damaged record instead of raising a JSON traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import make_model

import hf_posswap as ps


@pytest.fixture
def adapted():
    from peft import get_peft_model

    model = make_model("gpt2")
    ps.swap(model, "t5", num_buckets=16, max_distance=32)
    return get_peft_model(model, ps.lora_config(model, r=2))


def test_an_adapter_is_not_written_into_a_full_checkpoint(adapted, tmp_path: Path) -> None:
    make_model("gpt2").save_pretrained(tmp_path)
    before = sorted(path.name for path in tmp_path.iterdir())
    for overwrite in (False, True):
        with pytest.raises(ps.PosSwapError, match=r"holds a full checkpoint \(config.json\); an adapter written"):
            ps.save_adapter(adapted, tmp_path, overwrite=overwrite)
    assert sorted(path.name for path in tmp_path.iterdir()) == before


def test_a_non_empty_directory_needs_overwrite_and_keeps_the_users_files(adapted, tmp_path: Path) -> None:
    target = tmp_path / "adapter"
    target.mkdir()
    (target / "README.md").write_text("My notes.\n")
    with pytest.raises(ps.PosSwapError, match="is not empty"):
        ps.save_adapter(adapted, target)
    ps.save_adapter(adapted, target, overwrite=True)
    assert (target / "README.md").read_text() == "My notes.\n"
    assert (target / "adapter_config.json").exists() and (target / "posswap_adapter.json").exists()
    assert not [path for path in tmp_path.iterdir() if path.name.startswith(".")], "no staging directory left"
    ps.save_adapter(adapted, tmp_path / "fresh")  # a new directory gets peft's model card
    assert "peft" in (tmp_path / "fresh" / "README.md").read_text()


@pytest.mark.parametrize(("content", "named"), [("{oops", "is not valid JSON"), ("[1, 2]", "must hold a JSON object")])
def test_a_damaged_adapter_record_is_named(adapted, tmp_path: Path, content: str, named: str) -> None:
    ps.save_adapter(adapted, tmp_path / "adapter")
    (tmp_path / "adapter" / "posswap_adapter.json").write_text(content)
    base = make_model("gpt2")
    ps.swap(base, "t5", num_buckets=16, max_distance=32)
    with pytest.raises(ps.PosSwapError, match=f"posswap_adapter.json' {named}"):
        ps.load_adapter(base, tmp_path / "adapter")
