// Group normalisation in one dispatch: one workgroup per (batch, group) computes the group's
// statistics and then normalises it, so no statistics tensor and no second launch.
// x, y: (B, C, S) with S = H*W; group (b, g) is the contiguous run [grp * n, (grp + 1) * n),
// grp = b*G + g, n = (C/G) * S.
//
// Statistics: each invocation accumulates shifted sums s1 = sum(x - k), s2 = sum((x - k)^2)
// around its own first element k (the shift keeps s2 from cancelling as E[x^2] - E[x]^2 does
// in f32), turns them into (count, mean, M2) and the workgroup merges those pairwise with
// Chan's formula. x is read twice in all (statistics, then apply), against three times for
// the two-dispatch reference.
struct Params { B: u32, C: u32, S: u32, G: u32, eps: f32, silu: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<T>;
@group(0) @binding(2) var<storage, read> gamma: array<T>;
@group(0) @binding(3) var<storage, read> beta: array<T>;
@group(0) @binding(4) var<storage, read_write> y: array<T>;

const WG: u32 = 256u;

var<workgroup> cnt: array<f32, WG>;
var<workgroup> mu: array<f32, WG>;
var<workgroup> m2: array<f32, WG>;

@compute @workgroup_size(256)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let grp = wid.y * nwg.x + wid.x;
    if (grp >= p.B * p.G) { return; }  // uniform across the workgroup
    let cpg = p.C / p.G;
    let n = cpg * p.S;
    let base = grp * n;

    // 1. per-invocation (count, mean, M2) from shifted sums
    var k = 0.0;
    if (li < n) { k = f32(x[base + li]); }
    var s1 = 0.0;
    var s2 = 0.0;
    for (var i = li; i < n; i += WG) {
        let d = f32(x[base + i]) - k;
        s1 += d;
        s2 += d * d;
    }
    var c = 0.0;
    if (li < n) { c = f32((n - li + WG - 1u) / WG); }
    var mean = k;
    var q = 0.0;
    if (c > 0.0) {
        mean = k + s1 / c;
        q = max(s2 - s1 * s1 / c, 0.0);
    }
    cnt[li] = c;
    mu[li] = mean;
    m2[li] = q;
    workgroupBarrier();

    // 2. pairwise merge (Chan et al.): empty halves contribute nothing
    for (var h = WG / 2u; h > 0u; h = h >> 1u) {
        if (li < h) {
            let na = cnt[li];
            let nb = cnt[li + h];
            let nt = na + nb;
            if (nb > 0.0) {
                let delta = mu[li + h] - mu[li];
                let f = nb / nt;
                mu[li] = mu[li] + delta * f;
                m2[li] = m2[li] + m2[li + h] + delta * delta * na * f;
                cnt[li] = nt;
            }
        }
        workgroupBarrier();
    }
    let g_mean = mu[0];
    let rstd = inverseSqrt(m2[0] / f32(n) + p.eps);

    // 3. normalise, affine, optional SiLU
    let c0 = (grp % p.G) * cpg;
    if (n % 2u == 0u) {  // groups start on a word: pairs (one whole word each in f16-storage)
        for (var i = 2u * li; i < n; i += 2u * WG) {
            y_pair(base + i, vec2<f32>(normed(base, i, c0, g_mean, rstd), normed(base, i + 1u, c0, g_mean, rstd)));
        }
    } else {
        for (var i = li; i < n; i += WG) { y[base + i] = T(normed(base, i, c0, g_mean, rstd)); }
    }
}

fn y_pair(i: u32, v: vec2<f32>) { y[i] = T(v.x); y[i + 1u] = T(v.y); }

// Element i of the group starting at base (its first channel c0), normalised, affine, SiLU.
fn normed(base: u32, i: u32, c0: u32, g_mean: f32, rstd: f32) -> f32 {
    let ch = c0 + i / p.S;
    var v = (f32(x[base + i]) - g_mean) * rstd * f32(gamma[ch]) + f32(beta[ch]);
    if (p.silu != 0u) { v = v / (1.0 + exp(-v)); }
    return v;
}
