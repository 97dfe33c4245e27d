"""Where a benchmark ran: the machine, the code version, the load average."""
from __future__ import annotations

import os
import pathlib
import platform

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


def machine_info(model=None) -> dict:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if model is not None:
        p = next(model.parameters())
        info["device"] = str(p.device)
        info["dtype"] = str(p.dtype).replace("torch.", "")
        if p.device.type == "cuda":
            info["gpu"] = torch.cuda.get_device_name(p.device)
    return info


def code_version() -> str | None:
    """``logitspec <version>, git <commit>[ + uncommitted changes]`` of the code that ran."""
    import subprocess

    try:
        from importlib.metadata import version

        text = f"logitspec {version('logitspec')}"
    except Exception:  # noqa: BLE001 - not installed: the git commit still says what ran
        text = "logitspec"
    try:
        git = ["git", "-C", str(REPO_ROOT)]
        commit = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(git + ["status", "--porcelain", "--", "logitspec"],
                               capture_output=True, text=True, timeout=10, check=True).stdout
        changed = [line[3:] for line in dirty.splitlines() if line.strip()]  # "XY path"
        text += f", git {commit}" + (f" + uncommitted changes to {', '.join(changed)}" if changed else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return text


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None

