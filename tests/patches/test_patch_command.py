"""``python -m megatron_flat patch``: the patcher inside the package (a wheel install has no
``patches/``), with ``patches/apply.py`` as the README's entry calling it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_flat.__main__ import main as top_main

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("era", ["016", "019"])
def test_package_command_applies_checks_and_reverts(megatron_dir, script_016, script_019,
                                                    era, capsys):
    original = script_016 if era == "016" else script_019
    path = megatron_dir(original)
    root = str(path.parent)
    assert top_main(["patch", root, "--check"]) == 1
    assert top_main(["patch", root, "--dry-run"]) == 0
    assert path.read_text() == original
    assert top_main(["patch", root]) == 0
    assert "# megatron-flat" in path.read_text()
    assert top_main(["patch", root, "--check"]) == 0
    assert top_main(["patch", root, "--revert"]) == 0
    assert path.read_text() == original
    out = capsys.readouterr().out
    assert "patched" in out and "reverted" in out


def test_package_command_help_and_usage(capsys):
    assert top_main(["--help"]) == 0
    assert "patch" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        top_main(["patch", "--help"])
    assert exc.value.code == 0
    assert "python -m megatron_flat patch" in capsys.readouterr().out


def test_readme_entry_runs_from_anywhere(megatron_dir, script_019, tmp_path):
    """``patches/apply.py`` run from another directory finds the package of its checkout and
    behaves as the package command (same exit codes, same bytes)."""
    path = megatron_dir(script_019)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def run(*flags):
        return subprocess.run([sys.executable, str(REPO / "patches" / "apply.py"),
                               str(path.parent), *flags], capture_output=True, text=True,
                              cwd=tmp_path, env=env)

    assert run("--check").returncode == 1
    done = run()
    assert done.returncode == 0 and "patched" in done.stdout
    assert run("--check").returncode == 0
    assert run("--revert").returncode == 0
    assert path.read_text() == script_019
    assert "usage: patches/apply.py" in run("--help").stdout
