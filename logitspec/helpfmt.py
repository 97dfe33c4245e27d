"""The help formatter every command line of the project uses: each flag's help ends with its default
(as :class:`argparse.ArgumentDefaultsHelpFormatter`), except where the default says nothing: a required
flag, a switch (``store_true``), a default of None, or a help text that already names its default."""
from __future__ import annotations

import argparse

METHOD_HELP = ("ar: plain autoregressive decoding (the baseline, no drafts); pld: prompt lookup decoding "
               "(one draft chain copied from an n-gram match in the context); rest: REST, drafts retrieved "
               "from a datastore of text by the longest matching suffix, verified as a tree; lookahead: "
               "Lookahead decoding (Jacobi window and n-gram pool); logitspec: LogitSpec, next-next guesses "
               "from the last logits guide retrieval, verified as a tree. All are lossless")


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str:
        help_ = action.help or ""
        if (action.required or action.default is None or action.nargs == 0
                or action.default is argparse.SUPPRESS or "default" in help_.lower()):
            return help_
        return super()._get_help_string(action)
