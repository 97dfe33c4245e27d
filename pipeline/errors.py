"""The one error every stage raises before Ray starts: the job (or sweep) cannot run as asked."""
from __future__ import annotations


class ConfigError(ValueError):
    """The job cannot start: a bad flag, input, model or reference (message names the problem)."""
