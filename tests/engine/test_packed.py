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


PAIRS = """@group(0) @binding(1) var<storage, read> x: array<T>;
@group(0) @binding(2) var<storage, read_write> y2: array<vec2<T>>;
@group(0) @binding(3) var<storage, read_write> y: array<T>;
@group(0) @binding(4) var<storage, read_write> z: array<T>;
fn y_pair(i: u32, v: vec2<f32>) { y[i] = T(v.x); y[i + 1u] = T(v.y); }
fn z_pair(i: u32, v: vec2<f32>) {
    z[i] = T(v.x);  // the first of the two
    z[i + 1u] = T(v.y);
}
fn main() {
    y2[1u] = vec2<T>(x[0u], x[1u]);
    y_pair(2u, vec2<f32>(f32(y[0u]), 1.0));
    z_pair(0u, vec2<f32>(2.0, 3.0));
    z[3u] = T(4.0);
}
"""


def test_pairs_are_stored_as_whole_words():
    """A vec2<T> buffer is one u32 word a pair; a scalar buffer's NAME_pair stores one whole word,
    with no atomics at all where every store to it is a pair."""
    out = make.packed(PAIRS)
    assert "var<storage, read_write> y2: array<u32>;" in out
    assert "y2_st(u32(1u), vec2<f32>(vec2<T>(x_ld(u32(0u)), x_ld(u32(1u)))));" in out
    assert "fn y2_st(pk_i: u32, pk_v: vec2<f32>) {\n    y2[pk_i] = pack2x16float(pk_v);" in out
    assert "var<storage, read_write> y: array<u32>;" in out
    assert "    y[i >> 1u] = pack2x16float(v);" in out and "&y[" not in out
    assert "y_pair(2u, vec2<f32>(f32(y_ld(u32(0u))), 1.0));" in out  # its reads are plain too
    assert "var<storage, read_write> z: array<atomic<u32>>;" in out  # z[3] is a lone half
    assert "atomicStore(&z[i >> 1u], pack2x16float(v));" in out and "atomicOr(&z[pk_i >> 1u]" in out
    assert "z[i] = T(v.x)" not in out and "the first of the two" not in out


@pytest.mark.parametrize("source,why", [
    ("var<storage, read_write> y: array<T>;\nfn y_pair(i: u32, v: vec2<f32>) { y[i] = T(v.y); y[i + 1u] = T(v.x); }",
     "y_pair must store"),
    ("var<storage, read_write> y: array<T>;\nfn y_pair(j: u32, v: vec2<f32>) { y[j] = T(v.x); y[j + 1u] = T(v.y); }",
     "y_pair must be declared"),
    ("var<storage, read> x: array<T>;\nfn f() { x[0] = T(1.0); }", "read-only but stored to"),
    ("var<storage, read_write> y: array<vec4<T>>;\nfn f() { y[0].x = T(1.0); }", "a component of y"),
    ("var<storage, read> x: array<T>;\nfn f() { let p = &x; }", "taken by reference"),
    ("var<storage, read> x: array<T>;\nfn f() { let x = 1; }", "shadowed"),
    ("enable f16;\nvar<storage, read> x: array<T>;\nfn f() { let a = 1.0h; }", "f16 arithmetic"),
])
def test_what_cannot_be_rewritten_safely_is_refused(source, why):
    with pytest.raises(make.Unpackable, match=why):
        make.packed(source)


def test_sd14_unet_in_f16_storage_writes_almost_nothing_as_lone_halves(tmp_path):
    """A lone half costs two global atomics (Chrome's path on NVIDIA, many phones'): SD 1.4's UNet
    call, traced on shapes in f16-storage with the H100's profile through Dawn, stores all but
    about 1% of its elements as whole words or pairs (benchmarks/packed_stores.py; before the
    kernels wrote pairs, 1,344 M of 1,837 M were lone halves)."""
    import json

    from script_support import load_script

    out = tmp_path / "stores.json"
    assert load_script("benchmarks/packed_stores.py").main(["--json", str(out)]) == 0
    totals = json.loads(out.read_text())["totals"]["now"]
    assert totals["halves"] < 0.01 * sum(totals.values()), totals
    assert totals["words"] > totals["pairs"] > 0
