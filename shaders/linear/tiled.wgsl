// y = x W^T + b, tiled: a workgroup computes a TILE_M x TILE_N tile of y, each invocation a
// 4 x 4 register block of it, and the K axis is walked TILE_K at a time through workgroup
// memory (both operands are K-contiguous, so a tile is read coalesced along K). Accumulation
// and the staged tiles are f32 whatever T is.
// x: (M, K), W: (N, K) (PyTorch's layout), b: (N), y: (M, N)
//
// Entry points: `main_vec4` loads 4 consecutive k at a time and needs K % 4 == 0 (rows then
// start on a vec4 boundary); `main` loads scalars and serves any K. Out-of-range rows,
// columns and k are loaded as zero, so any M, N, K is exact.
//
// Workgroup storage, [k][m/4] and [k][n/4] so an invocation reads its 4 rows (4 columns) of
// one k as one vec4:  As: TILE_K x TILE_M,  Bs: TILE_K x TILE_N.
struct Params { M: u32, N: u32, K: u32, has_bias: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<T>;
@group(0) @binding(2) var<storage, read> w: array<T>;
@group(0) @binding(1) var<storage, read> x4: array<vec4<T>>;
@group(0) @binding(2) var<storage, read> w4: array<vec4<T>>;
@group(0) @binding(3) var<storage, read> b: array<T>;
@group(0) @binding(4) var<storage, read_write> y: array<T>;

override TILE_M: u32 = 64;  // multiple of 4
override TILE_N: u32 = 64;  // multiple of 4
override TILE_K: u32 = 16;  // multiple of 4
const R: u32 = 4u;          // register block edge

var<workgroup> As: array<vec4<f32>, TILE_K * TILE_M / R>;
var<workgroup> Bs: array<vec4<f32>, TILE_K * TILE_N / R>;

// Put element (row r of the tile, k offset kk) in the [k][row/4] layout.
fn put_a(r: u32, kk: u32, v: f32) { As[kk * (TILE_M / R) + r / R][r % R] = v; }
fn put_b(r: u32, kk: u32, v: f32) { Bs[kk * (TILE_N / R) + r / R][r % R] = v; }

struct Acc { r0: vec4<f32>, r1: vec4<f32>, r2: vec4<f32>, r3: vec4<f32> }

fn mac(acc: ptr<function, Acc>, tx: u32, ty: u32) {
    for (var kk = 0u; kk < TILE_K; kk++) {
        let a = As[kk * (TILE_M / R) + ty];
        let bv = Bs[kk * (TILE_N / R) + tx];
        (*acc).r0 += a.x * bv;
        (*acc).r1 += a.y * bv;
        (*acc).r2 += a.z * bv;
        (*acc).r3 += a.w * bv;
    }
}

fn y_pair(i: u32, v: vec2<f32>) { y[i] = T(v.x); y[i + 1u] = T(v.y); }

fn biased(n: u32, v: f32) -> f32 {
    if (p.has_bias != 0u) { return v + f32(b[n]); }
    return v;
}

// Row m, columns n0 .. n0 + 3 (n0 a multiple of 4). With N even a row starts on a word, so the
// columns go out in pairs (one whole word each in f16-storage, scripts/make_packed_shaders.py).
fn store_row(m: u32, n0: u32, v: vec4<f32>) {
    if (m >= p.M) { return; }
    if (p.N % 2u == 0u) {
        let at = m * p.N + n0;
        if (n0 < p.N) { y_pair(at, vec2<f32>(biased(n0, v.x), biased(n0 + 1u, v.y))); }
        if (n0 + 2u < p.N) { y_pair(at + 2u, vec2<f32>(biased(n0 + 2u, v.z), biased(n0 + 3u, v.w))); }
        return;
    }
    for (var j = 0u; j < R; j++) {
        let n = n0 + j;
        if (n < p.N) { y[m * p.N + n] = T(biased(n, v[j])); }
    }
}

fn store(acc: Acc, m0: u32, n0: u32) {
    store_row(m0, n0, acc.r0);
    store_row(m0 + 1u, n0, acc.r1);
    store_row(m0 + 2u, n0, acc.r2);
    store_row(m0 + 3u, n0, acc.r3);
}

@compute @workgroup_size(TILE_N / 4, TILE_M / 4)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let nthreads = (TILE_M / R) * (TILE_N / R);
    let m0 = wid.y * TILE_M;
    let n0 = wid.x * TILE_N;
    var acc: Acc;
    for (var k0 = 0u; k0 < p.K; k0 += TILE_K) {
        for (var i = li; i < TILE_M * TILE_K; i += nthreads) {
            let r = i / TILE_K;
            let kk = i % TILE_K;
            let m = m0 + r;
            let k = k0 + kk;
            var v = 0.0;
            if (m < p.M && k < p.K) { v = f32(x[m * p.K + k]); }
            put_a(r, kk, v);
        }
        for (var i = li; i < TILE_N * TILE_K; i += nthreads) {
            let r = i / TILE_K;
            let kk = i % TILE_K;
            let n = n0 + r;
            let k = k0 + kk;
            var v = 0.0;
            if (n < p.N && k < p.K) { v = f32(w[n * p.K + k]); }
            put_b(r, kk, v);
        }
        workgroupBarrier();
        mac(&acc, lid.x, lid.y);
        workgroupBarrier();
    }
    store(acc, m0 + lid.y * R, n0 + lid.x * R);
}

@compute @workgroup_size(TILE_N / 4, TILE_M / 4)
fn main_vec4(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let nthreads = (TILE_M / R) * (TILE_N / R);
    let kq = TILE_K / R;  // vec4s per tile row
    let m0 = wid.y * TILE_M;
    let n0 = wid.x * TILE_N;
    var acc: Acc;
    for (var k0 = 0u; k0 < p.K; k0 += TILE_K) {
        for (var i = li; i < TILE_M * kq; i += nthreads) {
            let r = i / kq;
            let kk = (i % kq) * R;
            let m = m0 + r;
            let k = k0 + kk;
            var v = vec4<f32>();
            if (m < p.M && k < p.K) { v = vec4<f32>(x4[(m * p.K + k) / R]); }
            put_a(r, kk, v.x);
            put_a(r, kk + 1u, v.y);
            put_a(r, kk + 2u, v.z);
            put_a(r, kk + 3u, v.w);
        }
        for (var i = li; i < TILE_N * kq; i += nthreads) {
            let r = i / kq;
            let kk = (i % kq) * R;
            let n = n0 + r;
            let k = k0 + kk;
            var v = vec4<f32>();
            if (n < p.N && k < p.K) { v = vec4<f32>(w4[(n * p.K + k) / R]); }
            put_b(r, kk, v.x);
            put_b(r, kk + 1u, v.y);
            put_b(r, kk + 2u, v.z);
            put_b(r, kk + 3u, v.w);
        }
        workgroupBarrier();
        mac(&acc, lid.x, lid.y);
        workgroupBarrier();
    }
    store(acc, m0 + lid.y * R, n0 + lid.x * R);
}
