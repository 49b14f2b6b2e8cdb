"""The one error type of the evaluation's input checks."""

from __future__ import annotations


class EvalInputError(ValueError):
    """Bad user input (a missing file, a too-short text, an unknown option value).

    The command line prints its message as one line and exits non-zero, without a traceback.
    """
