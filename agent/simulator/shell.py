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
import hashlib
import os
import re
import shlex
import shutil
import signal
import stat as st
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from agent.bundle import sha256_file
from agent.fsroot import FS_ROOT_ENV
from agent.simulator.android import AndroidState
from agent.simulator.apps import STAY_ON, AppError, PhoneApps, parse_intent
from agent.simulator.fs import SandboxFS, fs_error
from agent.simulator.thermal import ThermalModel

PROJECT_ROOT = Path(__file__).resolve().parents[2]
AGENT_ROOT = "/data/local/tmp/devicefarm"  # where farm transports put the agent (transports/adb.py)
AGENT_ROOT_ENV = "FARM_AGENT_ROOT"
# Subcommands that would listen on a host port: a phone's user has no business opening those.
HOST_ONLY_AGENT_COMMANDS = ("serve", "simulate")
THERMAL_MIRROR_S = 0.5  # how often the agent's copy of the thermal zones is refreshed
LIST_OPS = (";", "&&", "||")
REDIRECTS = (">", ">>", "<", ">&")
DEFAULT_ENV = {
    "PATH": "/product/bin:/apex/com.android.runtime/bin:/apex/com.android.art/bin:/system_ext/bin:"
            "/system/bin:/system/xbin:/odm/bin:/vendor/bin:/vendor/xbin",
    "HOME": "/", "TMPDIR": "/data/local/tmp", "ANDROID_DATA": "/data", "ANDROID_ROOT": "/system",
    "EXTERNAL_STORAGE": "/sdcard", "HOSTNAME": "localhost", "USER": "shell", "LOGNAME": "shell",
    "SHELL": "/system/bin/sh",
}


class ShellSyntaxError(ValueError):
    pass


class ShellExit(Exception):
    def __init__(self, code: int):
        self.code = code


@dataclass(frozen=True)
class AgentSettings:
    """How `farm-agent` on the virtual phone is run: `command` replaces the name, then the
    translated arguments follow (with PYTHONSAFEPATH=1 in its environment whatever it is).
    `kill_grace_s` is how long a killed agent gets after SIGTERM before SIGKILL."""

    name: str = "farm-agent"
    command: tuple[str, ...] = (sys.executable, "-P", "-m", "agent.cli")
    kill_grace_s: float = 2.0


@dataclass
class Session:
    cwd: str = "/"
    env: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_ENV))
    exported: set[str] = field(default_factory=set)
    status: int = 0


# ---- standard input ----------------------------------------------------------------------


class Stdin:
    """Bytes given up front (a pipe, a file, nothing)."""

    def __init__(self, data: bytes = b""):
        self._data = data

    async def chunks(self) -> AsyncIterator[bytes]:
        if self._data:
            yield self._data
            self._data = b""

    async def read_all(self) -> bytes:
        return b"".join([c async for c in self.chunks()])


class StreamStdin(Stdin):
    """Bytes arriving from the ADB stream; None in the queue marks end of input. Commands
    that never read standard input never wait for it."""

    def __init__(self):
        super().__init__()
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._eof = False

    async def chunks(self) -> AsyncIterator[bytes]:
        while not self._eof:
            chunk = await self.queue.get()
            if chunk is None:
                self._eof = True
                return
            yield chunk

    async def readline(self) -> bytes | None:
        """One line for the interactive shell; None at end of input."""
        buf = getattr(self, "_line_buf", b"")
        while b"\n" not in buf:
            if self._eof:
                self._line_buf = b""
                return buf or None
            chunk = await self.queue.get()
            if chunk is None:
                self._eof = True
                continue
            buf += chunk
        line, _, self._line_buf = buf.partition(b"\n")
        return line


Writer = Callable[[bytes], Awaitable[None]]


@dataclass
class IO:
    stdin: Stdin
    out: Writer
    err: Writer


async def _discard(_: bytes) -> None:
    return None


# ---- the interpreter ---------------------------------------------------------------------


class Shell:
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
            "chmod": self._chmod,
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
                out = _discard if out_file == "/dev/null" else _appender(out_buf)
                if out_file != "/dev/null":
                    self._check_writable(out_file, session)
            if err_to_out:
                err = out
            elif err_file is not None:
                err = _discard if err_file == "/dev/null" else _appender(err_buf)
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

    # ---- built-in commands -------------------------------------------------------------------
    # Each takes (args, io, session) and returns the exit status; output follows toybox.

    async def _echo(self, args, io, s):
        newline = True
        while args and args[0] in ("-n", "-e", "-ne", "-en"):
            newline = newline and "n" not in args[0]
            args = args[1:]
        await io.out((" ".join(args) + ("\n" if newline else "")).encode())
        return 0

    async def _cd(self, args, io, s):
        target = self.fs.normalize(args[0] if args else "/", s.cwd)
        info = self.fs.try_stat(target)
        if info is None or not info.is_dir:
            await io.err(f"sh: cd: {args[0] if args else '/'}: No such file or directory\n".encode())
            return 2
        s.cwd = target
        return 0

    async def _pwd(self, args, io, s):
        await io.out(f"{s.cwd}\n".encode())
        return 0

    async def _ls(self, args, io, s):
        flags, paths = _split_flags(args)
        long, show_all = "l" in flags, "a" in flags
        paths = paths or ["."]
        status = 0
        files, dirs = [], []
        for p in paths:
            info = self.fs.try_stat(p, s.cwd)
            if info is None:
                await io.err(f"ls: {p}: No such file or directory\n".encode())
                status = 1
            elif info.is_dir and "d" not in flags:
                dirs.append(p)
            else:
                files.append((p, info))
        out = [self._ls_line(p, info, long) for p, info in files]
        for n, d in enumerate(dirs):
            names = self.fs.listdir(d, s.cwd)
            if show_all:
                names = [".", ".."] + names
            else:
                names = [x for x in names if not x.startswith(".")]
            if len(paths) > 1:
                out.append(("\n" if out or n else "") + f"{d}:")
            if long:
                out.append(f"total {len(names)}")
            for name in names:
                full = self.fs.normalize(f"{d}/{name}", s.cwd)
                out.append(self._ls_line(name, self.fs.try_stat(full), long))
        if out:
            await io.out(("\n".join(out) + "\n").encode())
        return status

    @staticmethod
    def _ls_line(name: str, info, long: bool) -> str:
        if not long or info is None:
            return name
        when = time.strftime("%Y-%m-%d %H:%M", time.gmtime(info.mtime))
        return f"{st.filemode(info.mode)} {info.nlink:>2} shell shell {info.size:>8} {when} {name}"

    async def _cat(self, args, io, s):
        if not args or args == ["-"]:
            async for chunk in io.stdin.chunks():
                await io.out(chunk)
            return 0
        status = 0
        for p in args:
            try:
                host = self.fs.readable_host_file(p, s.cwd)
                if host is None:
                    await io.out(self.fs.read_bytes(p, s.cwd))
                    continue
                with host.open("rb") as f:
                    while chunk := f.read(1 << 20):
                        await io.out(chunk)
            except OSError as exc:
                await io.err(f"cat: {p}: {exc.strerror}\n".encode())
                status = 1
        return status

    async def _mkdir(self, args, io, s):
        flags, paths = _split_flags(args)
        status = 0
        for p in paths:
            try:
                host = self.fs.writable_host_path(p, s.cwd)
                if "p" in flags:
                    host.mkdir(parents=True, exist_ok=True)
                else:
                    host.mkdir()
            except OSError as exc:
                await io.err(f"mkdir: '{p}': {exc.strerror}\n".encode())
                status = 1
        return status

    async def _rm(self, args, io, s):
        flags, paths = _split_flags(args)
        recursive, force = bool({"r", "R"} & set(flags)), "f" in flags
        status = 0
        for p in paths:
            try:
                if self.fs.normalize(p, s.cwd) == "/":
                    raise fs_error(errno.EBUSY, "/")
                host = self.fs.writable_host_path(p, s.cwd)
                if host.is_dir() and not host.is_symlink():
                    if not recursive:
                        raise fs_error(errno.EISDIR, p)
                    await asyncio.to_thread(shutil.rmtree, host)
                elif host.exists() or host.is_symlink():
                    host.unlink()
                elif not force:
                    raise fs_error(errno.ENOENT, p)
            except OSError as exc:
                await io.err(f"rm: {p}: {exc.strerror}\n".encode())
                status = 1
        return status

    async def _move_or_copy(self, name, args, io, s, copy: bool):
        flags, paths = _split_flags(args)
        if len(paths) < 2:
            await io.err(f"{name}: needs 2 arguments\n".encode())
            return 1
        *sources, dest = paths
        status = 0
        try:
            dest_host = self.fs.writable_host_path(dest, s.cwd)
        except OSError as exc:
            await io.err(f"{name}: {dest}: {exc.strerror}\n".encode())
            return 1
        for src in sources:
            try:
                src_host = self.fs.host_path(src, s.cwd) if copy else self.fs.writable_host_path(src, s.cwd)
                if not src_host.exists():
                    raise fs_error(errno.ENOENT, src)
                target = dest_host / src_host.name if dest_host.is_dir() else dest_host
                if not copy:
                    await asyncio.to_thread(shutil.move, src_host, target)
                elif src_host.is_dir():
                    if not {"r", "R", "a"} & set(flags):
                        raise fs_error(errno.EISDIR, src)
                    await asyncio.to_thread(shutil.copytree, src_host, target, dirs_exist_ok=True)
                else:
                    await asyncio.to_thread(shutil.copyfile, src_host, target)
            except OSError as exc:
                await io.err(f"{name}: {src}: {exc.strerror}\n".encode())
                status = 1
        return status

    async def _mv(self, args, io, s):
        return await self._move_or_copy("mv", args, io, s, copy=False)

    async def _cp(self, args, io, s):
        return await self._move_or_copy("cp", args, io, s, copy=True)

    async def _touch(self, args, io, s):
        for p in _split_flags(args)[1]:
            self.fs.writable_host_path(p, s.cwd).touch()
        return 0

    async def _sha256sum(self, args, io, s):
        if not args or args == ["-"]:
            digest = hashlib.sha256(await io.stdin.read_all()).hexdigest()
            await io.out(f"{digest}  -\n".encode())
            return 0
        status = 0
        for p in args:
            try:
                host = self.fs.readable_host_file(p, s.cwd)
                if host is None:
                    digest = hashlib.sha256(self.fs.read_bytes(p, s.cwd)).hexdigest()
                else:
                    digest = await asyncio.to_thread(sha256_file, host)
                await io.out(f"{digest}  {p}\n".encode())
            except OSError as exc:
                await io.err(f"sha256sum: {p}: {exc.strerror}\n".encode())
                status = 1
        return status

    async def _stat(self, args, io, s):
        fmt = None
        if len(args) >= 2 and args[0] == "-c":
            fmt, args = args[1], args[2:]
        elif args and args[0].startswith("--format="):
            fmt, args = args[0].split("=", 1)[1], args[1:]
        status = 0
        for p in args:
            info = self.fs.try_stat(p, s.cwd)
            if info is None:
                await io.err(f"stat: '{p}': No such file or directory\n".encode())
                status = 1
                continue
            kind = "directory" if info.is_dir else ("regular file" if info.size else "regular empty file")
            fields = {"s": str(info.size), "n": p, "Y": str(info.mtime), "a": f"{st.S_IMODE(info.mode):o}",
                      "A": st.filemode(info.mode), "F": kind, "U": "shell", "G": "shell", "%": "%"}
            if fmt is None:
                text = f"  File: {p}\n  Size: {info.size}\t {kind}\nAccess: ({st.S_IMODE(info.mode):04o}/{st.filemode(info.mode)})\n"
            else:
                text = re.sub(r"%(.)", lambda m, f=fields: f.get(m.group(1), m.group(0)), fmt) + "\n"
            await io.out(text.encode())
        return status

    async def _getprop(self, args, io, s):
        await io.out(self.android.getprop(args[0] if args else None).encode())
        return 0

    async def _dumpsys(self, args, io, s):
        if not args:
            await io.err(b"dumpsys: a service name is required on the virtual phone\n")
            return 1
        text, code = self.android.dumpsys(args[0])
        await io.out(text.encode())
        return code

    async def _uname(self, args, io, s):
        await io.out(self.android.uname("".join(a.lstrip("-") for a in args) or "s").encode())
        return 0

    async def _test(self, args, io, s):
        if args and args[-1] == "]":
            args = args[:-1]
        negate = bool(args) and args[0] == "!"
        if negate:
            args = args[1:]
        if not args:
            result = False
        elif len(args) == 1:
            result = args[0] != ""
        elif len(args) == 2 and args[0] in ("-e", "-f", "-d", "-s", "-r", "-w", "-x", "-n", "-z"):
            op, arg = args
            info = self.fs.try_stat(arg, s.cwd) if op not in ("-n", "-z") else None
            result = {
                "-e": info is not None, "-r": info is not None, "-w": info is not None,
                "-x": info is not None and bool(info.mode & 0o111),
                "-f": info is not None and not info.is_dir, "-d": info is not None and info.is_dir,
                "-s": info is not None and info.size > 0, "-n": arg != "", "-z": arg == "",
            }[op]
        elif len(args) == 3 and args[1] in ("=", "==", "!="):
            result = (args[0] == args[2]) != (args[1] == "!=")
        elif len(args) == 3 and args[1] in ("-eq", "-ne", "-lt", "-le", "-gt", "-ge"):
            try:
                a, b = int(args[0]), int(args[2])
            except ValueError:
                await io.err(b"sh: test: bad number\n")
                return 2
            result = {"-eq": a == b, "-ne": a != b, "-lt": a < b, "-le": a <= b, "-gt": a > b, "-ge": a >= b}[args[1]]
        else:
            await io.err(f"sh: test: unsupported expression: {' '.join(args)}\n".encode())
            return 2
        return 0 if result != negate else 1

    async def _true(self, args, io, s):
        return 0

    async def _false(self, args, io, s):
        return 1

    async def _exit(self, args, io, s):
        raise ShellExit(int(args[0]) if args and args[0].lstrip("-").isdigit() else s.status)

    async def _sleep(self, args, io, s):
        await asyncio.sleep(float(args[0]) if args else 0)
        return 0

    async def _id(self, args, io, s):
        await io.out(b"uid=2000(shell) gid=2000(shell) groups=2000(shell),1004(input),1007(log),1011(adb),"
                     b"1015(sdcard_rw),1028(sdcard_r),3003(inet) context=u:r:shell:s0\n")
        return 0

    async def _whoami(self, args, io, s):
        await io.out(b"shell\n")
        return 0

    async def _env(self, args, io, s):
        await io.out("".join(f"{k}={v}\n" for k, v in sorted(s.env.items())).encode())
        return 0

    async def _export(self, args, io, s):
        for a in args:
            k, eq, v = a.partition("=")
            if eq:
                s.env[k] = v
            s.exported.add(k)
        return 0

    async def _which(self, args, io, s):
        status = 0
        for a in args:
            if a in self.commands or a == self.agent.name:
                await io.out(f"/system/bin/{a}\n".encode())
            else:
                status = 1
        return status

    async def _grep(self, args, io, s):
        flags, rest = _split_flags(args)
        if not rest:
            await io.err(b"grep: no pattern\n")
            return 2
        pattern, paths = rest[0], rest[1:]
        regex = re.compile(re.escape(pattern) if "F" in flags else pattern, re.I if "i" in flags else 0)
        sources = [(None, await io.stdin.read_all())] if not paths else []
        status = 0
        for p in paths:
            try:
                sources.append((p, self.fs.read_bytes(p, s.cwd)))
            except OSError as exc:
                await io.err(f"grep: {p}: {exc.strerror}\n".encode())
                status = 2
        hits = []
        for p, data in sources:
            for line in data.decode(errors="replace").splitlines():
                if bool(regex.search(line)) != ("v" in flags):
                    hits.append(f"{p}:{line}" if len(paths) > 1 else line)
        if "c" in flags:
            await io.out(f"{len(hits)}\n".encode())
        elif "q" not in flags and hits:
            await io.out(("\n".join(hits) + "\n").encode())
        return status if status else (0 if hits else 1)

    async def _head_tail(self, args, io, s, tail: bool):
        n, paths = 10, []
        it = iter(args)
        for a in it:
            if a == "-n":
                n = int(next(it, "10"))
            elif re.fullmatch(r"-n?\d+", a):
                n = int(a.lstrip("-n"))
            else:
                paths.append(a)
        data = self.fs.read_bytes(paths[0], s.cwd) if paths else await io.stdin.read_all()
        lines = data.splitlines(keepends=True)
        await io.out(b"".join(lines[-n:] if tail and n else lines[:n] if not tail else []))
        return 0

    async def _head(self, args, io, s):
        return await self._head_tail(args, io, s, tail=False)

    async def _tail(self, args, io, s):
        return await self._head_tail(args, io, s, tail=True)

    async def _wc(self, args, io, s):
        flags, paths = _split_flags(args)
        data = self.fs.read_bytes(paths[0], s.cwd) if paths else await io.stdin.read_all()
        counts = {"l": data.count(b"\n"), "w": len(data.split()), "c": len(data)}
        shown = [str(counts[f]) for f in "lwc" if f in flags] or [str(counts[f]) for f in "lwc"]
        await io.out((" ".join(shown) + (f" {paths[0]}" if paths else "") + "\n").encode())
        return 0

    async def _sh(self, args, io, s):
        if len(args) >= 2 and args[0] == "-c":
            sub = Session(s.cwd, dict(s.env), set(s.exported), s.status)
            return await self.run(args[1], io, sub)
        await io.err(b"sh: only 'sh -c COMMAND' is supported on the virtual phone\n")
        return 2

    async def _nproc(self, args, io, s):
        await io.out(f"{os.cpu_count() or 1}\n".encode())
        return 0

    async def _date(self, args, io, s):
        if args and args[0] == "+%s":
            await io.out(f"{int(time.time())}\n".encode())
        else:
            await io.out(time.strftime("%a %b %e %H:%M:%S UTC %Y\n", time.gmtime()).encode())
        return 0

    async def _chmod(self, args, io, s):
        if len(args) < 2 or not re.fullmatch(r"[0-7]{3,4}", args[0]):
            await io.err(b"chmod: the virtual phone takes octal modes only\n")
            return 1
        if int(args[0], 8) & 0o7000:  # the sandbox's files are the host's: no setuid on the host
            await io.err(f"chmod: {args[0]}: the virtual phone does not set setuid, setgid or sticky bits; "
                         f"use {int(args[0], 8) & 0o777:04o}\n".encode())
            return 1
        for p in args[1:]:
            os.chmod(self.fs.writable_host_path(p, s.cwd), int(args[0], 8))
        return 0

    # ---- the phone's apps (agent/simulator/apps.py) -------------------------------------------
    # Output and exit codes follow ActivityManagerShellCommand (errors on stderr, `am start`
    # exits 0 even when the activity did not start) and PackageManagerShellCommand.

    async def _am(self, args, io, s):
        if not args:
            await io.err(b"usage: am start [-a ACTION] [-d URL] [-n PACKAGE/ACTIVITY] [PACKAGE] | am force-stop PACKAGE\n")
            return 255
        command, rest = args[0], args[1:]
        if command in ("start", "start-activity"):
            return await self._am_start(rest, io)
        if command == "force-stop":
            packages = [a for a in _without_user_option(rest) if not a.startswith("-")]
            if len(packages) != 1:
                await io.err(b"Error: am force-stop takes one package\n")
                return 255
            await asyncio.to_thread(self.apps.force_stop, packages[0])
            return 0
        await io.err(f"Unknown command: {command}\n".encode())
        return 255

    async def _am_start(self, args, io):
        try:
            intent = parse_intent(args)
        except ValueError as exc:
            await io.err(f"{exc}\n".encode())
            return 255
        await io.out(f"Starting: {intent}\n".encode())
        package, error = self.apps.resolve(intent)
        if package is None:
            await io.err(error.encode())
            return 0
        try:
            await asyncio.to_thread(self.apps.start, package, intent)
        except (AppError, OSError) as exc:
            await io.err(f"Error: {package} did not start on the virtual phone: {exc}\n".encode())
            return 1
        return 0

    async def _pm(self, args, io, s):
        if len(args) < 2 or args[:2] != ["list", "packages"]:
            await io.err(b"Error: the virtual phone's pm knows 'pm list packages [FILTER]' only\n")
            return 255
        words = [a for a in _without_user_option(args[2:]) if not a.startswith("-")]
        shown = [p for p in self.apps.packages if not words or words[0] in p]
        await io.out("".join(f"package:{p}\n" for p in shown).encode())
        return 0

    async def _svc(self, args, io, s):
        if len(args) == 3 and args[:2] == ["power", "stayon"] and args[2] in STAY_ON:
            self.apps.stay_on = STAY_ON[args[2]]
            return 0
        await io.err(b"Control the power manager\n\nusage: svc power stayon [true|false|usb|ac|wireless]\n"
                     b"         Set the 'keep awake while plugged in' setting.\n")
        return 1

    async def _input(self, args, io, s):
        keys = args[1:] if args[:1] == ["keyevent"] else []
        if keys[:1] == ["--longpress"]:
            keys = keys[1:]
        if not keys or not all(re.fullmatch(r"KEYCODE_[A-Z0-9_]+|\d+", k) for k in keys):
            await io.err(b"Error: the virtual phone's input takes 'input keyevent KEYCODE_...' only\n")
            return 1
        for key in keys:
            self.apps.key_events.append(key)
            if key in ("KEYCODE_WAKEUP", "224"):
                self.apps.awake = True
            elif key in ("KEYCODE_SLEEP", "223"):
                self.apps.awake = False
            elif key in ("KEYCODE_POWER", "26"):
                self.apps.awake = not self.apps.awake
        return 0


def _without_user_option(args: list[str]) -> list[str]:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == "--user":
            skip = True
        else:
            out.append(a)
    return out


def _split_flags(args: list[str]) -> tuple[str, list[str]]:
    flags, rest = "", []
    for a in args:
        if a.startswith("-") and len(a) > 1 and not rest:
            flags += a[1:]
        else:
            rest.append(a)
    return flags, rest


def _appender(buf: bytearray) -> Writer:
    async def write(data: bytes) -> None:
        buf.extend(data)

    return write
