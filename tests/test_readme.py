"""The README's commands are steps a newcomer can follow: every `farm` and `farm-agent` line in
its shell blocks names a verb that exists and only options that verb takes, and every doc it
points to is there. (A renamed flag or verb breaks this test, not the newcomer.)"""

from __future__ import annotations

import functools
import re
import shlex
from pathlib import Path

import pytest
import typer

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _shell_lines(text: str) -> list[str]:
    blocks = re.findall(r"```sh\n(.*?)```", text, flags=re.S)
    lines, pending = [], ""
    for block in blocks:
        for raw in block.splitlines():
            line = raw.split("  #")[0].split(" # ")[0].rstrip()
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            lines.append((pending + line).strip())
            pending = ""
    return [line for line in lines if line]


def _commands(line: str) -> list[list[str]]:
    """The `farm ...` / `farm-agent ...` commands of one shell line, as argv lists; `a|b` in a
    verb's place stands for each of a and b."""
    out = []
    for part in re.split(r"\s*(?:;|&&|\|\|)\s*", line):
        part = part.strip()
        match = re.search(r"(?:^|\$\(|\s)(farm(?:-agent)?)\s(.*)$", part)
        if not match or part.startswith(("pip ", "openssl ", "export ")):
            continue
        words = shlex.split(match.group(2).rstrip(")"), posix=True)
        out.append([match.group(1), *words])
    return out


@functools.cache
def _click_root(program: str):
    if program == "farm":
        from orchestrator.cli import app
    else:
        from agent.cli import app
    return typer.main.get_command(app)


def _expand(argv: list[str]) -> list[list[str]]:
    for index, word in enumerate(argv):
        if "|" in word and not word.startswith("-"):
            return [x for alt in word.split("|") for x in _expand([*argv[:index], alt, *argv[index + 1:]])]
    return [argv]


def _check(argv: list[str]) -> None:
    command = _click_root(argv[0])
    words = argv[1:]
    path = [argv[0]]
    while hasattr(command, "commands") and words and not words[0].startswith("-"):
        name = words.pop(0)
        sub = command.commands.get(name)
        assert sub is not None, f"README: `{' '.join(path)} {name}` is not a command"
        command, path = sub, [*path, name]
    if hasattr(command, "commands"):
        return  # a group named alone, or with --help
    known = {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)} | {"--help"}
    for word in words:
        if word.startswith("--"):
            flag = word.split("=")[0]
            assert flag in known, f"README: `{' '.join(path)}` has no option {flag} (it has {sorted(known)})"


LINES = [cmd for line in _shell_lines(README) for cmd in _commands(line)]


def test_the_readme_shows_commands():
    assert len(LINES) > 30


@pytest.mark.parametrize("argv", [x for argv in LINES for x in _expand(argv)], ids=lambda a: " ".join(a)[:60])
def test_every_readme_command_exists_with_its_options(argv):
    _check(argv)


def test_every_doc_the_readme_names_exists():
    for name in sorted(set(re.findall(r"\b(docs/[\w./-]+\.(?:md|png))", README))):
        assert (ROOT / name).is_file(), f"README names {name}, which is not there"
