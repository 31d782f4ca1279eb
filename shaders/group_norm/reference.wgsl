// Group normalisation in two dispatches (the plain form): `stats` writes each group's mean
// and 1/std in f32, `apply` normalises every element, applies the affine and optional SiLU.
// x, y: (B, C, S) with S = H*W; a group is C/G consecutive channels, so its elements are
// contiguous: group (b, g) spans [(b*G + g) * n, (b*G + g + 1) * n) with n = (C/G) * S.
struct Params { B: u32, C: u32, S: u32, G: u32, eps: f32, silu: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<T>;
@group(0) @binding(2) var<storage, read_write> stats: array<f32>;  // (B*G, 2): mean, rstd

var<workgroup> partial: array<f32, 256>;

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
fn stats_main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let grp = wid.x;
    let n = (p.C / p.G) * p.S;
    let base = grp * n;
    var s = 0.0;
    for (var i = li; i < n; i += 256u) { s += f32(x[base + i]); }
    let mean = reduce_sum(li, s) / f32(n);
    // Second pass over the deviations: the one-pass E[x^2] - E[x]^2 loses digits in f32.
    var q = 0.0;
    for (var i = li; i < n; i += 256u) { let d = f32(x[base + i]) - mean; q += d * d; }
    let variance = reduce_sum(li, q) / f32(n);
    if (li == 0u) {
        stats[2u * grp] = mean;
        stats[2u * grp + 1u] = inverseSqrt(variance + p.eps);
    }
}

@group(0) @binding(3) var<storage, read> gamma: array<T>;
@group(0) @binding(4) var<storage, read> beta: array<T>;
@group(0) @binding(5) var<storage, read_write> y: array<T>;

fn y_pair(i: u32, v: vec2<f32>) { y[i] = T(v.x); y[i + 1u] = T(v.y); }

fn normed(i: u32) -> f32 {
    let c = (i / p.S) % p.C;
    let b = i / (p.S * p.C);
    let grp = b * p.G + c / (p.C / p.G);
    var v = (f32(x[i]) - stats[2u * grp]) * stats[2u * grp + 1u] * f32(gamma[c]) + f32(beta[c]);
    if (p.silu != 0u) { v = v / (1.0 + exp(-v)); }
    return v;
}

// Two neighbours an invocation, stored as a pair (one whole word in f16-storage); an odd
// count's last element alone.
@compute @workgroup_size(256)
fn apply_main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let i = 2u * ((wid.y * nwg.x + wid.x) * 256u + li);
    let n = p.B * p.C * p.S;
    if (i >= n) { return; }
    if (i + 1u < n) {
        y_pair(i, vec2<f32>(normed(i), normed(i + 1u)));
    } else {
        y[i] = T(normed(i));
    }
}
