// Group normalisation as split.wgsl (statistics of CHUNK-element runs in workgroups of their
// own, merged per group by split.wgsl's finalize_main, which reads `part` as written here, then an
// element-wise apply), with every access four consecutive
// elements wide: vec4 loads and stores (8 bytes of halves, 16 of f32) where split.wgsl moves one
// element, and the apply's channel arithmetic once per four elements. The H100's f16 VAE ran
// split.wgsl's three passes at 0.6-0.8 TB/s of its 3.35 at 512x512. Needs S = H*W divisible
// by 4, so that a group's run and each chunk start on a whole vec4 and the four elements of one
// share a channel (the launcher runs split.wgsl otherwise); CHUNK is a multiple of 4.
// x, y: (B, C, S) read as vec4s; group grp = b*G + g is the run of n = (C/G) * S elements from
// grp * n, its chunk j the elements [j * CHUNK, min(n, (j + 1) * CHUNK)) of it.
// Statistics as in split.wgsl: shifted sums per invocation around its first element, merged
// pairwise with Chan's formula, in f32.
struct Params { B: u32, C: u32, S: u32, G: u32, eps: f32, silu: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<vec4<T>>;
@group(0) @binding(2) var<storage, read_write> part: array<f32>;   // (B*G, chunks, 3): count, mean, M2
@group(0) @binding(3) var<storage, read_write> stats: array<f32>;  // (B*G, 2): mean, 1/std
@group(0) @binding(4) var<storage, read> gamma: array<T>;
@group(0) @binding(5) var<storage, read> beta: array<T>;
@group(0) @binding(6) var<storage, read_write> y: array<vec4<T>>;

override CHUNK: u32 = 4096u;  // elements per workgroup of partial_main
const WG: u32 = 256u;

var<workgroup> cnt: array<f32, WG>;
var<workgroup> mu: array<f32, WG>;
var<workgroup> m2: array<f32, WG>;

fn group_size() -> u32 { return (p.C / p.G) * p.S; }
fn chunks() -> u32 { return (group_size() + CHUNK - 1u) / CHUNK; }

@compute @workgroup_size(256)
fn partial_main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let n4 = group_size() / 4u;
    let grp = wid.y;
    let j = wid.x;
    let lo = j * (CHUNK / 4u);
    let hi = min(n4, lo + CHUNK / 4u);
    let base = grp * n4;

    var k = 0.0;
    if (lo + li < hi) { k = f32(x[base + lo + li].x); }
    var s1 = 0.0;
    var s2 = 0.0;
    for (var i = lo + li; i < hi; i += WG) {
        let d = vec4<f32>(x[base + i]) - vec4<f32>(k);
        s1 += (d.x + d.y) + (d.z + d.w);
        s2 += dot(d, d);
    }
    var c = 0.0;
    if (lo + li < hi) { c = 4.0 * f32((hi - lo - li + WG - 1u) / WG); }
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

// Four consecutive elements of one channel per invocation: (x - mean) * (1/std * gamma) + beta,
// then SiLU if asked.
@compute @workgroup_size(256)
fn apply_main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let i = (wid.y * nwg.x + wid.x) * 256u + li;
    if (i >= p.B * p.C * (p.S / 4u)) { return; }
    let s4 = p.S / 4u;
    let c = (i / s4) % p.C;
    let b = i / (s4 * p.C);
    let grp = b * p.G + c / (p.C / p.G);
    let scale = stats[2u * grp + 1u] * f32(gamma[c]);
    var v = (vec4<f32>(x[i]) - vec4<f32>(stats[2u * grp])) * scale + vec4<f32>(f32(beta[c]));
    if (p.silu != 0u) { v = v / (vec4<f32>(1.0) + exp(-v)); }
    y[i] = vec4<T>(v);
}
