"""A damaged ``.gguf`` is refused at once, naming the file and the fault, before anything is converted or
written: junk after valid magic bytes, a damaged header, a truncated copy."""

from __future__ import annotations

import shutil
import struct
import time

import pytest
from test_models import _tiny_llama, _write_tiny_gguf

from logitspec.models import InvalidModelFileError, ModelNotFoundError, resolve_model_path
from logitspec.models.gguf_file import check_gguf_file, read_gguf_metadata


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("LOGITSPEC_CACHE", str(d))
    return d


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A complete F32 llama GGUF written with the gguf package's writer (a few hundred KiB)."""
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    _write_tiny_gguf(path, _tiny_llama(vocab_size=260, tie_word_embeddings=False))
    return path


def _refused(path, cache, *patterns):
    """resolve_model_path refuses ``path`` at once with one InvalidModelFileError naming it; no cache."""
    t0 = time.monotonic()
    with pytest.raises(InvalidModelFileError) as info:
        resolve_model_path(str(path))
    assert time.monotonic() - t0 < 5.0
    message = str(info.value)
    assert str(path.resolve()) in message and "\n" not in message
    for p in patterns:
        assert p in message, message
    assert isinstance(info.value, ModelNotFoundError) and isinstance(info.value, ValueError)
    assert not (cache / "models").exists() and not (cache / "locks").exists()  # no conversion started
    return message


def test_complete_gguf_passes_the_layout_check(tiny_gguf):
    layout = check_gguf_file(tiny_gguf)
    assert layout["data_end"] == layout["size"] == tiny_gguf.stat().st_size
    assert layout["tensors"] > 0 and 0 < layout["data_start"] < layout["size"]


def test_junk_after_the_magic_is_refused_without_memory_error(tmp_path, cache):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    _refused(junk, cache, "is not a usable GGUF file", "GGUF version 50462976")
    # a plausible version but junk counts: the counts are checked against the file's size first
    junk.write_bytes(b"GGUF" + struct.pack("<I", 3) + b"\xff" * 4096)
    _refused(junk, cache, "the header claims 18446744073709551615 metadata entries")
    # plausible counts, then a string length far beyond the file (what used to read gigabytes)
    junk.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1, 1) + struct.pack("<Q", 1 << 60) + b"x" * 64)
    _refused(junk, cache, "metadata key 0", "needs 1152921504606846976 bytes")
    junk.write_bytes(b"GGUF\x03\x00")
    _refused(junk, cache, "fewer than a GGUF header's 24")


def test_truncated_gguf_is_refused_before_conversion(tiny_gguf, tmp_path, cache):
    size = tiny_gguf.stat().st_size
    cut = tmp_path / "cut.gguf"
    with open(tiny_gguf, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(size - 1000))
    message = _refused(cut, cache, "truncated", f"the file has only {size - 1000} bytes",
                       f"its tensors need {size} bytes")
    assert "tensor '" in message  # names the first tensor that does not fit
    with pytest.raises(InvalidModelFileError, match="truncated"):
        check_gguf_file(cut)
    # cut inside the metadata: the header reader says so (read_gguf_metadata too)
    with open(tiny_gguf, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(2000))
    _refused(cut, cache)
    with pytest.raises(InvalidModelFileError, match=str(cut)):
        read_gguf_metadata(cut)


def test_not_a_gguf_at_all_keeps_its_clear_refusal(tmp_path, cache):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    _refused(fake, cache, "does not start with b'GGUF'")


def test_complete_copy_still_converts_past_the_check(tiny_gguf, tmp_path, cache, monkeypatch):
    """The check lets a whole file through to the conversion (stopped here at its first step)."""
    from logitspec.models import gguf

    copy = tmp_path / "copy.gguf"
    shutil.copyfile(tiny_gguf, copy)
    reached = []

    def stop(path):
        reached.append(path)
        raise RuntimeError("stop here")

    monkeypatch.setattr(gguf, "_load_dequantized", stop)
    with pytest.raises(RuntimeError, match="stop here"):
        resolve_model_path(str(copy))
    assert reached == [copy.resolve()]
