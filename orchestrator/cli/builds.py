"""`farm builds ...`: signed build bundles. `create` packs this checkout's engine, shaders and
agent (or those of another checkout, `--source`, or of a commit, `--commit`: a pull request's
build) with a model folder (and optional extra profiles), signs the manifest with the farm key
(<config_dir>/farm.key, made on first use), writes the bundle to <data_dir>/builds/<name> (where
the deploy task reads it) and records it in the store, with a short label people call it by
(`--label A`; later `farm builds label BUILD LABEL`); `list` and `show` read the store."""

from __future__ import annotations

import datetime as dt
import io
import shutil
import subprocess
import tarfile
import uuid
from pathlib import Path
from typing import Any

import typer

from agent.bundle import DEFAULT_EXCLUDE
from orchestrator.infra.keys import PUBLIC_KEY, ensure_farm_key
from orchestrator.store.models import Build

from . import common, completion, validate
from .output import Table, console, escape

app = typer.Typer(help="Create and inspect signed build bundles.", no_args_is_help=True)

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "shaders", "agent")
# The virtual phone (agent/simulator) is a test and demo device that runs on the farm's host; no
# device ever runs it from a build, so builds leave it out.
BUILD_EXCLUDE = (*DEFAULT_EXCLUDE, "simulator")


def farm_key(config_dir: Path, announce: bool = True) -> Path:
    """The farm's private key path, generating the pair (private 0600) on first use (and, when
    `announce`, saying where the public key must go)."""
    private, made = ensure_farm_key(config_dir)
    if made and announce:
        public = config_dir / PUBLIC_KEY
        console.print(f"generated the farm signing key {private}; provision [bold]{public}[/] on each "
                      "device (it is the key devices check bundles with):", highlight=False)
        console.print(public.read_text().strip(), highlight=False, soft_wrap=True)
    return private


def _git(repo: Path, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, timeout=timeout)


def _source_revision(repo: Path = REPO) -> str:
    """The commit `repo` is checked out at (12 hex digits), "+dirty" when its packed folders
    have changes not committed; "" when it is no git checkout."""
    try:
        head = _git(repo, "rev-parse", "--short=12", "HEAD", timeout=10)
        if head.returncode != 0:
            return ""
        status = _git(repo, "status", "--porcelain", "--", *PACKAGES, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    dirty = status.returncode == 0 and status.stdout.strip()
    return head.stdout.decode().strip() + ("+dirty" if dirty else "")


def _checkout_tree(source: Path) -> Path:
    """`source` as the tree a build packs: a checkout of this project (its engine/, shaders/
    and agent/ folders, as they are on disk, changes not committed included)."""
    source = source.expanduser().resolve()
    missing = [pkg for pkg in PACKAGES if not (source / pkg).is_dir()]
    if not source.is_dir() or missing:
        common.fail(f"{source}: not a checkout of this project (no {', '.join(f'{m}/' for m in missing) or 'folder'})")
    return source


def _outside(into: Path, member: tarfile.TarInfo) -> str | None:
    """Why a member of a commit's archive would put something outside `into` (an absolute or
    `..` name, a link whose target leaves the tree, a device file), else None. Checked before
    anything is extracted: a pull request's commit is the attacker's."""
    root = into.resolve()
    where = (root / member.name).resolve()
    if not where.is_relative_to(root):
        return f"{member.name} lies outside the tree"
    if member.issym() or member.islnk():
        target = ((where.parent if member.issym() else root) / member.linkname).resolve()
        if member.linkname.startswith("/") or not target.is_relative_to(root):
            return f"{member.name} is a link to {member.linkname}, outside the tree"
    if member.isdev():
        return f"{member.name} is a device file"
    return None


def _export_commit(repo: Path, commit: str, into: Path) -> str:
    """Writes the packed folders of `commit` of the git repository `repo` into `into` (git
    archive: exactly what is committed) and returns the commit's 12-digit id."""
    try:
        rev = _git(repo, "rev-parse", "--verify", "--short=12", f"{commit}^{{commit}}", timeout=30)
        if rev.returncode != 0:
            common.fail(f"{commit!r} is not a commit of {repo}: {rev.stderr.decode().strip() or 'git rev-parse failed'}")
        into.mkdir(parents=True)
        archive = _git(repo, "archive", "--format=tar", rev.stdout.decode().strip(), "--", *PACKAGES, timeout=300)
        if archive.returncode != 0:
            common.fail(f"cannot export {commit} of {repo}: {archive.stderr.decode().strip()}")
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            members = tar.getmembers()
            for member in members:
                why = _outside(into, member)
                if why:
                    common.fail(f"commit {commit} of {repo}: {why}; a build holds only the files inside it")
            # Python's own extraction filter as well where it has one (3.11.4+; Debian 12 has 3.11.2)
            tar.extractall(into, members, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    except (OSError, subprocess.TimeoutExpired) as exc:
        common.fail(f"cannot export {commit} of {repo}: {exc}")
    missing = [pkg for pkg in PACKAGES if not (into / pkg).is_dir()]
    if missing:
        common.fail(f"commit {commit} of {repo} has no {', '.join(f'{m}/' for m in missing)}: not a commit of this project")
    return rev.stdout.decode().strip()


def _label_option(value: str | None) -> str | None:
    """--label checked where it enters (a usage error naming what a label may be)."""
    from orchestrator.store import StoreError
    from orchestrator.store.builds import check_label

    if value is None:
        return None
    try:
        return check_label(value)
    except StoreError as exc:
        raise typer.BadParameter(str(exc)) from None


def _default_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("devicefarm")
    except PackageNotFoundError:
        return "0.0.0"


def build_dict(build: Build, files: bool = False) -> dict[str, Any]:
    data: dict[str, Any] = {
        "id": build.id,
        "name": build.name,
        "label": build.label,
        "version": build.version,
        "source_revision": build.source_revision,
        "manifest_sha256": build.manifest_sha256,
        "created": common.iso(build.created),
        "file_count": len(build.files),
        "bytes": sum(f.size for f in build.files),
    }
    if files:
        data["files"] = [{"path": f.path, "sha256": f.sha256, "size": f.size, "mode": f.mode} for f in build.files]
    return data


@app.command()
def create(
    # --model and --profiles are checked by make_build, which `farm demo` calls too.
    model: Path = typer.Option(..., "--model", help="diffusers-layout model folder (shipped as models/<name>)."),
    profiles: Path = typer.Option(None, "--profiles", help="Folder of extra kernel profiles (shipped as "
                                  "profiles/; engine/profiles always ship)."),
    version: str = typer.Option(None, "--version", help="Build version (default: the package version).",
                                callback=validate.build_version),
    name: str = typer.Option(None, "--name", help="Build id (default: <model>-<version>-<UTC time>).",
                             callback=validate.build_name),
    default_profile: str = typer.Option(None, "--default-profile", help="Kernel profile the build's jobs use "
                                        "unless they name one: reference, a shipped profile (nvidia, adreno, ...) "
                                        "or profiles/<file> from --profiles. Default: auto (chosen per GPU)."),
    tuned: bool = typer.Option(True, "--tuned/--no-tuned", help="Ship the promoted tuned profiles (`farm "
                               "profiles promote`) as profiles/tuned/: auto picks the one made on a device's "
                               "exact GPU over its family's."),
    source: Path = typer.Option(None, "--source", help="A checkout of this project whose engine/, shaders/ and "
                                "agent/ the build ships as they are on disk (a pull request's working tree); "
                                "with --commit, the git repository to take the commit from. Default: the "
                                "farm's own checkout."),
    commit: str = typer.Option(None, "--commit", help="Ship engine/, shaders/ and agent/ exactly as this commit "
                               "(any git revision) of --source has them, not the files on disk."),
    label: str = typer.Option(None, "--label", help="A short name for tables, charts and commands (1-32 letters, "
                              "digits and . _ + -, not all digits, unique): A, rc1.", callback=_label_option),
):
    """Pack, sign and register a build bundle."""
    data = make_build(common.cli_settings(), model, profiles, version, name, default_profile=default_profile, tuned=tuned,
                      source=source, commit=commit, label=label)
    labelled = f" labelled [bold]{escape(data['label'])}[/]" if data["label"] else ""
    console.print(f"created build [bold]{data['name']}[/]{labelled} ({data['file_count']} files, "
                  f"{data['bytes'] / 1e6:.1f} MB, "
                  f"manifest {data['manifest_sha256'][:12]}) in {data['bundle']}", highlight=False, soft_wrap=True)
    if data["tuned_profiles"]:
        console.print(f"tuned profiles shipped: {', '.join(data['tuned_profiles'])}", highlight=False)


def make_build(settings, model: Path, profiles: Path | None = None, version: str | None = None,
               name: str | None = None, *, default_profile: str | None = None, tuned: bool = True,
               source: Path | None = None, commit: str | None = None, label: str | None = None) -> dict[str, Any]:
    """Pack the engine, shaders and agent of `source` (a checkout of this project; default the
    farm's own), or of its `commit`, with `model` into a signed bundle under
    <data_dir>/builds/<name> and record it with the revision it came from; returns the build's
    listing (plus `bundle`, its folder, and `tuned_profiles`, the promoted profiles it ships
    when `tuned`), labelled `label` when given. Nothing is left behind when it fails (one red
    line and exit 1)."""
    from agent.bundle import BundleError
    from agent.jobs import DEFAULT_PROFILE_FILE, TUNED_PROFILES_DIR
    from agent.packing import build_bundle
    from orchestrator import store
    from orchestrator.analysis import profiles as registry
    from orchestrator.infra.inputs import BadInput, check_build_name

    model = model.expanduser()
    if not (model / "model_index.json").is_file() and not (model / "unet").is_dir():
        common.fail(f"{model}: not a diffusers model folder (no model_index.json or unet/)")
    if profiles is not None and not profiles.expanduser().is_dir():
        common.fail(f"{profiles}: profiles folder not found")
    if default_profile is not None:
        choices = default_profile_choices(profiles)
        if default_profile not in choices:
            common.fail(f"unknown default profile {default_profile!r}; choose from {', '.join(choices)}")
    version = version or _default_version()
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    name = name or f"{model.resolve().name}-{version}-{stamp}"
    try:
        check_build_name(name)
    except BadInput as exc:  # a default name from a model folder called, say, "my model"
        common.fail(f"{exc}; give one with --name")
    builds_dir = settings.data_dir / "builds"
    final = builds_dir / name
    with common.open_store(settings) as sessions:
        if final.exists():
            common.fail(f"{final}: a build named {name!r} already exists; give another --name or --version")
        if label is not None:  # refused before the packing, not after it
            with sessions() as session:
                common.get_or_fail(store.check_label_free, session, label)
        # Packed under a temporary name and renamed when complete, so a failure leaves nothing.
        staging = builds_dir / f".tmp-{name}-{uuid.uuid4().hex[:8]}"
        profiles_dir = builds_dir / f".tmp-{name}-profiles-{uuid.uuid4().hex[:8]}"
        exported = builds_dir / f".tmp-{name}-source-{uuid.uuid4().hex[:8]}"
        shipped_tuned: list[str] = []
        try:
            if commit is not None:
                revision = _export_commit(_checkout_tree(source) if source is not None else REPO, commit, exported)
                tree = exported
            else:
                tree = _checkout_tree(source) if source is not None else REPO
                revision = _source_revision(tree)
        except BaseException:
            shutil.rmtree(exported, ignore_errors=True)
            raise
        sources = {pkg: tree / pkg for pkg in PACKAGES}
        sources[f"models/{model.resolve().name}"] = model
        # Links are packed as what they point to only inside these folders (agent.bundle): the
        # checkout's packages may link to each other, a model to its own files.
        link_roots = {pkg: tree for pkg in PACKAGES} | {f"models/{model.resolve().name}": model_link_root(model)}
        if tuned:
            with sessions() as session:
                shipped_tuned = registry.write_promoted(
                    session, profiles_dir / TUNED_PROFILES_DIR.removeprefix("profiles/"))
        if profiles is not None or default_profile is not None or shipped_tuned:
            profiles_dir.mkdir(parents=True, exist_ok=True)
            if profiles is not None:
                # links stay links, so that build_bundle refuses those leaving the folder
                shutil.copytree(profiles.expanduser(), profiles_dir, dirs_exist_ok=True, symlinks=True)
            if default_profile is not None:
                (profiles_dir / DEFAULT_PROFILE_FILE.split("/")[-1]).write_text(default_profile + "\n")
            sources["profiles"] = profiles_dir
        try:
            key = farm_key(settings.config_dir)
            with console.status(f"packing build {name}"):
                manifest = build_bundle(sources, staging, name, version, key, source_revision=revision,
                                        exclude=BUILD_EXCLUDE, link_roots=link_roots)
            with sessions() as session:
                build = store.create_build(session, manifest, label)
                staging.rename(final)
                try:
                    session.commit()
                except Exception:
                    shutil.rmtree(final, ignore_errors=True)
                    raise
                data = build_dict(build)
        except (BundleError, store.StoreError, OSError) as exc:
            common.fail(str(exc))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            shutil.rmtree(profiles_dir, ignore_errors=True)
            shutil.rmtree(exported, ignore_errors=True)
    return data | {"bundle": str(final), "tuned_profiles": shipped_tuned}


def model_link_root(model: Path) -> Path:
    """The folder a model's links may point into: a Hugging Face snapshot
    (<cache>/models--org--name/snapshots/<revision>) links each file into its repository's
    blobs/, so its repository folder; any other model folder, itself."""
    real = model.expanduser().resolve()
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        return real.parent.parent
    return real


def default_profile_choices(profiles: Path | None) -> list[str]:
    """What --default-profile accepts: the engine's shipped profiles and reference, and the
    JSON files of the --profiles folder (as profiles/<file>)."""
    shipped = sorted(p.stem for p in (REPO / "engine" / "profiles").glob("*.json"))
    extra = sorted(f"profiles/{p.name}" for p in profiles.expanduser().glob("*.json")) if profiles else []
    return ["auto", "reference", *shipped, *extra]


@app.command("list")
def list_builds(as_json: bool = common.JSON_OPTION):
    """List the builds, newest first, with the ids and labels that name them."""
    from orchestrator import store
    from orchestrator.store import queries

    with common.open_store(common.cli_settings()) as sessions, sessions() as session:
        builds = queries.list_builds(session)
        shown = store.build_display_names(session, [b.name for b in builds])
        rows = [build_dict(b) | {"display": shown[b.name]} for b in builds]
    if common.print_json_or_empty(rows, as_json, "no builds; create one with `farm builds create --model DIR`"):
        return
    table = Table("id", "label", "name", "version", "files", "MB", "created", "revision",
                  drop_first=("revision", "files", "MB", "version"))
    for r in rows:
        table.add_row(str(r["id"]), r["label"] or "-", r["name"], r["version"], str(r["file_count"]),
                      f"{r['bytes'] / 1e6:.1f}", r["created"][:19].replace("T", " "), r["source_revision"] or "-")
    console.print(table)


@app.command()
def show(name: str = typer.Argument(..., help="Build id, label or name.", autocompletion=completion.builds),
         as_json: bool = common.JSON_OPTION):
    """Show one build and its files."""
    from orchestrator import store

    with common.open_store(common.cli_settings()) as sessions, sessions() as session:
        data = build_dict(common.get_or_fail(store.get_build, session, name), files=True)
    if as_json:
        common.print_json(data)
        return
    for key in ("id", "label", "name", "version", "source_revision", "manifest_sha256", "created"):
        console.print(f"{key}: {data[key] or '-'}", highlight=False)
    console.print(f"bundle: {common.cli_settings().data_dir / 'builds' / data['name']}", highlight=False,
                  soft_wrap=True)
    table = Table("path", "bytes", "sha256")
    for f in data["files"]:
        table.add_row(f["path"], f"{f['size']:,}", f["sha256"][:12])
    console.print(table)


@app.command("label")
def label_command(
    build: str = typer.Argument(..., help="Build id, label or name.", autocompletion=completion.builds),
    label: str = typer.Argument(None, help="Its new label (1-32 letters, digits and . _ + -, not all digits, "
                                "unique); leave it out with --clear.", callback=_label_option),
    clear: bool = typer.Option(False, "--clear", help="Take the build's label away."),
):
    """Give a build a short label (or take it away with --clear)."""
    from orchestrator import store

    if (label is None) == (not clear):
        common.fail("give a LABEL, or --clear to take the label away (not both)")
    with common.open_store(common.cli_settings()) as sessions, sessions() as session:
        row = common.get_or_fail(store.get_build, session, build)
        common.get_or_fail(lambda s, value: store.label_build(s, row, value), session, label)
        session.commit()
        name = row.name
    console.print(f"build {escape(name)} " + (f"is now labelled [bold]{escape(label)}[/]" if label else
                                              "has no label now"), highlight=False)
