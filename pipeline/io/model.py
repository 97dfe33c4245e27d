"""The model a job names, checked before Ray starts: resolved to a local directory (the embedded default
converted and cached once), its config and weights readable."""
from __future__ import annotations

import pathlib

from ..errors import ConfigError


def check_model(spec: str, trust_remote_code: bool = False) -> pathlib.Path:
    """Local dir of the model (converting/caching it if needed); ConfigError if missing or unreadable."""
    from logitspec.models import ModelNotFoundError, resolve_model_path

    try:
        path = pathlib.Path(resolve_model_path(spec))
    except ModelNotFoundError as e:
        raise ConfigError(str(e)) from None
    except (OSError, RuntimeError, ValueError) as e:
        raise ConfigError(f"cannot prepare model {spec!r}: {type(e).__name__}: {e}") from None
    try:
        from transformers import AutoConfig

        AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds
        raise ConfigError(f"model {spec!r}: cannot read {path / 'config.json'}: {e}") from None
    weights = sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin"))
    if not weights:
        raise ConfigError(f"model {spec!r}: no weights (*.safetensors, *.bin) in {path}")
    for w in weights:
        if w.suffix == ".safetensors":
            try:
                from safetensors import safe_open

                with safe_open(str(w), framework="pt") as fh:
                    fh.keys()
            except Exception as e:  # noqa: BLE001
                raise ConfigError(f"model {spec!r}: unreadable weights {w}: {e}") from None
    return path
