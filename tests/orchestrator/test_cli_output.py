"""How `farm` prints for people: output that is not a terminal is never cut to a width (tables
as wide as their content, whatever COLUMNS says), values a person must copy whole are printed
whole, and the command has --version and shell completion."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

from rich.table import Table

from orchestrator.cli.output import FarmConsole

REPO = Path(__file__).resolve().parents[2]
LONG = "demo-20261127T101500Z-b/" + "x" * 150


FARM = Path(sys.executable).parent / "farm"  # the installed console script


def _farm(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([str(FARM), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_a_table_written_to_a_pipe_keeps_every_cell_whole_whatever_columns_says(monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")
    out = io.StringIO()
    console = FarmConsole(file=out)
    table = Table("build", "device", "verdict")
    table.add_row(LONG, "vphone-chrome-1", "regression")
    console.print(table)
    text = out.getvalue()
    assert LONG in text and "vphone-chrome-1" in text and "regression" in text and "…" not in text


def test_hex_pairs_that_spell_emoji_codes_stay_text():
    # A CA fingerprint such as ...:D7:CD:B8:... printed as ...:D7💿B8:... by rich's emoji codes.
    out = io.StringIO()
    console = FarmConsole(file=out)
    fingerprint = "27:16:C7:19:4A:18:D7:CD:B8:01:FE:53"
    console.print(fingerprint, soft_wrap=True)
    table = Table("SHA-256")
    table.add_row(fingerprint)
    console.print(table)
    assert out.getvalue().count(fingerprint) == 2, out.getvalue()


def test_a_terminal_still_gets_tables_fitted_to_its_width():
    out = io.StringIO()
    console = FarmConsole(file=out, force_terminal=True, width=40, color_system=None)
    table = Table("build", "device")
    table.add_row(LONG, "vphone-chrome-1")
    console.print(table)
    assert max(len(line) for line in out.getvalue().splitlines()) <= 40


def test_ca_show_prints_the_fingerprint_whole_in_a_narrow_terminal_or_a_pipe(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env |= {"FARM_CONFIG_DIR": str(tmp_path / ("a-long-folder-name-" * 6)), "FARM_DATA_DIR": str(tmp_path / "d"),
            "COLUMNS": "30"}
    assert _farm("ca", "init", "--name", "lab CA", env=env).returncode == 0
    shown = _farm("ca", "show", env=env)
    assert shown.returncode == 0, shown.stderr
    from orchestrator.infra import ca

    folder = Path(env["FARM_CONFIG_DIR"]) / "ca"
    fingerprint = ca.fingerprint(ca.load_ca_cert(folder))
    lines = shown.stdout.splitlines()
    assert any(fingerprint in line for line in lines), shown.stdout  # on one line, not folded
    assert any(str(folder / ca.CA_KEY) in line for line in lines), shown.stdout


def test_version_and_shell_completion():
    env = dict(os.environ)
    version = _farm("--version", env=env)
    from importlib.metadata import version as installed

    assert version.returncode == 0 and version.stdout.strip() == f"farm (devicefarm) {installed('devicefarm')}"
    script = _farm("--show-completion", "bash", env=env | {"_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"})
    assert script.returncode == 0 and "complete -o default -F _farm_completion farm" in script.stdout, script.stdout
    # What bash asks the completion function for when a user types `farm eng<TAB>`.
    words = _farm(env=env | {"_FARM_COMPLETE": "complete_bash", "COMP_WORDS": "farm eng", "COMP_CWORD": "1"})
    assert words.returncode == 0 and words.stdout.split() == ["engine"], words.stdout + words.stderr


MARKUP_MODEL = "[/]"  # a closing tag with nothing open: rich's MarkupError
MARKUP_GPU = "[link=https://evil.example/]Adreno 740[/link]"  # a hyperlink in the operator's terminal


def test_what_devices_report_is_printed_as_text_never_as_markup(tmp_path):
    """A phone whose model reads "[/]" made `farm devices list` fail with rich's MarkupError,
    and "[link=...]" in its GPU name made a link in the operator's terminal. Every command that
    shows what devices report prints it as it is, on a terminal (FORCE_COLOR) and in a pipe."""
    from agent.protocol import DeviceInfo
    from orchestrator import store
    from orchestrator.store import make_engine, make_session_factory, upgrade
    from orchestrator.store.models import JobState

    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env |= {"FARM_DATA_DIR": str(tmp_path / "data"), "FARM_CONFIG_DIR": str(tmp_path / "config")}
    url = f"sqlite:///{tmp_path / 'data' / 'farm.db'}"
    (tmp_path / "data").mkdir()
    upgrade(url)
    engine = make_engine(url)
    try:
        with make_session_factory(engine)() as session, session.begin():
            info = DeviceInfo(serial="evil-1", model=MARKUP_MODEL, manufacturer="[bold]x", os="android",
                              os_version="14", adapter={"device": MARKUP_GPU, "vendor": "[red]qualcomm"})
            device = store.upsert_device(session, "evil-1", "adb", "127.0.0.1:5555", info=info)
            job = store.create_job(session, "latency", {"model": "models/tiny"}, device.id, None)
            store.transition_job(session, job.id, JobState.running, worker="w")
            store.transition_job(session, job.id, JobState.failed, error="[/] device said [link=https://evil.example/]no")
            job_id = job.id
    finally:
        engine.dispose()
    for terminal in ({}, {"FORCE_COLOR": "1", "TTY_COMPATIBLE": "1"}):
        for args in (["devices", "list"], ["devices", "show", "evil-1"], ["jobs", "list"], ["jobs", "show", str(job_id)]):
            done = _farm(*args, env=env | terminal)
            assert done.returncode == 0, (args, done.stdout + done.stderr)
            assert "\x1b]8;" not in done.stdout, (args, done.stdout)  # no OSC 8 hyperlink
            plain = _strip_ansi(done.stdout)
            if terminal:  # a terminal's 80 columns fold the cells; the pipe's output is checked whole
                continue
            if args[0] == "devices":
                assert MARKUP_MODEL in plain and MARKUP_GPU in plain, (args, plain)
            if args == ["jobs", "show", str(job_id)]:
                assert "[/] device said [link=https://evil.example/]no" in plain, plain


def _strip_ansi(text: str) -> str:
    import re

    return re.sub(r"\x1b\[[0-9;]*m", "", text)
