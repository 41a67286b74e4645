"""What every radixctl command shares."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import click

from proxy.errors import RadixError


def fail_cleanly(fn: Callable[..., Any]) -> Callable[..., Any]:
    """One message naming the cause and the fix, and a non-zero exit, for every known error."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except RadixError as exc:
            click.echo(f"radixctl: error: {exc.message}", err=True)
            fix = getattr(exc, "fix", "")
            if fix:
                click.echo(f"radixctl: fix: {fix}", err=True)
            sys.exit(1)

    return wrapper
