"""The command line's exit codes, and how a command that fails says why."""

from __future__ import annotations

import sys

OK = 0
SERVER_ERROR = 1  # the server failed or could not be reached
USAGE_ERROR = 2  # bad usage or input, the server's 4xx answers included


def fail(code: int, err: object) -> int:
    """Say ``error: <err>`` on stderr; returns ``code``, the command's exit code."""
    print(f"error: {err}", file=sys.stderr)
    return code
