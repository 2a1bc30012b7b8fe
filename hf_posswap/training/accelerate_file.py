"""Reading a user's ``accelerate config`` file (yaml, or json which yaml also reads): shared by the FSDP
(:mod:`.accelerate_config`) and DeepSpeed (:mod:`.deepspeed_config`) readers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import InvalidConfigError, one_line


def read_accelerate_config(path: str | Path) -> dict[str, Any]:
    """The settings of an ``accelerate config`` file (yaml, or json which yaml also reads)."""
    import yaml

    source = Path(path).expanduser()
    try:
        settings = yaml.safe_load(source.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        raise InvalidConfigError(f"accelerate config {str(path)!r} cannot be read: {one_line(error)}.") from None
    if not isinstance(settings, dict):
        raise InvalidConfigError(f"accelerate config {str(path)!r} must be a mapping of settings (accelerate config).")
    return settings
