"""The virtual phone's built-in commands, as a mixin of its Shell (agent/simulator/shell.py):
each takes (args, io, session) and returns its exit status, printing what toybox and Android's
services print; `am`, `pm`, `svc power` and `input` act on the phone's apps
(agent/simulator/apps.py). They reach the phone through the shell's fs, android, thermal and
apps."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import re
import shutil
import stat as st
import time

from agent.bundle import sha256_file
from agent.simulator.apps import STAY_ON, AppError, parse_intent
from agent.simulator.fs import fs_error
from agent.simulator.shellio import Session, ShellExit


class Builtins:
    """The built-in commands; Shell gives them self.fs, self.android, self.thermal, self.apps."""

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

        async def cat(p):
            host = self.fs.readable_host_file(p, s.cwd)
            if host is None:
                await io.out(self.fs.read_bytes(p, s.cwd))
                return
            with host.open("rb") as f:
                while chunk := f.read(1 << 20):
                    await io.out(chunk)

        return await _each_path("cat", args, io, cat)

    async def _mkdir(self, args, io, s):
        flags, paths = _split_flags(args)

        async def mkdir(p):
            host = self.fs.writable_host_path(p, s.cwd)
            if "p" in flags:
                host.mkdir(parents=True, exist_ok=True)
            else:
                host.mkdir()

        return await _each_path("mkdir", paths, io, mkdir, quoted=True)

    async def _rm(self, args, io, s):
        flags, paths = _split_flags(args)
        recursive, force = bool({"r", "R"} & set(flags)), "f" in flags

        async def rm(p):
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

        return await _each_path("rm", paths, io, rm)

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

        async def sha256sum(p):
            host = self.fs.readable_host_file(p, s.cwd)
            if host is None:
                digest = hashlib.sha256(self.fs.read_bytes(p, s.cwd)).hexdigest()
            else:
                digest = await asyncio.to_thread(sha256_file, host)
            await io.out(f"{digest}  {p}\n".encode())

        return await _each_path("sha256sum", args, io, sha256sum)

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

    async def _screencap(self, args, io, s):
        """`screencap -p [FILE]`: the screen as PNG (agent/simulator/screen.py), on stdout or
        into FILE; the raw framebuffer dump (no -p) is not drawn."""
        from agent.simulator import android, screen

        flags, paths = _split_flags(args)
        if flags != "p" or len(paths) > 1:
            await io.err(b"screencap: the virtual phone draws PNGs only: screencap -p [FILE]\n")
            return 1
        apps = self.apps
        data = screen.render(apps.awake if apps is not None else True, android.BATTERY_LEVEL,
                             apps is not None and await asyncio.to_thread(apps.running, "com.android.chrome"))
        if paths:
            try:
                with open(self.fs.writable_host_path(paths[0], s.cwd), "wb") as f:
                    f.write(data)
            except OSError as exc:
                await io.err(f"screencap: {paths[0]}: {exc.strerror}\n".encode())
                return 1
        else:
            await io.out(data)
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


async def _each_path(name: str, paths: list[str], io, action, *, quoted: bool = False) -> int:
    """`await action(path)` for each path, as toybox's file commands go on: an OSError prints
    `name: path: why` on stderr (the path in quotes where the command quotes it) and makes the
    status 1, and the next path is tried. Returns the status."""
    status = 0
    for p in paths:
        try:
            await action(p)
        except OSError as exc:
            shown = f"'{p}'" if quoted else p
            await io.err(f"{name}: {shown}: {exc.strerror}\n".encode())
            status = 1
    return status
