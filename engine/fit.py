"""Whether an engine plan fits an adapter, read from the plan alone, before anything is
allocated: the GPU bytes its executors allocate, the largest buffer and the largest range one
dispatch binds, and, from each pipeline's WGSL with its override constants, the workgroup
storage and the invocations per workgroup of its entry point. Each is checked against the
adapter's limits and a memory budget; `reasons` says what does not fit and by how much.

The executors hold a plan's weights in one of two ways (its `residency`), and the peak is
that of the way they will choose:
- resident: every weight from load to the end, with the plan's other buffers (activations,
  state, constants) and uniforms; chosen when that fits the budget or there is none;
- staged: what a stage owns (the weights and scratch buffers no other stage uses) only while it
  runs (allocated and uploaded before it, released when another stage runs), so the peak is
  the plan's other buffers plus the heaviest stage's own; chosen when only that fits.
"""

from __future__ import annotations

import ast
import base64
import operator
import re
from dataclasses import asdict, dataclass, field
from functools import cache

from .errors import InputError
from .kernels import SHADER_ROOT

LIMITS = {  # what a plan needs -> the adapter's limit (engine.device names)
    "max_binding_bytes": "max-storage-buffer-binding-size",
    "max_buffer_bytes": "max-buffer-size",
    "max_workgroup_storage_bytes": "max-compute-workgroup-storage-size",
    "max_invocations_per_workgroup": "max-compute-invocations-per-workgroup",
}


RESIDENCIES = ("resident", "staged")


SCOPED_KINDS = ("weight", "activation")  # what a stage may own (constants and state live throughout)


@dataclass(frozen=True)
class PlanMemory:
    """What a plan's executor allocates. A weight or activation buffer that only one stage's
    commands use (its dispatches, copies and writes, and the stage's own inputs and outputs) is
    that stage's; every other buffer, and the uniforms, the plan's."""

    buffer_bytes: int  # every buffer and uniform
    persistent: tuple[int, ...]  # ids of the buffers no one stage owns
    persistent_bytes: int  # theirs, and the uniforms
    stage_buffers: dict[str, tuple[int, ...]]  # stage -> ids of the buffers it owns
    stage_bytes: dict[str, int]

    @property
    def resident_bytes(self) -> int:
        return self.buffer_bytes

    @property
    def staged_bytes(self) -> int:
        return self.persistent_bytes + max(self.stage_bytes.values(), default=0)

    def peak(self, residency: str) -> int:
        return self.resident_bytes if residency == "resident" else self.staged_bytes


def buffer_users(plan: dict) -> dict[int, set[str]]:
    """Each buffer's users: the stages and "generate" whose commands touch it (a stage's
    inputs and outputs count as the stage's)."""
    users: dict[int, set[str]] = {}

    def scan(commands, who: str) -> None:
        for c in commands:
            op = c.get("op")
            if op == "dispatch":
                ids = [b for _slot, b, _size in c["bindings"]]
            elif op in ("write", "input"):
                ids = [c["buffer"]]
            elif op == "copy":
                ids = [c["src"], c["dst"]]
            else:
                ids = []
            for i in ids:
                users.setdefault(i, set()).add(who)

    for name, stage in plan["stages"].items():
        scan(stage["commands"], name)
        for io in (*stage["inputs"].values(), *stage["outputs"].values()):
            users.setdefault(io["buffer"], set()).add(name)
    scan(plan["generate"], "generate")
    for io in plan["outputs"].values():
        users.setdefault(io["buffer"], set()).add("generate")
    return users


def plan_memory(plan: dict) -> PlanMemory:
    """The PlanMemory of `plan`."""
    users = buffer_users(plan)
    owned: dict[str, list[int]] = {name: [] for name in plan["stages"]}
    persistent = []
    for b in plan["buffers"]:
        who = users.get(b["id"], set())
        if b["kind"] in SCOPED_KINDS and len(who) == 1 and next(iter(who)) in owned:
            owned[next(iter(who))].append(b["id"])
        else:
            persistent.append(b["id"])
    size = {b["id"]: b["size"] for b in plan["buffers"]}
    uniforms = sum(len(base64.b64decode(u)) for u in plan["uniforms"])
    return PlanMemory(buffer_bytes=sum(size.values()) + uniforms, persistent=tuple(persistent),
                      persistent_bytes=sum(size[i] for i in persistent) + uniforms,
                      stage_buffers={n: tuple(ids) for n, ids in owned.items()},
                      stage_bytes={n: sum(size[i] for i in ids) for n, ids in owned.items()})


def choose_residency(memory: PlanMemory, budget_bytes: int | None, residency: str = "auto") -> str:
    """`residency` ("auto", "resident" or "staged") resolved: auto keeps every buffer resident
    unless only staging fits the budget."""
    if residency not in ("auto", *RESIDENCIES):
        raise InputError(f"residency {residency!r}: expected auto, resident or staged")
    if residency != "auto":
        return residency
    if budget_bytes is None or memory.resident_bytes <= budget_bytes:
        return "resident"
    return "staged"


@dataclass
class Fit:
    fits: bool
    profile: str
    precision: str  # the plan's element type: f16, f16s (f16-storage) or f32
    peak_gpu_bytes: int  # under `residency`
    max_binding_bytes: int
    max_buffer_bytes: int
    max_workgroup_storage_bytes: int
    max_invocations_per_workgroup: int
    budget_bytes: int | None = None
    residency: str = "resident"
    resident_gpu_bytes: int = 0  # the peak with every weight resident
    staged_gpu_bytes: int = 0  # the peak with each stage's own buffers allocated only while it runs
    scratch_divisor: int = 1  # the plan's scratch bounds were divided by this to fit a budget
    reasons: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def effective_budget(caps, budget_bytes: int | None) -> int | None:
    """The budget a plan is held to on `caps`: `budget_bytes` or the adapter's own
    memory_budget_bytes, whichever is smaller (None: neither is known)."""
    own = getattr(caps, "memory_budget_bytes", None)
    return own if own and (budget_bytes is None or own < budget_bytes) else budget_bytes


def fit_plan(plan: dict, caps, budget_bytes: int | None = None, residency: str = "auto") -> Fit:
    """The Fit of `plan` on the adapter `caps` (engine.device.DeviceCaps) within `budget_bytes`
    of GPU memory (None: no budget) and the adapter's own memory_budget_bytes, its weights held
    as `residency` says (auto: resident when that fits the budget, else staged)."""
    whose = " (the adapter's own)" if effective_budget(caps, budget_bytes) != budget_bytes else ""
    budget_bytes = effective_budget(caps, budget_bytes)
    memory = plan_memory(plan)
    residency = choose_residency(memory, budget_bytes, residency)
    peak = memory.peak(residency)
    bound = [size for commands in _command_lists(plan) for c in commands if c.get("op") == "dispatch"
             for _slot, _buffer, size in c["bindings"]]
    storage, invocations = 0, 0
    for p in plan["pipelines"]:
        need = pipeline_needs(plan["shaders"][p["shader"]]["path"], p["entry"], p["dtype"],
                              tuple(sorted(p.get("constants", {}).items())))
        storage, invocations = max(storage, need[0]), max(invocations, need[1])
    fit = Fit(fits=True, profile=plan["profile"]["name"], precision=plan["dtype"], peak_gpu_bytes=peak,
              max_binding_bytes=max(bound, default=0), max_buffer_bytes=max((b["size"] for b in plan["buffers"]), default=0),
              max_workgroup_storage_bytes=storage, max_invocations_per_workgroup=invocations, budget_bytes=budget_bytes,
              residency=residency, resident_gpu_bytes=memory.resident_bytes, staged_gpu_bytes=memory.staged_bytes,
              scratch_divisor=int(plan.get("scratch_divisor", 1)))
    for need, limit in LIMITS.items():
        have = caps.limits.get(limit)
        if have is not None and getattr(fit, need) > have:
            fit.reasons.append(f"{need.replace('_', ' ')} {getattr(fit, need):,} > the adapter's {limit} {have:,}")
    if budget_bytes is not None and peak > budget_bytes:
        fit.reasons.append(f"peak GPU memory {peak:,} bytes ({residency}) > the budget of {budget_bytes:,}{whose}: "
                           f"{_peak_parts(plan, memory, residency)}")
    fit.fits = not fit.reasons
    return fit


def _peak_parts(plan: dict, memory: PlanMemory, residency: str) -> str:
    """What the peak is made of: the largest stage's weights and other buffers, and the rest."""
    kind = {b["id"]: b["kind"] for b in plan["buffers"]}
    size = {b["id"]: b["size"] for b in plan["buffers"]}
    if residency == "resident" or not memory.stage_bytes:
        weights = sum(s for i, s in size.items() if kind[i] == "weight")
        return f"weights {weights:,}, other buffers and uniforms {memory.resident_bytes - weights:,}"
    stage = max(memory.stage_bytes, key=memory.stage_bytes.get)
    weights = sum(size[i] for i in memory.stage_buffers[stage] if kind[i] == "weight")
    return (f"{stage}'s weights {weights:,} and its other buffers {memory.stage_bytes[stage] - weights:,}, "
            f"plus {memory.persistent_bytes:,} that every stage shares")


def _command_lists(plan: dict):
    yield plan["generate"]
    for stage in plan["stages"].values():
        yield stage["commands"]


# ---- WGSL: workgroup storage and size of an entry point ---------------------------------------

_DECL = re.compile(r"^(override|const)\s+(\w+)\s*(?::\s*[\w<>]+)?\s*(?:=\s*([^;]+))?;", re.M)  # module scope
_WORKGROUP_VAR = re.compile(r"var<workgroup>\s+(\w+)\s*:\s*([^;]+);")
_ENTRY = re.compile(r"@workgroup_size\(([^)]*)\)\s*fn\s+(\w+)")
_FN = re.compile(r"\bfn\s+(\w+)\s*\(")
_SCALAR_BYTES = {"f32": 4, "u32": 4, "i32": 4, "f16": 2, "bool": 4}


@cache
def pipeline_needs(shader_path: str, entry: str, dtype: str, constants: tuple) -> tuple[int, int]:
    """(workgroup storage bytes, invocations per workgroup) of `entry` in the shader at
    `shader_path` (as a plan names it: "shaders/<op>/<variant>.wgsl"), its element type T being
    `dtype` and its override constants `constants`. Only the workgroup variables the entry
    point (or a function it calls) uses count, as compilers count them."""
    source = _strip_comments((SHADER_ROOT.parent / shader_path).read_text())
    dtype = "f32" if dtype == "f16s" else dtype  # packed halves compute in f32
    env: dict[str, int] = {}
    given = dict(constants)
    for kind, name, expr in _DECL.findall(source):
        if kind == "override" and name in given:
            env[name] = int(given[name])
        elif expr:
            try:
                env[name] = _eval(expr, env, shader_path)
            except InputError:  # not an integer (an array, a float): no size depends on it
                pass
    bodies = _functions(source)
    if entry not in bodies:
        raise InputError(f"{shader_path}: no entry point {entry!r}")
    used = _reachable(entry, bodies)
    text = "\n".join(bodies[f] for f in used)
    storage = sum(_type_bytes(t.strip(), dtype, env, shader_path) for name, t in _WORKGROUP_VAR.findall(source)
                  if re.search(rf"\b{name}\b", text))
    sizes = next((s for s, fn in _ENTRY.findall(source) if fn == entry), None)
    if sizes is None:
        raise InputError(f"{shader_path}: entry point {entry!r} has no @workgroup_size")
    invocations = 1
    for dim in sizes.split(","):
        if dim.strip():
            invocations *= _eval(dim, env, shader_path)
    return storage, invocations


def _strip_comments(source: str) -> str:
    return re.sub(r"/\*.*?\*/", "", re.sub(r"//[^\n]*", "", source), flags=re.S)


def _functions(source: str) -> dict[str, str]:
    """Each function's text, from its `fn` to the brace that closes its body."""
    out = {}
    for m in _FN.finditer(source):
        start = source.index("{", m.end())
        depth, i = 0, start
        while i < len(source):
            depth += {"{": 1, "}": -1}.get(source[i], 0)
            if depth == 0:
                break
            i += 1
        out[m.group(1)] = source[m.start():i + 1]
    return out


def _reachable(entry: str, bodies: dict[str, str]) -> list[str]:
    seen, todo = [], [entry]
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.append(f)
        todo += [g for g in bodies if g != f and re.search(rf"\b{g}\s*\(", bodies[f])]
    return seen


def _type_bytes(t: str, dtype: str, env: dict[str, int], where: str) -> int:
    """Bytes of a workgroup variable's type: scalars, vecN<S>, atomic<S>, array<E, N>."""
    t = t.replace(" ", "")
    if t == "T":
        t = dtype
    if t in _SCALAR_BYTES:
        return _SCALAR_BYTES[t]
    if m := re.fullmatch(r"atomic<(\w+)>", t):
        return _SCALAR_BYTES[m.group(1)]
    if m := re.fullmatch(r"vec([234])<(\w+)>", t):
        n, scalar = int(m.group(1)), _type_bytes(m.group(2), dtype, env, where)
        return scalar * (4 if n == 3 else n)
    if t.startswith("array<") and t.endswith(">"):
        inner = t[len("array<"):-1]
        depth = 0
        for i, ch in enumerate(inner):  # the comma that ends the element type
            depth += {"<": 1, ">": -1}.get(ch, 0)
            if ch == "," and depth == 0:
                return _type_bytes(inner[:i], dtype, env, where) * _eval(inner[i + 1:], env, where)
    raise InputError(f"{where}: cannot size the workgroup type {t!r}")


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod, ast.LShift: operator.lshift, ast.RShift: operator.rshift, ast.BitOr: operator.or_,
        ast.BitAnd: operator.and_, ast.BitXor: operator.xor}


def _eval(expr: str, env: dict[str, int], where: str) -> int:
    """An integer WGSL constant expression (literals with or without `u`/`i`, + - * / % << >> | & ^,
    min, max, parentheses, names of earlier constants)."""
    text = re.sub(r"\b(\d+)[ui]\b", r"\1", expr.strip()).replace("/", "//")
    try:
        return _node(ast.parse(text, mode="eval").body, env)
    except (SyntaxError, KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise InputError(f"{where}: cannot evaluate {expr.strip()!r} ({exc})") from None


def _node(n, env: dict[str, int]) -> int:
    if isinstance(n, ast.Constant) and isinstance(n.value, int):
        return n.value
    if isinstance(n, ast.Name):
        return env[n.id]
    if isinstance(n, ast.BinOp) and type(n.op) in _OPS:
        return _OPS[type(n.op)](_node(n.left, env), _node(n.right, env))
    if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub):
        return -_node(n.operand, env)
    if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("min", "max") and not n.keywords:
        return {"min": min, "max": max}[n.func.id](*(_node(a, env) for a in n.args))
    raise ValueError(f"not a constant expression: {ast.dump(n)[:80]}")
