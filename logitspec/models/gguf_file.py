"""GGUF files as this project reads them, without their tensor data: the magic bytes
(:func:`check_gguf_header`), the metadata we check (:func:`read_gguf_metadata`) and the whole layout
(:func:`check_gguf_file`), through a bounds-checked reader of the header over a memory map, so a damaged
or truncated file fails in well under a second with a message naming it, before any conversion starts.
"""
from __future__ import annotations

import math
import mmap
import os
import pathlib
import struct

from .errors import InvalidModelFileError, ModelConversionError

__all__ = ["check_gguf_header", "check_gguf_file", "read_gguf_metadata"]

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
