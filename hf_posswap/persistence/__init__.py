"""Everything that touches files: checkpoints that reload right (``autoload``, ``restore``), standalone export,
LoRA adapters, atomic writes (``saving``), checked loading of user paths (``loading``, ``user_files``) and the
offline real checkpoints (``offline_checkpoints``). Built on ``core``."""
