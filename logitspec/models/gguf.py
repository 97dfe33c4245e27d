"""GGUF files: a fast reader of the metadata header, and the one-time conversion of a GGUF file into a
float32 safetensors HF directory (dequantized by transformers, checked, written atomically under a lock).

A converted directory is written into a temporary sibling and renamed into place only when complete
(the marker file ``logitspec_source.json`` is written last), so a crash never leaves a directory that
looks complete; two processes converting at once serialize on the lock and the second reuses the result
(docs/engine.md, "Model cache").
"""
from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import math
import mmap
import os
import pathlib
import shutil
import struct
import tempfile
import time

import torch

from .errors import InvalidModelFileError, ModelConversionError
from .paths import file_lock, fsync_path, remove_stale_temps

__all__ = [
    "MARKER_FILE",
    "is_complete_model_dir",
    "gguf_cache_name",
    "check_gguf_header",
    "check_gguf_file",
    "read_gguf_metadata",
    "convert_gguf",
]

logger = logging.getLogger("logitspec.models")

MARKER_FILE = "logitspec_source.json"  # written last into a converted dir; its presence means complete
_ROUND_TRIP_TEXT = "The quick brown fox jumps over the lazy dog. 1234 + 56 = 1290; café, naïve, 東京."

_GGUF_SCALARS = {  # GGUF value type -> struct format (little endian)
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d",
}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_U64 = struct.Struct("<Q")
_GGUF_KEYS = (
    "general.architecture",
    "general.name",
    "tokenizer.ggml.model",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.chat_template",
)


def is_complete_model_dir(path: pathlib.Path) -> bool:
    """Whether ``path`` is a finished conversion (marker file and config.json present)."""
    return (path / MARKER_FILE).is_file() and (path / "config.json").is_file()


def gguf_cache_name(path: pathlib.Path) -> str:
    """Cache directory name of a local GGUF file's conversion, keyed by its path, size and mtime."""
    st = path.stat()
    key = f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()
    return f"{path.stem}-{hashlib.sha256(key).hexdigest()[:10]}"


def check_gguf_header(path: pathlib.Path) -> None:
    """Raise :class:`ModelConversionError` unless ``path`` starts with the GGUF magic bytes."""
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise ModelConversionError(f"{path} does not start with b'GGUF' (got {magic!r}); not a GGUF file")


class _Scan:
    """A bounds-checked reader of a GGUF header over a memory map: every length and count is checked
    against the bytes left in the file before it is used, so junk fails with a message, not a
    ``MemoryError``."""

    def __init__(self, path: pathlib.Path, fh):
        self.path = path
        self.size = os.fstat(fh.fileno()).st_size
        if self.size < 24:
            self.fail(f"it has {self.size} bytes, fewer than a GGUF header's 24")
        self.mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        self.pos = 0

    def close(self) -> None:
        self.mm.close()

    def fail(self, what: str):
        raise InvalidModelFileError(f"{self.path} is not a usable GGUF file: {what}")

    def need(self, nbytes: int, what: str) -> None:
        if nbytes > self.size - self.pos:
            self.fail(f"{what} needs {nbytes} bytes at byte {self.pos} but the file has {self.size} bytes "
                      f"(damaged or truncated)")

    def read(self, fmt: str):
        size = struct.calcsize("<" + fmt)
        if self.pos + size > self.size:
            self.fail(f"the header ends early (byte {self.pos} of {self.size}); the file is truncated")
        value = struct.unpack_from("<" + fmt, self.mm, self.pos)[0]
        self.pos += size
        return value

    def string(self, what: str) -> bytes:
        n = self.read("Q")
        self.need(n, f"{what} (a string)")
        self.pos += n
        return self.mm[self.pos - n:self.pos]

    def skip(self, vtype: int, what: str) -> None:
        if vtype == _GGUF_STRING:
            self.string(what)
        elif vtype == _GGUF_ARRAY:
            etype, count = self.read("I"), self.read("Q")
            if etype in _GGUF_SCALARS:
                nbytes = struct.calcsize("<" + _GGUF_SCALARS[etype]) * count
                self.need(nbytes, f"{what} (an array of {count})")
                self.pos += nbytes
            elif etype == _GGUF_STRING:
                self.need(8 * count, f"{what} (an array of {count} strings)")
                mm, size, unpack, pos = self.mm, self.size, _U64.unpack_from, self.pos
                for _ in range(count):  # the vocabulary: hundreds of thousands of strings, kept tight
                    if pos + 8 > size:
                        self.pos = pos
                        self.fail(f"{what} (an array of {count} strings) runs past the end of the file")
                    pos += 8 + unpack(mm, pos)[0]
                if pos > size:
                    self.fail(f"{what} (an array of {count} strings) runs past the end of the file")
                self.pos = pos
            elif etype == _GGUF_ARRAY:
                self.need(12 * count, f"{what} (an array of {count} arrays)")
                for _ in range(count):
                    self.skip(etype, what)
            else:
                self.fail(f"{what} has unknown GGUF array element type {etype}")
        elif vtype in _GGUF_SCALARS:
            self.read(_GGUF_SCALARS[vtype])
        else:
            self.fail(f"{what} has unknown GGUF value type {vtype}")

    def header(self) -> tuple[int, int]:
        """Magic and version; ``(tensor count, key/value count)``, both plausible for the file's size."""
        magic = bytes(self.mm[:4])
        if magic != b"GGUF":
            self.fail(f"it does not start with b'GGUF' (got {magic!r})")
        self.pos = 4
        version = self.read("I")
        if version not in (2, 3):
            swapped = struct.unpack(">I", struct.pack("<I", version))[0]
            self.fail("big-endian GGUF files are not supported" if swapped in (2, 3) else
                      f"GGUF version {version} (this reader knows 2 and 3; a damaged header?)")
        n_tensors, n_kv = self.read("Q"), self.read("Q")
        if n_kv * 13 > self.size - self.pos:  # a key/value pair takes 13 bytes or more
            self.fail(f"the header claims {n_kv} metadata entries, more than its {self.size} bytes can hold")
        if n_tensors * 24 > self.size - self.pos:  # a tensor description takes 24 bytes or more
            self.fail(f"the header claims {n_tensors} tensors, more than its {self.size} bytes can hold")
        return n_tensors, n_kv

    def metadata(self, n_kv: int, keys) -> dict:
        out: dict = {}
        for i in range(n_kv):
            key = self.string(f"metadata key {i}").decode("utf-8", errors="replace")
            vtype = self.read("I")
            if key in keys and vtype == _GGUF_STRING:
                out[key] = self.string(f"metadata {key!r}").decode("utf-8", errors="replace")
            elif key in keys and vtype in _GGUF_SCALARS:
                out[key] = self.read(_GGUF_SCALARS[vtype])
            else:
                self.skip(vtype, f"metadata {key!r}")
        return out


def read_gguf_metadata(path: pathlib.Path) -> dict:
    """The scalar/string metadata we check (architecture, special token ids, chat template).

    A minimal reader of the GGUF key/value header (arrays skipped). ``gguf.GGUFReader`` takes ~45 s
    on a 262k-token vocabulary here, this well under a second. :class:`InvalidModelFileError` for a
    file that is not a GGUF or whose header is damaged or cut short.
    """
    path = pathlib.Path(path)
    with open(path, "rb") as fh:
        scan = _Scan(path, fh)
        try:
            _, n_kv = scan.header()
            return scan.metadata(n_kv, _GGUF_KEYS)
        finally:
            scan.close()


def _tensor_table(scan: _Scan, sizes, types) -> tuple[list, int]:
    """``([(name, offset, nbytes)], data start)`` from the header, each description checked."""
    n_tensors, n_kv = scan.header()
    meta = scan.metadata(n_kv, ("general.alignment",))
    alignment = meta.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
        scan.fail(f"general.alignment is {alignment!r}, not a power of two")
    tensors = []
    for i in range(n_tensors):
        name = scan.string(f"the name of tensor {i}").decode("utf-8", errors="replace")
        n_dims = scan.read("I")
        if not 1 <= n_dims <= 4:
            scan.fail(f"tensor {name!r} has {n_dims} dimensions (GGUF allows 1 to 4)")
        dims = [scan.read("Q") for _ in range(n_dims)]
        ttype, offset = scan.read("I"), scan.read("Q")
        try:
            block, type_size = sizes[types(ttype)]
        except (ValueError, KeyError):
            scan.fail(f"tensor {name!r} has unknown tensor type {ttype}")
        count = math.prod(dims)
        if count % block:
            scan.fail(f"tensor {name!r} of shape {dims} is not a whole number of {block}-value blocks")
        tensors.append((name, offset, count // block * type_size))
    return tensors, -(-scan.pos // alignment) * alignment


def check_gguf_file(path: pathlib.Path) -> dict:
    """Check a GGUF file's whole layout without reading its tensor data: header, metadata, every
    tensor's description (known type, 1-4 dimensions, whole blocks) and that every tensor's data lies
    inside the file. Returns ``{"tensors", "data_start", "data_end", "size"}``.

    :class:`InvalidModelFileError` naming the file and the fault, in well under a second, for junk
    after the magic bytes, a damaged header or a truncated copy, before any conversion starts.
    """
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    path = pathlib.Path(path)
    with open(path, "rb") as fh:
        scan = _Scan(path, fh)
        try:
            tensors, data_start = _tensor_table(scan, GGML_QUANT_SIZES, GGMLQuantizationType)
        finally:
            scan.close()
    data_end = max([data_start] + [data_start + offset + nbytes for _, offset, nbytes in tensors])
    for name, offset, nbytes in tensors:
        end = data_start + offset + nbytes
        if end > scan.size:
            scan.fail(f"tensor {name!r} takes bytes {data_start + offset} to {end} but the file has only "
                      f"{scan.size} bytes: the file is truncated (its tensors need {data_end} bytes)")
    return {"tensors": len(tensors), "data_start": data_start, "data_end": data_end, "size": scan.size}


# --------------------------------------------------------------------------------------------------
# GGUF -> float safetensors HF dir
# --------------------------------------------------------------------------------------------------


def _clear_gguf_quantizer(model) -> None:
    """Make a dequantized GGUF-loaded model savable as a plain float model.

    from_pretrained(gguf_file=...) attaches a GGUF quantizer and ``config.quantization_config``;
    save_pretrained refuses while the quantizer is set (GGUF is not serializable), and a saved
    ``quantization_config`` would make the next load go through the GGUF quantizer again.
    """
    model.hf_quantizer = None
    for cfg in {id(c): c for c in (model.config, model.config.get_text_config(decoder=True))}.values():
        if hasattr(cfg, "quantization_config"):
            with contextlib.suppress(AttributeError):
                delattr(cfg, "quantization_config")
    if getattr(model, "is_quantized", False):
        with contextlib.suppress(AttributeError):
            model.is_quantized = False


def _check_tokenizer(tokenizer, meta: dict, model_vocab: int, source: pathlib.Path) -> dict:
    """Fail loudly if the GGUF tokenizer did not convert correctly; return facts for the marker file."""
    problems: list[str] = []
    ids = tokenizer.encode(_ROUND_TRIP_TEXT, add_special_tokens=False)
    back = tokenizer.decode(ids, skip_special_tokens=False)
    if back != _ROUND_TRIP_TEXT:
        problems.append(f"round trip changed the text: {_ROUND_TRIP_TEXT!r} -> {back!r}")
    for what, key in (("bos", "tokenizer.ggml.bos_token_id"), ("eos", "tokenizer.ggml.eos_token_id")):
        want = meta.get(key)
        got = getattr(tokenizer, f"{what}_token_id")
        if want is not None and got != want:
            problems.append(f"{what}_token_id is {got}, the GGUF says {want}")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if "tokenizer.chat_template" in meta and not has_template:
        problems.append("the GGUF has a chat template but the converted tokenizer has none")
    if len(tokenizer) > model_vocab:
        problems.append(f"tokenizer has {len(tokenizer)} tokens but the model's vocab is {model_vocab}")
    if problems:
        raise ModelConversionError(f"tokenizer converted from {source} is wrong: " + "; ".join(problems))
    return {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "has_chat_template": has_template,
        "len_tokenizer": len(tokenizer),
    }


def _set_generation_eos(model, tokenizer, meta: dict, extra_eos_tokens: tuple[str, ...] = ()) -> None:
    """GGUF files carry no generation_config: take bos/eos/pad from the tokenizer (+ the GGUF's EOT and
    the extra stop tokens the upstream generation_config of a built-in model lists)."""
    gc_ = model.generation_config
    eos: list[int] = []
    extra = []
    for token in extra_eos_tokens:
        tok_id = tokenizer.convert_tokens_to_ids(token)
        if tok_id is None or tok_id == tokenizer.unk_token_id:
            logger.warning("stop token %r is not in the vocabulary; not adding it to eos_token_id", token)
            continue
        extra.append(tok_id)
    for tok_id in (tokenizer.eos_token_id, meta.get("tokenizer.ggml.eot_token_id"), *extra):
        if tok_id is not None and tok_id not in eos:
            eos.append(int(tok_id))
    if eos:
        gc_.eos_token_id = eos[0] if len(eos) == 1 else eos
    if tokenizer.bos_token_id is not None:
        gc_.bos_token_id = tokenizer.bos_token_id
    if tokenizer.pad_token_id is not None:
        gc_.pad_token_id = tokenizer.pad_token_id


def _load_dequantized(gguf_path: pathlib.Path):
    """``(model, tokenizer)`` read from ``gguf_path`` by transformers, dequantized to float32, eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_kwargs: dict = {}
    try:  # transformers >= 5.24: ask for dequantization explicitly (else it may keep packed blocks)
        from transformers import GgufConfig

        gguf_kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # pragma: no cover - older transformers always dequantize
        pass
    tokenizer = AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
    )
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent),
        gguf_file=gguf_path.name,
        dtype=torch.float32,
        local_files_only=True,
        **gguf_kwargs,
    )
    return model.eval(), tokenizer


def _reloaded_logit_diff(
    saved: pathlib.Path, probe: torch.Tensor, ref: torch.Tensor, source: pathlib.Path
) -> float:
    """Max |logit difference| of the written copy against ``ref`` (catches tying/saving mistakes)."""
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(str(saved), dtype=torch.float32, local_files_only=True)
    if getattr(reloaded, "hf_quantizer", None) is not None:
        raise ModelConversionError(f"the saved copy of {source} still loads as quantized")
    with torch.inference_mode():
        diff = (reloaded.eval()(probe).logits - ref).abs().max().item()
    del reloaded
    gc.collect()
    if not diff <= 1e-4:
        raise ModelConversionError(f"saved copy of {source} gives logits off by {diff:.3g}")
    return diff


def _publish(tmp: pathlib.Path, out_dir: pathlib.Path, info: dict) -> None:
    """Write the marker file last into ``tmp``, make it readable, flush it, rename it to ``out_dir``."""
    with open(tmp / MARKER_FILE, "w") as fh:  # written last: marks the dir as complete
        json.dump(info, fh, indent=2)
        fh.flush()
        os.fsync(fh.fileno())
    os.chmod(tmp, 0o755)  # mkdtemp creates 0700, and some writers 0600 files
    for f in tmp.iterdir():
        os.chmod(f, 0o644)
        fsync_path(f)
    fsync_path(tmp)
    os.rename(tmp, out_dir)
    fsync_path(out_dir.parent)


def _version(dist: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:  # pragma: no cover
        return None


def _convert_into(gguf_path: pathlib.Path, out_dir: pathlib.Path, expected_arch: str | None,
                  extra_eos_tokens: tuple[str, ...], extra_info: dict | None) -> None:
    """The conversion itself; the caller holds the lock and ``out_dir`` does not exist."""
    name = out_dir.name
    check_gguf_header(gguf_path)
    meta = read_gguf_metadata(gguf_path)
    arch = meta.get("general.architecture")
    if expected_arch is not None and arch != expected_arch:
        raise ModelConversionError(f"{gguf_path} has architecture {arch!r}, expected {expected_arch!r}")
    logger.info("converting %s (arch %s) -> %s; this takes a while on CPU", gguf_path, arch, out_dir)
    t0 = time.monotonic()
    model, tokenizer = _load_dequantized(gguf_path)
    t_load = time.monotonic() - t0
    tok_facts = _check_tokenizer(tokenizer, meta, model.config.get_text_config().vocab_size, gguf_path)
    _clear_gguf_quantizer(model)
    _set_generation_eos(model, tokenizer, meta, extra_eos_tokens)
    gen_eos = model.generation_config.eos_token_id
    model.config.name_or_path = name

    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        probe = torch.tensor([tokenizer.encode(_ROUND_TRIP_TEXT, add_special_tokens=True)[:16]])
        with torch.inference_mode():
            ref = model(probe).logits
        del model  # free it before the saved copy is loaded next to it
        gc.collect()
        diff = _reloaded_logit_diff(tmp, probe, ref, gguf_path)
        del ref
        elapsed = time.monotonic() - t0
        _publish(tmp, out_dir, {
            "source_gguf": str(gguf_path),
            "source_size": gguf_path.stat().st_size,
            "gguf_architecture": arch,
            "gguf_name": meta.get("general.name"),
            "gguf_has_chat_template": "tokenizer.chat_template" in meta,
            "tokenizer": tok_facts,
            "generation_eos_token_id": gen_eos,
            "reload_max_logit_diff": diff,
            "gguf_load_seconds": round(t_load, 1),
            "conversion_seconds": round(elapsed, 1),
            "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "transformers_version": _version("transformers"),
            "torch_version": torch.__version__,
            **(extra_info or {}),
        })
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info(
        "converted %s -> %s in %.1f s (GGUF load %.1f s); tokenizer eos=%s chat_template=%s",
        gguf_path, out_dir, elapsed, t_load, tok_facts["eos_token_id"], tok_facts["has_chat_template"],
    )


def convert_gguf(
    gguf_path: pathlib.Path,
    out_dir: pathlib.Path,
    cache: pathlib.Path,
    *,
    expected_arch: str | None = None,
    extra_eos_tokens: tuple[str, ...] = (),
    extra_info: dict | None = None,
) -> pathlib.Path:
    """Dequantize ``gguf_path`` once into the float32 safetensors HF dir ``out_dir`` (atomic, locked).

    :class:`InvalidModelFileError` first, before the cache is touched, if the file's layout is damaged
    or truncated (:func:`check_gguf_file`)."""
    if is_complete_model_dir(out_dir):
        return out_dir
    check_gguf_file(gguf_path)
    name = out_dir.name
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(cache, f"model-{name}"):
        if is_complete_model_dir(out_dir):  # another process finished it while we waited
            logger.info("%s was converted by another process", out_dir)
            return out_dir
        remove_stale_temps(out_dir.parent, name)
        if out_dir.exists():  # not complete (no marker): not ours to trust
            logger.warning("removing incomplete model dir %s", out_dir)
            shutil.rmtree(out_dir)
        _convert_into(gguf_path, out_dir, expected_arch, extra_eos_tokens, extra_info)
    return out_dir
