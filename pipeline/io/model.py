"""The model a job names, checked before Ray starts: resolved to a local directory (the embedded default
converted and cached once), its config and weights readable."""
from __future__ import annotations

import hashlib
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


def read_chat_template(value: str | None) -> str | None:
    """``--chat-template``'s template: the file it names, or the value itself where it holds Jinja
    (``{``); :class:`ConfigError` for a name that is neither a file nor a template."""
    if value is None:
        return None
    path = pathlib.Path(value).expanduser()
    if path.is_file():
        try:
            return path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--chat-template: cannot read {path}: {e}") from None
    if "{" in value:
        return value
    raise ConfigError(f"--chat-template: no file {value!r} (give a template file, or the Jinja template "
                      f"itself)")


def has_chat_template(path: pathlib.Path) -> bool:
    """Whether the tokenizer saved in model directory ``path`` has a chat template (in
    ``tokenizer_config.json``, or beside it as ``chat_template.jinja`` / ``chat_template.json``)."""
    import json

    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    config = path / "tokenizer_config.json"
    try:
        return bool(json.loads(config.read_text()).get("chat_template")) if config.is_file() else False
    except (OSError, ValueError):
        return False


def check_chat(path: pathlib.Path, spec: str, uses_chat: bool, template: str | None) -> None:
    """:class:`ConfigError`, in one line, where a job's prompts need a chat template (``uses_chat``:
    ``--chat`` or ``--messages-column``) that neither ``--chat-template`` nor model ``spec``'s tokenizer
    (saved in ``path``) gives."""
    if uses_chat and template is None and not has_chat_template(path):
        raise ConfigError(f"model {spec!r}: its tokenizer has no chat template, which --chat and "
                          f"--messages-column need; give one with --chat-template FILE|STRING")


HASH_EDGE_BYTES = 1 << 16  # of each weight file, the first and last 64 KiB are hashed


def model_label(path: pathlib.Path) -> str:
    """What the output's ``model`` column says: the model's name and a short content hash, e.g.
    ``gemma3-270m (sha256:1a2b3c4d)``.

    The name is the model directory's (a Hugging Face cache snapshot: the repository's id). The hash is
    cheap and does not depend on where or when the files were copied: sha256 of ``config.json``, and of
    each weight file (``*.safetensors``, ``*.bin``, sorted by name) its name, size, first and last 64 KiB
    (a safetensors file starts with its header: every tensor's name, dtype, shape and offsets)."""
    name = path.name
    if path.parent.name == "snapshots":  # ~/.cache/huggingface/hub/models--org--name/snapshots/<commit>
        name = path.parent.parent.name.removeprefix("models--").replace("--", "/")
    h = hashlib.sha256()
    config = path / "config.json"
    h.update(config.read_bytes() if config.is_file() else b"")
    for w in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
        size = w.stat().st_size
        h.update(f"\0{w.name}\0{size}\0".encode())
        with open(w, "rb") as fh:
            h.update(fh.read(HASH_EDGE_BYTES))
            if size > 2 * HASH_EDGE_BYTES:
                fh.seek(size - HASH_EDGE_BYTES)
                h.update(fh.read())
    return f"{name} (sha256:{h.hexdigest()[:8]})"
