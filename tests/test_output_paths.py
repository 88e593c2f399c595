"""Where a command will write is checked before it runs: missing folders are made, impossible paths refused."""

from __future__ import annotations

import click
import pytest

from jaxserve.cli.output_paths import check_writable


def test_missing_folders_are_made_and_impossible_paths_refused(tmp_path):
    check_writable(tmp_path / "new" / "deeper" / "profile.json")
    assert (tmp_path / "new" / "deeper").is_dir()
    check_writable(tmp_path / "report", is_dir=True)
    assert (tmp_path / "report").is_dir()
    with pytest.raises(click.UsageError, match="it is a folder"):
        check_writable(tmp_path / "report")
    with pytest.raises(click.UsageError, match="cannot write /proc/no/such/x.json"):
        check_writable("/proc/no/such/x.json")
