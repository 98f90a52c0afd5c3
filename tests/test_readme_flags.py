"""docs/flags.md's "Flag reference" table lists exactly the flags ``add_flat_args`` defines, with
their defaults, choices, ``--flat-preset paper`` values and help text, so it cannot go stale."""

import argparse
import pathlib
import re

import pytest

from megatron_flat.config import PRESETS, add_flat_args

FLAGS_DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "flags.md"


def _flag_table():
    """``{first flag: [flags, default, paper, values, meaning]}`` from the flag table."""
    text = FLAGS_DOC.read_text(encoding="utf-8")
    section = text.split("## Flag reference", 1)[1].split("\n#", 1)[0]
    rows = {}
    for line in section.splitlines():
        if not line.startswith("| `--"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        assert len(cells) == 5, line
        flags = re.findall(r"`(--[a-z-]+)`", cells[0])
        assert flags[0] not in rows, f"{flags[0]} is listed twice"
        rows[flags[0]] = [flags] + cells[1:]
    return rows


def _actions():
    parser = add_flat_args(argparse.ArgumentParser())
    return {a.option_strings[0]: a for a in parser._actions if a.dest.startswith("flat_")}


def _shown(value, boolean):
    """How the table writes a value."""
    if value is None:
        return "none"
    if boolean:
        return "`on`" if value else "`off`"
    return f"`{value}`"


def test_table_lists_exactly_the_flags():
    actions, rows = _actions(), _flag_table()
    assert set(rows) == set(actions)
    for flag, action in actions.items():
        assert rows[flag][0] == list(action.option_strings), flag  # --no-* spelled out too


@pytest.mark.parametrize("flag", sorted(_actions()))
def test_row_matches_the_flag(flag):
    action = _actions()[flag]
    flags, default, paper, values, meaning = _flag_table()[flag]
    boolean = isinstance(action, argparse.BooleanOptionalAction)
    assert default == _shown(action.default, boolean)
    name = action.dest[len("flat_"):]
    if name != "preset":
        assert paper == _shown(PRESETS["paper"].get(name, action.default), boolean)
    if action.choices:
        assert re.findall(r"`([^`]+)`", values) == [str(c) for c in action.choices]
    assert meaning == re.sub(r" \(default: [^)]*\)$", "", action.help)
