"""`farm profiles ...`: the kernel profiles tune jobs made, per GPU (orchestrator/analysis/profiles.py).
A profile's gain is "estimated" (from its tune's kernel times) until a latency run of it and
of its GPU family's profile measured it; promoting one ships it in the builds made after."""

from __future__ import annotations

import json
from typing import Any

import typer

from .common import JSON_OPTION, cli_settings, fail, iso, open_store, print_json
from .output import Table, console

app = typer.Typer(help="Kernel profiles tuned per GPU: list, show, promote, diff.", no_args_is_help=True)


def profile_dict(profile, *, full: bool = False) -> dict[str, Any]:
    run = profile.tune_run_id
    data = {
        "id": profile.id, "name": profile.name, "sha256": profile.sha256,
        "gpu": {"vendor": profile.gpu_vendor, "architecture": profile.gpu_architecture,
                "device": profile.gpu_device, "backend": profile.gpu_backend, "driver": profile.gpu_driver},
        "engine_version": profile.engine_version,
        "tuned_on": profile.tuned_on.serial if profile.tuned_on is not None else None,
        "tune_run": run, "family": profile.family,
        "estimated_gain": profile.estimated_gain,
        "measured_gain": profile.measured_gain,
        "measured_gain_ci": profile.measured_gain_ci,
        "measured_in_batch": profile.measured_in_batch_id,
        "promoted_at": iso(profile.promoted_at),
        "created": iso(profile.created),
        "rules": len((profile.data or {}).get("rules", [])),
    }
    if full:
        data["document"] = profile.data
    return data


def gain_text(data: dict[str, Any]) -> str:
    """The measured gain with its interval, else the estimate, called one."""
    if data["measured_gain"] is not None:
        low, high = data["measured_gain_ci"] or (None, None)
        ci = f" (95% CI {low:.2f}-{high:.2f})" if low is not None else ""
        return f"{data['measured_gain']:.2f}x measured{ci}"
    if data["estimated_gain"] is not None:
        return f"{data['estimated_gain']:.2f}x estimated from kernel times; not measured"
    return "not measured"


def _get(session, ref: str):
    from orchestrator.analysis import profiles

    try:
        return profiles.get(session, ref)
    except profiles.ProfileError as exc:
        fail(str(exc))


@app.command("list")
def list_profiles(
    device: str = typer.Option(None, "--device", help="Only profiles tuned on this device's GPU."),
    as_json: bool = JSON_OPTION,
):
    """List the tuned profiles, newest first."""
    from orchestrator import store

    settings = cli_settings()
    with open_store(settings) as sessions, sessions() as session:
        try:
            on = store.get_device(session, device) if device is not None else None
        except store.StoreError as exc:
            fail(str(exc))
        rows = [profile_dict(p) for p in store.profiles_for(session, on)]
    if as_json:
        print_json(rows)
        return
    if not rows:
        console.print("no tuned profiles yet: `farm jobs submit tune --device SERIAL` makes one")
        return
    table = Table("id", "name", "GPU", "driver", "engine", "sha256", "tuned on", "gain vs family", "promoted")
    for r in rows:
        table.add_row(str(r["id"]), r["name"], f"{r['gpu']['device']} ({r['gpu']['backend']})", r["gpu"]["driver"] or "-",
                      r["engine_version"] or "-", r["sha256"][:12], r["tuned_on"] or "-", gain_text(r),
                      (r["promoted_at"] or "")[:16].replace("T", " ") or "-")
    console.print(table)


@app.command()
def show(ref: str = typer.Argument(..., help="Profile id or name."), as_json: bool = JSON_OPTION):
    """A profile: where it was tuned, its gain, its rules."""
    settings = cli_settings()
    with open_store(settings) as sessions, sessions() as session:
        data = profile_dict(_get(session, ref), full=True)
    if as_json:
        print_json(data)
        return
    gpu = data["gpu"]
    console.print(f"[bold]{data['name']}[/] (id {data['id']}, sha256 {data['sha256']})", highlight=False)
    for label, value in [("GPU", f"{gpu['vendor']} {gpu['device']} ({gpu['architecture'] or '-'}, {gpu['backend']})"),
                         ("driver", gpu["driver"] or "-"), ("engine", data["engine_version"] or "-"),
                         ("tuned on", f"{data['tuned_on'] or '-'} (run {data['tune_run'] or '-'})"),
                         ("against", data["family"] or "-"), ("gain", gain_text(data)),
                         ("promoted", data["promoted_at"] or "no")]:
        console.print(f"  {label:9} {value}", highlight=False, soft_wrap=True)
    table = Table("op", "when", "variant", "constants", title=f"{data['rules']} rules")
    for rule in data["document"].get("rules", []):
        table.add_row(rule["op"], json.dumps(rule.get("when", {})), rule["variant"],
                      json.dumps(rule.get("constants", {})) if rule.get("constants") else "-")
    console.print(table)


@app.command()
def promote(
    ref: str = typer.Argument(..., help="Profile id or name."),
    force: bool = typer.Option(False, "--force", help="Promote a profile whose gain was not measured, or "
                               "that measured slower than its family's."),
):
    """Ship a profile in the builds made from now on (replacing the one promoted for its GPU)."""
    from orchestrator.analysis import profiles

    settings = cli_settings()
    with open_store(settings) as sessions, sessions() as session:
        profile = _get(session, ref)
        if not force:
            if profile.measured_gain is None:
                fail(f"profile {profile.name} (id {profile.id}) was never measured on its GPU (its gain is "
                     f"{'an estimate' if profile.estimated_gain is not None else 'unknown'}); time it with a "
                     "latency job of profile tuned and one of profile family, or pass --force")
            low, high = profile.measured_gain_ci or (None, None)
            if high is not None and high < 1:
                fail(f"profile {profile.name} (id {profile.id}) measured slower than {profile.family or 'its family'} "
                     f"({profile.measured_gain:.2f}x, 95% CI {low:.2f}-{high:.2f}); pass --force to ship it anyway")
        replaced = profiles.promote(session, profile)
        session.commit()
        name, pid, device = profile.name, profile.id, profile.gpu_device
        gone = ", ".join(f"{p.name} (id {p.id})" for p in replaced)
    console.print(f"promoted {name} (id {pid}) for {device}: the builds made from now on ship it"
                  + (f"; it replaces {gone}" if gone else ""), highlight=False, soft_wrap=True)


def rule_key(rule: dict) -> tuple[str, str]:
    return rule["op"], json.dumps(rule.get("when", {}), sort_keys=True)


def rule_diff(a: dict, b: dict) -> list[dict[str, Any]]:
    """What differs between two profile documents, rule by rule (keyed by op and `when`)."""
    rules_a = {rule_key(r): r for r in a.get("rules", [])}
    rules_b = {rule_key(r): r for r in b.get("rules", [])}
    out = []
    for key in sorted(set(rules_a) | set(rules_b)):
        ra, rb = rules_a.get(key), rules_b.get(key)
        pick_a = (ra["variant"], ra.get("constants", {})) if ra else None
        pick_b = (rb["variant"], rb.get("constants", {})) if rb else None
        if pick_a != pick_b:
            out.append({"op": key[0], "when": json.loads(key[1]),
                        "a": {"variant": pick_a[0], "constants": pick_a[1]} if pick_a else None,
                        "b": {"variant": pick_b[0], "constants": pick_b[1]} if pick_b else None})
    return out


@app.command()
def diff(
    a: str = typer.Argument(..., help="Profile id or name."),
    b: str = typer.Argument(..., help="Profile id or name."),
    as_json: bool = JSON_OPTION,
):
    """Rule by rule, what two profiles choose differently."""
    settings = cli_settings()
    with open_store(settings) as sessions, sessions() as session:
        pa, pb = _get(session, a), _get(session, b)
        da, db = profile_dict(pa), profile_dict(pb)
        changes = rule_diff(pa.data or {}, pb.data or {})
    if as_json:
        print_json({"a": da, "b": db, "changes": changes})
        return

    def pick(side):
        if side is None:
            return "- (reference)"
        consts = ", ".join(f"{k}={v}" for k, v in sorted(side["constants"].items()))
        return side["variant"] + (f" [{consts}]" if consts else "")

    console.print(f"A: {da['name']} (id {da['id']}, {da['gpu']['device']}, {gain_text(da)})", highlight=False,
                  soft_wrap=True, markup=False)
    console.print(f"B: {db['name']} (id {db['id']}, {db['gpu']['device']}, {gain_text(db)})", highlight=False,
                  soft_wrap=True, markup=False)
    if not changes:
        console.print("the two profiles choose the same kernels")
        return
    table = Table("op", "when", "A", "B", title=f"{len(changes)} rules differ")
    for c in changes:
        table.add_row(c["op"], json.dumps(c["when"]), pick(c["a"]), pick(c["b"]))
    console.print(table)
