"""The virtual phone's shell: a small, explicit interpreter for the commands the farm and its
users send over `adb shell`, never the host's /bin/sh. It splits a line with shlex into
lists (`;`, `&&`, `||`) of pipelines (`|`) of commands with redirections (`>`, `>>`, `<`,
`2>`, `2>&1`), expands `$?`, `$VAR` and globs against the sandbox, and runs built-in
commands that print what toybox and Android's services print. The one command that runs a
real host process is the on-device agent (`farm-agent`), and it is kept inside the phone: it
starts with a safe import path (never the phone's folders: a file pushed to the phone is never
imported on the host), gets the sandbox as its working directory and its root, receives only
the phone's FARM_* variables, and is confined to the sandbox ($FARM_AGENT_FS_ROOT, checked by
agent/fsroot.py). Absolute device paths in its arguments always become host paths inside the
sandbox (one a symlink leads out of is refused), and host paths in its output become device
paths again. While it runs, the thermal model counts a job. `am`, `pm`, `svc power` and
`input` act on the phone's apps (agent/simulator/apps.py): `am start` on a web URL opens it in
a real headless Chromium."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import re
import shlex
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from agent.fsroot import FS_ROOT_ENV
from agent.simulator.android import AndroidState
from agent.simulator.apps import PhoneApps
from agent.simulator.builtins import Builtins
from agent.simulator.fs import SandboxFS, fs_error
from agent.simulator.shellio import (
    IO,
    Session,
    ShellExit,
    ShellSyntaxError,
    Stdin,
    StreamStdin,
    Writer,
    discard,
)
from agent.simulator.thermal import ThermalModel

PROJECT_ROOT = Path(__file__).resolve().parents[2]
AGENT_ROOT = "/data/local/tmp/devicefarm"  # where farm transports put the agent (transports/adb.py)
AGENT_ROOT_ENV = "FARM_AGENT_ROOT"
# Subcommands that would listen on a host port: a phone's user has no business opening those.
HOST_ONLY_AGENT_COMMANDS = ("serve", "simulate")
THERMAL_MIRROR_S = 0.5  # how often the agent's copy of the thermal zones is refreshed
LIST_OPS = (";", "&&", "||")
REDIRECTS = (">", ">>", "<", ">&")
@dataclass(frozen=True)
class AgentSettings:
    """How `farm-agent` on the virtual phone is run: `command` replaces the name, then the
    translated arguments follow (with PYTHONSAFEPATH=1 in its environment whatever it is).
    `kill_grace_s` is how long a killed agent gets after SIGTERM before SIGKILL."""

    name: str = "farm-agent"
    command: tuple[str, ...] = (sys.executable, "-P", "-m", "agent.cli")
    kill_grace_s: float = 2.0



# ---- the interpreter ---------------------------------------------------------------------


class Shell(Builtins):
    def __init__(self, fs: SandboxFS, android: AndroidState, thermal: ThermalModel,
                 agent: AgentSettings | None = None, apps: PhoneApps | None = None):
        self.fs = fs
        self.android = android
        self.thermal = thermal
        self.agent = agent or AgentSettings()
        self.apps = apps
        self.commands: dict[str, Callable[[list[str], IO, Session], Awaitable[int]]] = {
            "echo": self._echo, "cd": self._cd, "pwd": self._pwd, "ls": self._ls, "cat": self._cat,
            "mkdir": self._mkdir, "rm": self._rm, "mv": self._mv, "cp": self._cp, "touch": self._touch,
            "sha256sum": self._sha256sum, "stat": self._stat, "getprop": self._getprop,
            "dumpsys": self._dumpsys, "uname": self._uname, "test": self._test, "[": self._test,
            "true": self._true, "false": self._false, "exit": self._exit, "sleep": self._sleep,
            "id": self._id, "whoami": self._whoami, "env": self._env, "export": self._export,
            "which": self._which, "grep": self._grep, "head": self._head, "tail": self._tail,
            "wc": self._wc, "sh": self._sh, "nproc": self._nproc, "date": self._date,
            "chmod": self._chmod, "screencap": self._screencap,
        }
        if apps is not None:
            self.commands.update({"am": self._am, "pm": self._pm, "svc": self._svc, "input": self._input})

    # ---- entry points --------------------------------------------------------------------

    async def run(self, line: str, io: IO, session: Session | None = None) -> int:
        """Run one command line; returns its exit status (what `$?` would be)."""
        session = session or Session()
        try:
            parsed = self._parse(line)
        except ShellSyntaxError as exc:
            await io.err(f"sh: syntax error: {exc}\n".encode())
            session.status = 2
            return 2
        try:
            return await self._run_list(parsed, io, session, line)
        except ShellExit as exc:
            session.status = exc.code
            return exc.code

    async def interactive(self, stdin: StreamStdin, io: IO, prompt: bool) -> int:
        """`adb shell` with no command: one line at a time until `exit` or end of input."""
        session = Session()
        while True:
            if prompt:
                await io.out(f"{self.android.model.device}:{session.cwd} $ ".encode())
            line = await stdin.readline()
            if line is None:
                return session.status
            try:
                parsed = self._parse(line.decode(errors="replace"))
                await self._run_list(parsed, IO(Stdin(), io.out, io.err), session, line.decode(errors="replace"))
            except ShellSyntaxError as exc:
                await io.err(f"sh: syntax error: {exc}\n".encode())
                session.status = 2
            except ShellExit as exc:
                return exc.code

    # ---- parsing and expansion -----------------------------------------------------------

    @staticmethod
    def _parse(line: str) -> list[tuple[str, list[list[str]]]]:
        """[(operator before it, pipeline)], a pipeline being a list of commands' words."""
        lex = shlex.shlex(line, posix=True, punctuation_chars=";&|<>")
        lex.whitespace_split = True
        lex.commenters = ""
        try:
            tokens = list(lex)
        except ValueError as exc:
            raise ShellSyntaxError(str(exc).lower()) from None
        lists: list[tuple[str, list[list[str]]]] = []
        op, pipeline, words = ";", [], []
        for tok in tokens + [";"]:
            if tok in LIST_OPS or tok == "|":
                if not words:
                    if tok == ";" and not pipeline:
                        continue  # empty command: "a;;" and trailing ";" are fine
                    raise ShellSyntaxError(f"unexpected '{tok}'")
                pipeline.append(words)
                words = []
                if tok != "|":
                    lists.append((op, pipeline))
                    op, pipeline = tok, []
            elif tok == "&":
                raise ShellSyntaxError("background jobs (&) are not supported on the virtual phone")
            elif set(tok) <= set("&|;<>") and tok not in REDIRECTS:
                raise ShellSyntaxError(f"unexpected '{tok}'")
            else:
                words.append(tok)
        return lists

    def _expand(self, word: str, session: Session) -> list[str]:
        def var(m: re.Match) -> str:
            name = m.group(1) or m.group(2)
            return str(session.status) if name == "?" else session.env.get(name, "")

        word = re.sub(r"\$\{(\w+|\?)\}|\$(\w+|\?)", var, word)
        if any(c in word for c in "*?[") and word not in REDIRECTS:
            matches = self.fs.glob(word, session.cwd)
            if matches:
                return matches
        return [word]

    # ---- execution -----------------------------------------------------------------------

    async def _run_list(self, parsed, io: IO, session: Session, line: str) -> int:
        status = session.status
        for op, pipeline in parsed:
            if (op == "&&" and status != 0) or (op == "||" and status == 0):
                continue
            stdin = io.stdin
            for i, words in enumerate(pipeline):
                last = i == len(pipeline) - 1
                piped = bytearray()

                async def collect(data: bytes, piped=piped) -> None:
                    piped.extend(data)

                status = await self._run_command(words, IO(stdin, io.out if last else collect, io.err), session, line)
                stdin = Stdin(bytes(piped))
            session.status = status
        return status

    async def _run_command(self, words: list[str], io: IO, session: Session, line: str) -> int:
        # fd-prefixed redirections ("2>", "2>&1") reach us as a "2" word before the operator
        fd_redirects = set(re.findall(r"(?<![\w/.-])([12])(?=>)", line))
        expanded: list[str] = []
        for w in words:
            expanded += self._expand(w, session)
        args, out_file, err_file, in_file, err_to_out, append = [], None, None, None, False, False
        i = 0
        while i < len(expanded):
            w = expanded[i]
            nxt = expanded[i + 1] if i + 1 < len(expanded) else None
            fd = None
            if w in ("1", "2") and nxt in (">", ">>", ">&") and w in fd_redirects:
                fd, i = w, i + 1
                w, nxt = nxt, expanded[i + 1] if i + 1 < len(expanded) else None
            if w in REDIRECTS:
                if nxt is None:
                    await io.err(b"sh: syntax error: redirection without a target\n")
                    return 2
                if w == ">&":
                    if fd == "2" and nxt == "1":
                        err_to_out = True
                elif w == "<":
                    in_file = nxt
                elif fd == "2":
                    err_file = nxt
                else:
                    out_file, append = nxt, w == ">>"
                i += 2
                continue
            args.append(w)
            i += 1

        assignments = {}
        while args and re.fullmatch(r"[A-Za-z_]\w*=.*", args[0], re.S):
            k, _, v = args.pop(0).partition("=")
            assignments[k] = v
        if not args:
            session.env.update(assignments)
            return 0

        out_buf, err_buf = bytearray(), bytearray()
        out, err, stdin = io.out, io.err, io.stdin
        try:
            if in_file is not None:
                stdin = Stdin(b"" if in_file == "/dev/null" else self.fs.read_bytes(in_file, session.cwd))
            if out_file is not None:
                out = discard if out_file == "/dev/null" else _appender(out_buf)
                if out_file != "/dev/null":
                    self._check_writable(out_file, session)
            if err_to_out:
                err = out
            elif err_file is not None:
                err = discard if err_file == "/dev/null" else _appender(err_buf)
        except OSError as exc:
            await io.err(f"sh: {exc.filename}: {exc.strerror}\n".encode())
            return 1

        name, rest = args[0], args[1:]
        cmd_session = session
        if assignments:  # VAR=x cmd: the variables hold for this command only
            cmd_session = Session(session.cwd, {**session.env, **assignments},
                                  session.exported | set(assignments), session.status)
        if name == self.agent.name:
            status = await self._run_agent(rest, IO(stdin, out, err), cmd_session)
        elif name in self.commands:
            try:
                status = await self.commands[name](rest, IO(stdin, out, err), cmd_session)
            except OSError as exc:
                await err(f"{name}: {exc.filename or ''}: {exc.strerror}\n".encode())
                status = 1
        else:
            await err(f"sh: {name}: not found\n".encode())
            status = 127
        if cmd_session is not session:
            session.cwd = cmd_session.cwd
        try:
            if out_file not in (None, "/dev/null"):
                self._write_file(out_file, bytes(out_buf), append, session)
            if err_file not in (None, "/dev/null"):
                self._write_file(err_file, bytes(err_buf), False, session)
        except OSError as exc:
            await io.err(f"sh: {exc.filename}: {exc.strerror}\n".encode())
            return 1
        return status

    def _check_writable(self, path: str, session: Session) -> None:
        host = self.fs.writable_host_path(path, session.cwd)
        if not host.parent.is_dir():
            raise fs_error(errno.ENOENT, self.fs.normalize(path, session.cwd))

    def _write_file(self, path: str, data: bytes, append: bool, session: Session) -> None:
        host = self.fs.writable_host_path(path, session.cwd)
        with host.open("ab" if append else "wb") as f:
            f.write(data)

    # ---- the on-device agent ---------------------------------------------------------------

    def _to_host_arg(self, arg: str) -> str:
        """An absolute device path becomes the host path behind it, always inside the sandbox
        (OSError EACCES when a symlink leads out); `--opt=/path` too. Relative paths pass:
        the agent resolves them in its sandboxed working folder and checks them itself."""
        if arg.startswith("-") and "=" in arg:
            opt, _, value = arg.partition("=")
            return f"{opt}={self._to_host_arg(value)}"
        if not arg.startswith("/"):
            return arg
        return str(self.fs.host_path(arg))

    def _agent_env(self, session: Session) -> dict[str, str]:
        """The host environment the agent needs (its own code on PYTHONPATH, never a folder of
        the phone), then the phone's exported FARM_* variables, paths translated. Anything else
        the phone exports (PATH, PYTHONPATH, LD_PRELOAD, ...) would choose code the host runs."""
        phone = self.fs.base.parent
        inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                     if os.path.isabs(p) and not Path(p).resolve().is_relative_to(phone)]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([str(PROJECT_ROOT), *inherited]))
        env["PYTHONSAFEPATH"] = "1"  # `python -m` would import from the current folder: the phone's
        env[AGENT_ROOT_ENV] = str(self.fs.host_path(AGENT_ROOT))
        for k in session.exported:
            if k.startswith("FARM_") and k != FS_ROOT_ENV:
                env[k] = self._to_host_arg(session.env.get(k, ""))
        env["TMPDIR"] = str(self.fs.host_path("/data/local/tmp"))
        env[FS_ROOT_ENV] = str(self.fs.base)
        return env

    def _to_device_text(self, data: bytes) -> bytes:
        base = str(self.fs.base).encode()
        return data.replace(base + b"/", b"/").replace(base, b"/")

    async def _run_agent(self, args: list[str], io: IO, session: Session) -> int:
        command = next((a for a in args if not a.startswith("-")), None)
        if command in HOST_ONLY_AGENT_COMMANDS:
            await io.err(f"{self.agent.name}: '{command}' is not available on the virtual phone (it would listen "
                         f"on a port of the host); the phone runs info, install and run\n".encode())
            return 2
        try:
            argv = [*self.agent.command, *(self._to_host_arg(a) for a in args)]
            env = self._agent_env(session)
        except OSError as exc:
            await io.err(f"{self.agent.name}: {exc.filename}: outside the device's filesystem (a symlink leads "
                         "out of it); name a path on the device\n".encode())
            return 2
        try:
            cwd = self.fs.host_path(session.cwd)
        except OSError:
            cwd = self.fs.base
        thermal_dir = self.fs.base.parent / "agent-thermal"
        env["FARM_AGENT_THERMAL_DIR"] = str(thermal_dir)
        self._mirror_thermal(thermal_dir)
        props = self.fs.base.parent / "agent-getprop.txt"  # the phone's OS, for each run's environment
        props.write_text(self.android.getprop())
        env["FARM_AGENT_GETPROP_FILE"] = str(props)
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=cwd, env=env, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True)
        self.thermal.job_started()

        async def mirror() -> None:  # the agent reads the phone's zones, kept current
            while True:
                await asyncio.sleep(THERMAL_MIRROR_S)
                self._mirror_thermal(thermal_dir)

        mirroring = asyncio.ensure_future(mirror())

        async def feed() -> None:
            with contextlib.suppress(OSError, RuntimeError):  # the agent may exit without reading
                async for chunk in io.stdin.chunks():
                    proc.stdin.write(chunk)
                    await proc.stdin.drain()
                proc.stdin.close()

        async def pump(reader: asyncio.StreamReader, write: Writer) -> None:
            pending = b""
            while chunk := await reader.read(65536):
                pending += chunk
                cut = pending.rfind(b"\n") + 1  # translate whole lines: a path never straddles
                if cut == 0 and len(pending) < 1 << 16:
                    continue
                cut = cut or len(pending)
                await write(self._to_device_text(pending[:cut]))
                pending = pending[cut:]
            if pending:
                await write(self._to_device_text(pending))

        feeder = asyncio.ensure_future(feed())
        try:
            await asyncio.gather(pump(proc.stdout, io.out), pump(proc.stderr, io.err))
            code = await proc.wait()
        finally:
            feeder.cancel()
            mirroring.cancel()
            if proc.returncode is None:  # the stream was closed: kill the agent and its children
                await self._kill(proc)
            self.thermal.job_finished()
        return code if code >= 0 else 128 - code

    def _mirror_thermal(self, folder: Path) -> None:
        """Copy the simulated /sys/class/thermal zones to real files the agent can read (each
        file replaced atomically, so a reader never sees half a number)."""
        for zone in self.fs.glob("/sys/class/thermal/thermal_zone*"):
            target = folder / zone.rsplit("/", 1)[1]
            target.mkdir(parents=True, exist_ok=True)
            for name in ("type", "temp"):
                with contextlib.suppress(OSError):
                    tmp = target / f".{name}.tmp"
                    tmp.write_bytes(self.fs.read_bytes(f"{zone}/{name}"))
                    os.replace(tmp, target / name)

    async def _kill(self, proc: asyncio.subprocess.Process) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                await asyncio.wait_for(asyncio.shield(proc.wait()), self.agent.kill_grace_s)
                return
            except TimeoutError:
                continue


def _appender(buf: bytearray) -> Writer:
    async def write(data: bytes) -> None:
        buf.extend(data)

    return write
