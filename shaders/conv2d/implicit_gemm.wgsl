// Implicit-GEMM 2-D convolution, NCHW, f32 accumulation.
// The convolution is the matrix product Y[m, n] = sum_k A[m, k] * Wm[n, k] + b[n] with
//   m = (bi, oy, ox)   an output pixel of any image      M = B * OH * OW
//   n = co             an output channel                 N = Cout
//   k = (ci, ky, kx)   a tap of the receptive field      K = Cin * KH * KW
// A is never stored: A[m, k] = x[bi, ci, oy*stride + ky - pad_t, ox*stride + kx - pad_l]
// (zero outside the image), gathered while a BK-deep slab of the A and Wm tiles is staged in
// workgroup memory. Wm is w (Cout, Cin, KH, KW) read as (Cout, K), row-major.
// A workgroup of WG_M x WG_N invocations owns a BM x BN output tile (BM = WG_M * TM,
// BN = WG_N * TN); invocation (i, j) accumulates the TM x TN register block of pixels
// i, i + WG_M, ... and channels j, j + WG_N, ..., so neighbouring invocations touch
// neighbouring pixels when reading the tile and writing y.
struct Params {
    B: u32, Cin: u32, H: u32, W: u32,
    Cout: u32, OH: u32, OW: u32, KH: u32,
    KW: u32, stride: u32, pad_t: u32, pad_l: u32,
    has_bias: u32, M: u32, K: u32, m_tiles_x: u32,
}
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<T>;
@group(0) @binding(2) var<storage, read> w: array<T>;
@group(0) @binding(3) var<storage, read> b: array<T>;
@group(0) @binding(4) var<storage, read_write> y: array<T>;

override WG_M: u32 = 16;  // invocations along the pixel axis
override WG_N: u32 = 16;  // invocations along the channel axis
override TM: u32 = 4;     // pixels per invocation (at most RB)
override TN: u32 = 4;     // channels per invocation (at most RB)
override BK: u32 = 16;    // depth of the K slab staged per barrier
override BM: u32 = WG_M * TM;
override BN: u32 = WG_N * TN;
const RB: u32 = 4u;       // register-block capacity per axis

var<workgroup> a_tile: array<f32, BK * BM>;  // [kk][mm]
var<workgroup> w_tile: array<f32, BK * BN>;  // [kk][nn]

@compute @workgroup_size(WG_M, WG_N)
fn main(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
) {
    let threads = WG_M * WG_N;
    let m0 = (wid.z * p.m_tiles_x + wid.x) * BM;
    let n0 = wid.y * BN;
    let taps = p.KH * p.KW;
    let plane = p.OH * p.OW;

    // Every allowed tiling has WG_N % TM == 0, so threads is a multiple of BM and each
    // invocation gathers the same pixel column mm of every A slab: decode it once.
    let mm = li % BM;
    let m = m0 + mm;
    let m_ok = m < p.M;
    let pix = m % plane;
    let x_img = (m / plane) * p.Cin * p.H * p.W;
    let iy0 = i32((pix / p.OW) * p.stride) - i32(p.pad_t);
    let ix0 = i32((pix % p.OW) * p.stride) - i32(p.pad_l);

    var acc: array<f32, RB * RB>;
    for (var k0 = 0u; k0 < p.K; k0 += BK) {
        // Gather the BK x BM slab of A, pixel index fastest (contiguous ox reads).
        for (var kk = li / BM; kk < BK; kk += threads / BM) {
            let k = k0 + kk;
            var v = 0.0;
            if (m_ok && k < p.K) {
                let ci = k / taps;
                let tap = k % taps;
                let iy = iy0 + i32(tap / p.KW);
                let ix = ix0 + i32(tap % p.KW);
                if (iy >= 0 && iy < i32(p.H) && ix >= 0 && ix < i32(p.W)) {
                    v = f32(x[x_img + (ci * p.H + u32(iy)) * p.W + u32(ix)]);
                }
            }
            a_tile[kk * BM + mm] = v;
        }
        // The BK x BN slab of Wm, k fastest (contiguous in w).
        for (var i = li; i < BK * BN; i += threads) {
            let kk = i % BK;
            let nn = i / BK;
            let n = n0 + nn;
            let k = k0 + kk;
            var v = 0.0;
            if (n < p.Cout && k < p.K) {
                v = f32(w[n * p.K + k]);
            }
            w_tile[kk * BN + nn] = v;
        }
        workgroupBarrier();
        for (var kk = 0u; kk < BK; kk++) {
            var a: array<f32, RB>;
            var c: array<f32, RB>;
            for (var i = 0u; i < TM; i++) { a[i] = a_tile[kk * BM + lid.x + i * WG_M]; }
            for (var j = 0u; j < TN; j++) { c[j] = w_tile[kk * BN + lid.y + j * WG_N]; }
            for (var i = 0u; i < TM; i++) {
                for (var j = 0u; j < TN; j++) {
                    acc[i * RB + j] = fma(a[i], c[j], acc[i * RB + j]);
                }
            }
        }
        workgroupBarrier();
    }

    for (var j = 0u; j < TN; j++) {
        let n = n0 + lid.y + j * WG_N;
        if (n >= p.Cout) { continue; }
        var bias = 0.0;
        if (p.has_bias != 0u) { bias = f32(b[n]); }
        for (var i = 0u; i < TM; i++) {
            let m = m0 + lid.x + i * WG_M;
            if (m >= p.M) { continue; }
            let bi = m / plane;
            y[(bi * p.Cout + n) * plane + m % plane] = T(acc[i * RB + j] + bias);
        }
    }
}
