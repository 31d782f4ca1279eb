"""Kernel-selection profiles: data that says, per GPU family, which variant each op uses on
which shapes. A profile is a versioned JSON document:

    {"schema": "devicefarm.profile/1", "name": "adreno", "priority": 10,
     "match": [{"vendor_id": [20803]}, {"vendor": ["qualcomm"]}],
     "rules": [{"op": "attention", "when": {"dh": 40}, "variant": "flash"}, ...],
     "measurements": [...]}                       # written by `farm engine tune`

`match` is one set of conditions or a list of alternatives (the profile matches an adapter
when any of them holds: a native driver names its vendor by PCI id, a browser by name, as
"qualcomm"/"adreno-7xx", "arm"/"valhall", "apple"). Fields of a set (all optional, all must
hold): vendor, architecture, backend, adapter_type (lists of accepted values,
case-insensitive), vendor_id (list of ints), device (a regular expression searched in the
adapter's device name). Rules are tried in order, the first whose
`when` holds for the call's shape wins; `when` maps a shape field to a value or to
{"min": a, "max": b}, and may name the element type the call runs in ("dtype": "f32", "f16" or
"f16s"; `farm engine tune` writes none, so its rules hold for f16 and f16-storage alike). Ops no
rule covers use their reference variant.

The shipped profiles live beside this file; `auto` picks the matching one of highest
priority, except that a GPU with no profile tuned for it gets one tuned for another GPU of its
architecture (an H200 the H100's) over its family's: `architecture`, written by `farm engine
tune`, names the one a tuned profile was measured on (gpu_architecture). The built-in
`reference` profile has no rules (every reference kernel).
"""

from __future__ import annotations

import hashlib
import json
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from .. import ops as _ops  # noqa: F401  (registers every variant a profile may name)
from ..errors import EngineError
from ..kernels import REGISTRY, SHADER_HEADERS, Rule, Selection

SCHEMA_ID = "devicefarm.profile/1"
PROFILE_DIR = Path(__file__).resolve().parent
MATCH_LISTS = ("vendor", "architecture", "backend", "adapter_type")
SHAPE_FIELDS = {
    "linear": ("m", "n", "k"),
    "conv2d": ("cin", "cout", "h", "w", "k", "stride", "b", "tiles"),
    "group_norm": ("c", "s", "groups", "b"),
    "activation": ("kind", "n"),
    "geglu": ("m", "f"),
    "attention": ("tq", "tk", "dh", "heads", "b", "causal"),
    "layer_norm": ("rows", "d"),
    "linear_nchw": ("b", "t", "n", "k"),  # a transformer's proj_out written channel-major (Ops.linear_to_channels)
}


# what a rule's "dtype" condition may name: the element types a kernel is specialised for
DTYPES = tuple(SHADER_HEADERS)


class ProfileError(EngineError):
    """A profile document is invalid; the message names the file, the field and the choices."""


@dataclass
class Profile:
    name: str
    rules: list[Rule]
    match: dict | list = field(default_factory=dict)  # one set of conditions, or alternatives
    priority: int = 0
    description: str = ""
    measurements: list = field(default_factory=list)
    source: str = "<built-in>"
    architecture: str = ""  # a tuned profile's: the architecture of the GPU it was measured on

    def matches(self, caps) -> bool:
        return any(_holds(m, caps) for m in _alternatives(self.match))

    def kin_of(self, caps) -> bool:
        """Whether this profile was tuned on another GPU of `caps`' vendor and architecture: it
        matches `caps` once its device name condition is dropped, and its architecture is theirs."""
        return bool(self.measurements and self.architecture and self.architecture == gpu_architecture(caps)
                    and any(_holds({k: v for k, v in m.items() if k != "device"}, caps)
                            for m in _alternatives(self.match)))

    def selection(self, caps) -> Selection:
        return Selection(frozenset(caps.features), list(self.rules), profile_name=self.name)

    def to_json(self) -> dict:
        return {
            "schema": SCHEMA_ID,
            "name": self.name,
            "description": self.description,
            "priority": self.priority,
            "match": self.match,
            **({"architecture": self.architecture} if self.architecture else {}),
            "rules": [
                {
                    "op": r.op,
                    "variant": r.variant,
                    **({"when": {k: _cond_json(v) for k, v in r.when}} if r.when else {}),
                    **({"constants": dict(r.constants)} if r.constants else {}),
                    **({"why": r.why} if r.why else {}),
                }
                for r in self.rules
            ],
            "measurements": self.measurements,
        }


def _cond_json(cond):
    if not isinstance(cond, tuple):
        return cond
    return {k: v for k, v in zip(("min", "max"), cond, strict=True) if v is not None}


def _alternatives(match: dict | list) -> list[dict]:
    return match if isinstance(match, list) else [match]


def _holds(m: dict, caps) -> bool:
    """Whether every condition of one set holds for `caps`."""
    for key in MATCH_LISTS:
        if key in m and str(getattr(caps, key)).lower() not in [str(v).lower() for v in m[key]]:
            return False
    if "vendor_id" in m and caps.vendor_id not in m["vendor_id"]:
        return False
    return not ("device" in m and not re.search(m["device"], caps.device))


REFERENCE = Profile("reference", [], description="every op's reference variant: the baseline")


def _fail(source: str, where: str, msg: str):
    raise ProfileError(f"profile {source}: {where}: {msg}")


def _rule(source: str, i: int, r) -> Rule:
    where = f"rules[{i}]"
    if not isinstance(r, dict):
        _fail(source, where, "must be an object with op, variant, and optional when/constants")
    unknown = set(r) - {"op", "variant", "when", "constants", "why"}
    if unknown:
        _fail(source, where, f"unknown key(s) {sorted(unknown)}; allowed: op, variant, when, constants, why")
    op = r.get("op")
    if op not in SHAPE_FIELDS:
        _fail(source, f"{where}.op", f"{op!r} is not an op with variants; choose one of {', '.join(SHAPE_FIELDS)}")
    table = REGISTRY.get(op, {})
    variant = r.get("variant")
    if variant not in table:
        _fail(source, f"{where}.variant", f"{variant!r} is not a variant of {op}; choose one of {', '.join(sorted(table))}")
    when = r.get("when", {})
    if not isinstance(when, dict):
        _fail(source, f"{where}.when", "must be an object mapping shape fields to values or {min, max}")
    conds = []
    for key, cond in when.items():
        if key == "dtype":  # the element type the call runs in, not a shape field
            if cond not in DTYPES:
                _fail(source, f"{where}.when.dtype", f"{cond!r} is not an element type; choose from {', '.join(DTYPES)}")
            conds.append((key, cond))
            continue
        if key not in SHAPE_FIELDS[op]:
            _fail(source, f"{where}.when.{key}", f"not a shape field of {op}; choose from "
                  f"{', '.join(SHAPE_FIELDS[op])} (or dtype)")
        if isinstance(cond, dict):
            bad = set(cond) - {"min", "max"}
            if bad or not cond or not all(isinstance(v, int) for v in cond.values()):
                _fail(source, f"{where}.when.{key}", "a range is {\"min\": int, \"max\": int} (either may be omitted)")
            conds.append((key, (cond.get("min"), cond.get("max"))))
        elif isinstance(cond, int | str):
            conds.append((key, cond))
        else:
            _fail(source, f"{where}.when.{key}", f"{cond!r} is neither a value nor a range")
    if not isinstance(r.get("why", ""), str):
        _fail(source, f"{where}.why", "must be a string")
    consts = r.get("constants", {})
    allowed = table[variant].constants
    for name, value in consts.items():
        if name not in allowed:
            _fail(source, f"{where}.constants.{name}", f"not a constant of {op}/{variant}; choose from {', '.join(allowed) or 'none'}")
        if value not in allowed[name]:
            _fail(source, f"{where}.constants.{name}", f"{value!r} out of range; allowed: {list(allowed[name])}")
    return Rule(op, variant, tuple(conds), tuple(sorted(consts.items())), r.get("why", ""))


def parse_profile(doc, source: str = "<dict>") -> Profile:
    """Validate a profile document and build a Profile; errors name the field and the choices."""
    if not isinstance(doc, dict):
        raise ProfileError(f"profile {source}: must be a JSON object")
    if doc.get("schema") != SCHEMA_ID:
        _fail(source, "schema", f"{doc.get('schema')!r} is not supported; expected {SCHEMA_ID!r}")
    unknown = set(doc) - {"schema", "name", "description", "priority", "match", "rules", "measurements",
                          "architecture"}
    if unknown:
        _fail(source, "top level", f"unknown key(s) {sorted(unknown)}")
    name = doc.get("name")
    if not isinstance(name, str) or not name:
        _fail(source, "name", "a non-empty string is required")
    match = doc.get("match", {})
    if isinstance(match, list) and not match:
        _fail(source, "match", "a list of alternatives needs at least one")
    for i, alternative in enumerate(_alternatives(match)):
        _check_match(source, "match" if isinstance(match, dict) else f"match[{i}]", alternative)
    rules = doc.get("rules", [])
    if not isinstance(rules, list):
        _fail(source, "rules", "must be a list")
    priority = doc.get("priority", 0)
    if not isinstance(priority, int):
        _fail(source, "priority", "must be an integer")
    architecture = doc.get("architecture", "")
    if not isinstance(architecture, str):
        _fail(source, "architecture", "must be a string (the architecture of the GPU it was tuned on)")
    return Profile(
        name=name,
        rules=[_rule(source, i, r) for i, r in enumerate(rules)],
        match=match,
        priority=priority,
        description=str(doc.get("description", "")),
        measurements=list(doc.get("measurements", [])),
        source=source,
        architecture=architecture.lower(),
    )


def load_profile_file(path: Path) -> Profile:
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ProfileError(f"profile {path} cannot be read: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ProfileError(f"profile {path} is not valid JSON: {exc}") from exc
    return parse_profile(doc, str(path))


def shipped_profiles() -> list[Profile]:
    return [load_profile_file(p) for p in sorted(PROFILE_DIR.glob("*.json")) if p.name != "schema.json"]


def _check_match(source: str, where: str, match) -> None:
    if not isinstance(match, dict) or set(match) - {*MATCH_LISTS, "vendor_id", "device"}:
        _fail(source, where, f"an object (or a list of them) whose keys are among "
                             f"{', '.join((*MATCH_LISTS, 'vendor_id', 'device'))}")
    for key in MATCH_LISTS:
        if key in match and not (isinstance(match[key], list) and all(isinstance(v, str) for v in match[key])):
            _fail(source, f"{where}.{key}", "must be a list of strings")
    if "vendor_id" in match and not (isinstance(match["vendor_id"], list)
                                     and all(isinstance(v, int) for v in match["vendor_id"])):
        _fail(source, f"{where}.vendor_id", "must be a list of integers")
    if "device" in match:
        try:
            re.compile(match["device"])
        except (re.error, TypeError) as exc:
            _fail(source, f"{where}.device", f"not a regular expression: {exc}")


# The architecture of a GPU whose driver names none (native drivers: Vulkan, D3D12, Metal report
# a device name and PCI ids; browsers report an architecture themselves, in Dawn's gpu_info
# names), from its device name, per PCI vendor id. Data-center and workstation names as well
# as GeForce/Radeon ones; a name no pattern knows has no architecture (its family's profile).
ARCHITECTURES: dict[int, list[tuple[str, str]]] = {
    0x10DE: [  # NVIDIA
        (r"\b(GB\d{3}|B\d{3}|RTX 50\d0|RTX PRO \d+ Blackwell)\b", "blackwell"),
        (r"\b(GH\d{3}|H\d{3}|H20)\b", "hopper"),
        (r"\b(L4|L40S?|L20|RTX 40\d0|RTX \d+ Ada)\b", "lovelace"),
        (r"\b(A\d{1,3}G?|RTX A\d{4}|RTX 30\d0)\b", "ampere"),
        (r"\b(T4|RTX 20\d0|GTX 16\d0|Quadro RTX \d+)\b", "turing"),
        (r"\b(V100|TITAN V)\b", "volta"),
    ],
    0x1002: [  # AMD
        (r"\bMI3\d{2}", "cdna-3"),
        (r"\bMI2\d{2}", "cdna-2"),
        (r"\bRX 9\d{3}", "rdna-4"),
        (r"\bRX 7\d{3}", "rdna-3"),
        (r"\bRX 6\d{3}", "rdna-2"),
    ],
    0x8086: [  # Intel
        (r"\bArc\b.*\bB\d{3}", "xe2"),
        (r"\bArc\b.*\bA\d{3}", "xe-hpg"),
    ],
}


def gpu_architecture(caps) -> str:
    """The adapter's architecture as a lower-case name: what its driver or browser reports,
    else what ARCHITECTURES says of its device name; "" when neither knows."""
    if caps.architecture:
        return caps.architecture.lower()
    for pattern, name in ARCHITECTURES.get(caps.vendor_id, ()):
        if re.search(pattern, caps.device):
            return name
    return ""


def auto_profile(caps, tuned: bool = True, extra: list[Profile] | tuple = ()) -> Profile:
    """The profile that matches the adapter, highest priority first, among the shipped ones
    and `extra` (a build's tuned profiles, which win a tie); else reference. A profile tuned
    on one exact GPU (priority 100) beats its family's. A GPU with none of its own gets one
    tuned on another GPU of its vendor and architecture (Profile.kin_of; the highest priority,
    then a build's, then by name) over its family's: on an H200 the H100's profile ran SD 1.4's
    UNet step in 58.6 ms where the family's took 67.9 (as issue 42 reports it; no run of the
    H200 is in docs/benchmarks.md yet). tuned=False skips
    profiles measured for one exact GPU (to get the family's profile)."""
    candidates = [(p, 0) for p in shipped_profiles()] + [(p, 1) for p in extra]
    matching = [(p, rank) for p, rank in candidates if p.matches(caps) and (tuned or not p.measurements)]
    best = max(matching, key=lambda pr: (pr[0].priority, pr[1]))[0] if matching else REFERENCE
    if tuned and not best.measurements:
        kin = [(p, rank) for p, rank in candidates if p.kin_of(caps) and p.priority >= best.priority]
        if kin:
            return max(kin, key=lambda pr: (pr[0].priority, pr[1], pr[0].name))[0]
    return best


def profile_sha256(doc: dict) -> str:
    """A profile document's identity: the SHA-256 of its canonical JSON (sorted keys, no
    whitespace), so the same document hashes the same wherever it was written."""
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def resolve_profile(spec, caps) -> Profile:
    """None/"auto", "family" (auto without profiles tuned for one exact GPU), "reference", a
    shipped profile's name, a path, or a document dict."""
    if spec is None or spec == "auto":
        return auto_profile(caps)
    if spec == "family":
        return auto_profile(caps, tuned=False)
    if isinstance(spec, Profile):
        profile = spec
    elif isinstance(spec, dict):
        profile = parse_profile(spec)
    elif spec == "reference":
        return REFERENCE
    else:
        by_name = {p.name: p for p in shipped_profiles()}
        if str(spec) in by_name:
            return by_name[str(spec)]
        path = Path(spec)
        if not path.is_file():
            raise ProfileError(
                f"profile {spec!r} is neither a file nor a shipped profile; shipped: "
                f"{', '.join(['auto', 'family', 'reference', *sorted(by_name)])}"
            )
        profile = load_profile_file(path)
    if profile.match and not profile.matches(caps):
        warnings.warn(
            f"profile {profile.name!r} was written for {profile.match}, not for {caps.device!r}; using it anyway",
            stacklevel=2,
        )
    return profile
