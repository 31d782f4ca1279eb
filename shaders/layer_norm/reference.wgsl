// Layer normalisation over the last dimension, one workgroup per row, statistics in f32.
// x, y: (R, D); gamma, beta: (D). Rows of even D are written in pairs (one whole word in
// f16-storage, scripts/make_packed_shaders.py).
struct Params { R: u32, D: u32, eps: f32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<T>;
@group(0) @binding(2) var<storage, read> gamma: array<T>;
@group(0) @binding(3) var<storage, read> beta: array<T>;
@group(0) @binding(4) var<storage, read_write> y: array<T>;

var<workgroup> partial: array<f32, 256>;

fn y_pair(i: u32, v: vec2<f32>) { y[i] = T(v.x); y[i + 1u] = T(v.y); }

fn norm(base: u32, i: u32, mean: f32, rstd: f32) -> f32 {
    return (f32(x[base + i]) - mean) * rstd * f32(gamma[i]) + f32(beta[i]);
}

fn reduce_sum(li: u32, v: f32) -> f32 {
    partial[li] = v;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s = s >> 1u) {
        if (li < s) { partial[li] += partial[li + s]; }
        workgroupBarrier();
    }
    let total = partial[0];
    workgroupBarrier();
    return total;
}

@compute @workgroup_size(256)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let row = wid.y * nwg.x + wid.x;
    if (row >= p.R) { return; }  // uniform per workgroup, so the barriers below stay uniform
    let base = row * p.D;
    var s = 0.0;
    for (var i = li; i < p.D; i += 256u) { s += f32(x[base + i]); }
    let mean = reduce_sum(li, s) / f32(p.D);
    var q = 0.0;
    for (var i = li; i < p.D; i += 256u) { let d = f32(x[base + i]) - mean; q += d * d; }
    let rstd = inverseSqrt(reduce_sum(li, q) / f32(p.D) + p.eps);
    if (p.D % 2u == 0u) {  // base is even: every pair is a word
        for (var i = 2u * li; i < p.D; i += 512u) {
            y_pair(base + i, vec2<f32>(norm(base, i, mean, rstd), norm(base, i + 1u, mean, rstd)));
        }
    } else {
        for (var i = li; i < p.D; i += 256u) { y[base + i] = T(norm(base, i, mean, rstd)); }
    }
}
