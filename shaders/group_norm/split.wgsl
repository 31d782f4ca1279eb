// Group normalisation for groups too large for one workgroup each (the VAE's 512x512 levels:
// 32 groups of a million elements would keep 32 workgroups busy on a GPU of a hundred SMs).
// Three dispatches: `partial_main` reduces each CHUNK-element run of a group in its own
// workgroup to (count, mean, M2); `finalize_main` merges a group's runs into its mean and 1/std;
// reference.wgsl's apply_main then normalises every element. x is read twice in all, as by the
// fused variant, but every pass spreads over the whole GPU.
// x: (B, C, S) with S = H*W; group grp = b*G + g is the contiguous run [grp * n, (grp + 1) * n),
// n = (C/G) * S, and its chunk j the elements [j * CHUNK, min(n, (j + 1) * CHUNK)) of it.
// Statistics as in fused.wgsl: shifted sums per invocation around its first element (no
// E[x^2] - E[x]^2 cancellation), merged pairwise with Chan's formula, in f32.
struct Params { B: u32, C: u32, S: u32, G: u32, eps: f32, silu: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<T>;
@group(0) @binding(2) var<storage, read_write> part: array<f32>;   // (B*G, chunks, 3): count, mean, M2
@group(0) @binding(3) var<storage, read_write> stats: array<f32>;  // (B*G, 2): mean, 1/std

override CHUNK: u32 = 4096u;  // elements per workgroup of partial_main
const WG: u32 = 256u;

var<workgroup> cnt: array<f32, WG>;
var<workgroup> mu: array<f32, WG>;
var<workgroup> m2: array<f32, WG>;

fn group_size() -> u32 { return (p.C / p.G) * p.S; }
fn chunks() -> u32 { return (group_size() + CHUNK - 1u) / CHUNK; }

@compute @workgroup_size(256)
fn partial_main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let n = group_size();
    let grp = wid.y;
    let j = wid.x;
    let lo = j * CHUNK;
    let hi = min(n, lo + CHUNK);
    let base = grp * n;

    var k = 0.0;
    if (lo + li < hi) { k = f32(x[base + lo + li]); }
    var s1 = 0.0;
    var s2 = 0.0;
    for (var i = lo + li; i < hi; i += WG) {
        let d = f32(x[base + i]) - k;
        s1 += d;
        s2 += d * d;
    }
    var c = 0.0;
    if (lo + li < hi) { c = f32((hi - lo - li + WG - 1u) / WG); }
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
    if (li == 0u) {
        let at = 3u * (grp * chunks() + j);
        part[at] = cnt[0];
        part[at + 1u] = mu[0];
        part[at + 2u] = m2[0];
    }
}

// One invocation per group merges its chunks in order.
@compute @workgroup_size(64)
fn finalize_main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let grp = gid.x;
    if (grp >= p.B * p.G) { return; }
    let nch = chunks();
    var na = 0.0;
    var mean = 0.0;
    var q = 0.0;
    for (var j = 0u; j < nch; j++) {
        let at = 3u * (grp * nch + j);
        let nb = part[at];
        let nt = na + nb;
        let delta = part[at + 1u] - mean;
        let f = nb / nt;
        mean = mean + delta * f;
        q = q + part[at + 2u] + delta * delta * na * f;
        na = nt;
    }
    stats[2u * grp] = mean;
    stats[2u * grp + 1u] = inverseSqrt(q / f32(group_size()) + p.eps);
}
