"""Output paths checked before a long run, so a typo costs a one-line error instead of minutes of measuring."""

from __future__ import annotations

import os
from pathlib import Path

import click


def check_writable(path: str | Path, *, is_dir: bool = False) -> None:
    """Create what is missing of `path`'s folder (or `path` itself when `is_dir`) and check that it can be
    written; raise click.UsageError (exit 2, one line) if not."""
    folder = Path(path) if is_dir else Path(path).parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise click.UsageError(f"cannot write {path}: {e.strerror or e}") from None
    if not is_dir and Path(path).is_dir():
        raise click.UsageError(f"cannot write {path}: it is a folder")
    if not os.access(folder, os.W_OK):
        raise click.UsageError(f"cannot write {path}: {folder} is not writable")
