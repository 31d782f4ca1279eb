// y = x W^T + b with f16 arithmetic: the tiled matmul's blocking (a workgroup computes a
// TILE_M x TILE_N tile of y, each invocation a 4 x 4 register block, K walked TILE_K at a time
// through workgroup memory) with the tiles kept as vec4<f16> and the products summed by
// vec4<f16> FMAs (two f16 lanes per FP32 lane on most GPUs, half the workgroup-memory bytes).
// Each tile's TILE_K products are summed in f16 and then added to an f32 accumulator, so f16
// rounding is confined to sums of TILE_K terms. Needs T = f16 and K % 4 == 0 (vec4 loads along
// K); the launcher uses the f32 tiled kernel otherwise.
// x: (M, K), W: (N, K) (PyTorch's layout), b: (N), y: (M, N)
//
// Workgroup storage, [k][m/4] and [k][n/4] so an invocation reads its 4 rows (4 columns) of
// one k as one vec4:  As: TILE_K x TILE_M,  Bs: TILE_K x TILE_N.
struct Params { M: u32, N: u32, K: u32, has_bias: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x4: array<vec4<T>>;
@group(0) @binding(2) var<storage, read> w4: array<vec4<T>>;
@group(0) @binding(3) var<storage, read> b: array<T>;
@group(0) @binding(4) var<storage, read_write> y: array<T>;

override TILE_M: u32 = 64;  // multiple of 4
override TILE_N: u32 = 64;  // multiple of 4
override TILE_K: u32 = 16;  // multiple of 4
const R: u32 = 4u;          // register block edge

var<workgroup> As: array<vec4<f16>, TILE_K * TILE_M / R>;
var<workgroup> Bs: array<vec4<f16>, TILE_K * TILE_N / R>;

struct Acc { r0: vec4<f32>, r1: vec4<f32>, r2: vec4<f32>, r3: vec4<f32> }

// Rows m0 + r (r < 4) of y times columns n0..n0+3: this tile's TILE_K products, summed in f16.
fn mac(acc: ptr<function, Acc>, tx: u32, ty: u32) {
    var h0 = vec4<f16>(0.0h);
    var h1 = vec4<f16>(0.0h);
    var h2 = vec4<f16>(0.0h);
    var h3 = vec4<f16>(0.0h);
    for (var kk = 0u; kk < TILE_K; kk++) {
        let a = As[kk * (TILE_M / R) + ty];
        let bv = Bs[kk * (TILE_N / R) + tx];
        h0 = fma(vec4<f16>(a.x), bv, h0);
        h1 = fma(vec4<f16>(a.y), bv, h1);
        h2 = fma(vec4<f16>(a.z), bv, h2);
        h3 = fma(vec4<f16>(a.w), bv, h3);
    }
    (*acc).r0 += vec4<f32>(h0);
    (*acc).r1 += vec4<f32>(h1);
    (*acc).r2 += vec4<f32>(h2);
    (*acc).r3 += vec4<f32>(h3);
}

fn store_row(m: u32, n0: u32, v: vec4<f32>) {
    if (m >= p.M) { return; }
    for (var j = 0u; j < R; j++) {
        let n = n0 + j;
        if (n < p.N) {
            var o = v[j];
            if (p.has_bias != 0u) { o += f32(b[n]); }
            y[m * p.N + n] = T(o);
        }
    }
}

@compute @workgroup_size(TILE_N / 4, TILE_M / 4)
fn main(
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
            var v = vec4<f16>(0.0h);
            if (m < p.M && k0 + kk < p.K) { v = vec4<f16>(x4[(m * p.K + k0 + kk) / R]); }
            let at = kk * (TILE_M / R) + r / R;
            As[at][r % R] = v.x;
            As[at + TILE_M / R][r % R] = v.y;
            As[at + 2u * (TILE_M / R)][r % R] = v.z;
            As[at + 3u * (TILE_M / R)][r % R] = v.w;
        }
        for (var i = li; i < TILE_N * kq; i += nthreads) {
            let r = i / kq;
            let kk = (i % kq) * R;
            let n = n0 + r;
            var v = vec4<f16>(0.0h);
            if (n < p.N && k0 + kk < p.K) { v = vec4<f16>(w4[(n * p.K + k0 + kk) / R]); }
            let at = kk * (TILE_N / R) + r / R;
            Bs[at][r % R] = v.x;
            Bs[at + TILE_N / R][r % R] = v.y;
            Bs[at + 2u * (TILE_N / R)][r % R] = v.z;
            Bs[at + 3u * (TILE_N / R)][r % R] = v.w;
        }
        workgroupBarrier();
        mac(&acc, lid.x, lid.y);
        workgroupBarrier();
    }
    let m = m0 + lid.y * R;
    let n = n0 + lid.x * R;
    store_row(m, n, acc.r0);
    store_row(m + 1u, n, acc.r1);
    store_row(m + 2u, n, acc.r2);
    store_row(m + 3u, n, acc.r3);
}
