"""The torch and transformers releases the engine is tested with, checked before any work.

Outside them the engine can be silently wrong, not only broken: transformers 5.17-5.18 name the cache
argument ``past_key_values``, so the ``cache=`` the runners pass lands in ``**kwargs`` and is ignored
(no slot is written, every token is wrong, nothing raises). The bounds are pyproject.toml's
(tests/test_versions.py keeps them equal); a new minor moves them once tests/test_cache.py passes on it.
"""
from __future__ import annotations

import re

# package -> (lowest tested, first untested): inclusive lower, exclusive upper bound
TESTED = {"torch": ("2.4", "2.15"), "transformers": ("5.23", "5.30")}


class UnsupportedVersion(RuntimeError):
    """An installed torch or transformers outside :data:`TESTED`."""


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: "2.13.0+cu130" -> (2, 13, 0); "5.25.0.dev0" -> (5, 25, 0)."""
    m = re.match(r"\d+(\.\d+)*", version)
    if m is None:
        raise ValueError(f"not a version: {version!r}")
    return tuple(int(p) for p in m.group(0).split("."))


def problems(installed: dict[str, str]) -> list[str]:
    """What is wrong with ``installed`` ({package: version}) against :data:`TESTED`, one phrase each."""
    out = []
    for name, (low, high) in TESTED.items():
        have = installed.get(name)
        if have is None:
            continue
        if not release(low) <= release(have) < release(high):
            out.append(f"{name} {have} (tested: >={low},<{high})")
    return out


def installed() -> dict[str, str]:
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


def check_versions(found: dict[str, str] | None = None) -> None:
    """:class:`UnsupportedVersion`, in one line, where torch or transformers is outside :data:`TESTED`
    (``found``: {package: version}, default the installed ones)."""
    bad = problems(installed() if found is None else found)
    if bad:
        raise UnsupportedVersion(f"unsupported {' and '.join(bad)}: install a tested release "
                                 f"(pip install -e . pins them; on a machine without network, carry the "
                                 f"wheels: scripts/gpu_wheels.sh)")
