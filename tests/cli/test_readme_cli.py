"""The CLI synopsis of the documentation (docs/cli.md) is what `--help` says: every command's usage line, as argparse
prints it."""
from __future__ import annotations

import re

from reshard.cli import build_parser
from tests.helpers.repo import REPO

INDENT = len("reshard validate ")
WIDTH = 118


def synopsis() -> str:
    """Each command's usage (argparse's, without -h), wrapped between its bracketed groups."""
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a.choices, dict)).choices
    lines = []
    for sub in commands.values():
        groups = re.findall(r"\[[^\]]*\]|\S+", " ".join(sub.format_usage().split()[1:]).replace(" [-h]", ""))
        line = f"{groups[0]} {groups[1]}".ljust(INDENT - 1)     # `reshard inspect `, aligned
        for group in groups[2:]:
            if len(line) + 1 + len(group) > WIDTH:
                lines.append(line)
                line = " " * (INDENT - 1)
            line += " " + group
        lines.append(line)
    return "\n".join(lines)


def documented_synopsis() -> str:
    text = (REPO / "docs" / "cli.md").read_text()
    block = re.search(r"## Synopsis\n\n```\n(.*?)```", text, re.DOTALL)
    assert block, "docs/cli.md has no CLI synopsis block under '## Synopsis'"
    return block[1].rstrip("\n")


def test_documented_synopsis_is_the_parsers():
    expected = synopsis()
    assert documented_synopsis() == expected, f"docs/cli.md's synopsis drifted from --help; it should read:\n{expected}"


def test_a_drifted_synopsis_is_caught(monkeypatch):
    """Negative control: an option docs/cli.md lists that the parser lacks (and one left out) fails the comparison."""
    drifted = synopsis().replace("[--memory-budget SIZE]", "[--memory SIZE]", 1)
    assert drifted != synopsis() and documented_synopsis() != drifted
