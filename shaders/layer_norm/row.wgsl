// Layer normalisation over the last dimension, one invocation per row: no workgroup memory and
// no barriers, statistics in f32 (two passes over the row: mean, then the centred sum of
// squares, as the reference variant). Software adapters run a workgroup's invocations one after
// another and pay for every barrier; there a row per invocation is the fast form.
// x, y: (R, D); gamma, beta: (D)
struct Params { R: u32, D: u32, eps: f32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<T>;
@group(0) @binding(2) var<storage, read> gamma: array<T>;
@group(0) @binding(3) var<storage, read> beta: array<T>;
@group(0) @binding(4) var<storage, read_write> y: array<T>;

override WG: u32 = 64u;  // rows per workgroup

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let row = (wid.y * nwg.x + wid.x) * WG + li;
    if (row >= p.R) { return; }
    let base = row * p.D;
    var s = 0.0;
    for (var i = 0u; i < p.D; i++) { s += f32(x[base + i]); }
    let mean = s / f32(p.D);
    var q = 0.0;
    for (var i = 0u; i < p.D; i++) { let d = f32(x[base + i]) - mean; q += d * d; }
    let rstd = inverseSqrt(q / f32(p.D) + p.eps);
    for (var i = 0u; i < p.D; i++) {
        y[base + i] = T((f32(x[base + i]) - mean) * rstd * f32(gamma[i]) + f32(beta[i]));
    }
}
