"""The f16-storage kernels (shaders/packed/) are generated from the kernels by
scripts/make_packed_shaders.py; its rewrite refuses what it cannot make safe. Their numerics are
tested with every other element type (test_kernels.py, test_variants_*.py: "f16s")."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("make_packed_shaders", ROOT / "scripts" / "make_packed_shaders.py")
make = importlib.util.module_from_spec(spec)
spec.loader.exec_module(make)


def test_every_packed_kernel_is_up_to_date_and_none_is_left_over():
    want = make.expected()
    stale = [str(p.relative_to(ROOT)) for p, text in want.items() if not p.exists() or p.read_text() != text]
    assert not stale, f"rerun python scripts/make_packed_shaders.py: {stale}"
    extra = sorted(str(p.relative_to(ROOT)) for p in make.OUT.rglob("*.wgsl") if p not in want)
    assert not extra, f"packed kernels whose source is gone: {extra}"


KERNEL = """@group(0) @binding(1) var<storage, read> x: array<T>;
@group(0) @binding(2) var<storage, read_write> y: array<T>;
@group(0) @binding(3) var<storage, read_write> y4: array<vec4<T>>;
fn main() {
    let i = 3u;
    y[i] += T(2.0) * x[y4_index(x[i - 1u])];
    y4[i] = vec4<T>(x[i]);
}
"""


def test_loads_and_stores_become_packed_half_accesses():
    out = make.packed(KERNEL)
    assert "var<storage, read> x: array<u32>;" in out
    assert "var<storage, read_write> y: array<atomic<u32>>;" in out
    assert "var<storage, read_write> y4: array<vec2<u32>>;" in out
    # a compound store reads its element, nested reads of one buffer inside another's index
    assert "y_st(u32(i), f32(y_ld(u32(i)) + (T(2.0) * x_ld(u32(y4_index(x_ld(u32(i - 1u))))))));" in out
    assert "y4_st(u32(i), vec4<f32>(vec4<T>(x_ld(u32(i)))));" in out
    assert "atomicAnd(&y[pk_i >> 1u]" in out and "atomicOr(&y[pk_i >> 1u]" in out


@pytest.mark.parametrize("source,why", [
    ("var<storage, read> x: array<T>;\nfn f() { x[0] = T(1.0); }", "read-only but stored to"),
    ("var<storage, read_write> y: array<vec4<T>>;\nfn f() { y[0].x = T(1.0); }", "a component of y"),
    ("var<storage, read> x: array<T>;\nfn f() { let p = &x; }", "taken by reference"),
    ("var<storage, read> x: array<T>;\nfn f() { let x = 1; }", "shadowed"),
    ("enable f16;\nvar<storage, read> x: array<T>;\nfn f() { let a = 1.0h; }", "f16 arithmetic"),
])
def test_what_cannot_be_rewritten_safely_is_refused(source, why):
    with pytest.raises(make.Unpackable, match=why):
        make.packed(source)
