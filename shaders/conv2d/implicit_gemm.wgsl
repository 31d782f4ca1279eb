// Implicit-GEMM 2-D convolution, NCHW, f32 accumulation.
// The convolution is the matrix product Y[n, m] = sum_k Wm[n, k] * A[k, m] + b[n] with
//   m = (bi, oy, ox)   an output pixel of any image      M = B * OH * OW
//   n = co             an output channel                 N = Cout
//   k = (ci, ky, kx)   a tap of the receptive field      K = Cin * KH * KW
// A is never stored: A[k, m] = x[bi, ci, oy*stride + ky - pad_t, ox*stride + kx - pad_l]
// (zero outside the image) is gathered while a TILE_K-deep slab of A and of Wm is staged in
// workgroup memory. Wm is w (Cout, Cin, KH, KW) read in place as (Cout, K), row-major, so no
// weight copy exists. KH and KW are override constants: the tap decode divides by constants.
//
// Blocking (the same as shaders/linear/tiled.wgsl): a workgroup owns a TILE_N x TILE_M tile of
// Y; invocation (lid.x, lid.y) owns the 4 x 4 register block of channels n0 + 4 lid.y .. +3
// and pixels m0 + 4 lid.x .. +3, one vec4 of 4 consecutive pixels per channel, so reading
// the staged A slab is one vec4 per k and neighbouring invocations write neighbouring pixels.
// Workgroup storage [k][m/4] and [k][n/4]:  As: TILE_K x TILE_M,  Ws: TILE_K x TILE_N (f32).
//
// Entry points: `main_vec4` reads Wm 4 consecutive k at a time and needs K % 4 == 0; `main`
// reads scalars and serves any K.
struct Params {
    B: u32, Cin: u32, H: u32, W: u32,
    Cout: u32, OH: u32, OW: u32, stride: u32,
    pad_t: u32, pad_l: u32, has_bias: u32, M: u32,
    K: u32, m_tiles_x: u32, _pad0: u32, _pad1: u32,
}
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<T>;
@group(0) @binding(2) var<storage, read> w: array<T>;
@group(0) @binding(2) var<storage, read> w4: array<vec4<T>>;
@group(0) @binding(3) var<storage, read> b: array<T>;
@group(0) @binding(4) var<storage, read_write> y: array<T>;

override TILE_M: u32 = 64;  // pixels per tile, multiple of 4
override TILE_N: u32 = 64;  // output channels per tile, multiple of 16
override TILE_K: u32 = 16;  // k per staged slab, multiple of 4 and of TILE_N / 16
override KH: u32 = 3;
override KW: u32 = 3;
const R: u32 = 4u;

var<workgroup> As: array<vec4<f32>, TILE_K * TILE_M / R>;
var<workgroup> Ws: array<vec4<f32>, TILE_K * TILE_N / R>;

struct Acc { c0: vec4<f32>, c1: vec4<f32>, c2: vec4<f32>, c3: vec4<f32> }

// The gather role of an invocation: one pixel column of every A slab, decoded once.
struct Pixel { ok: bool, x_img: u32, iy0: i32, ix0: i32, mm: u32 }

fn pixel(m0: u32, li: u32) -> Pixel {
    let mm = li % TILE_M;
    let m = m0 + mm;
    let plane = p.OH * p.OW;
    let mc = min(m, p.M - 1u);
    let pix = mc % plane;
    return Pixel(
        m < p.M,
        (mc / plane) * p.Cin * p.H * p.W,
        i32((pix / p.OW) * p.stride) - i32(p.pad_t),
        i32((pix % p.OW) * p.stride) - i32(p.pad_l),
        mm,
    );
}

fn gather_a(px: Pixel, k0: u32, li: u32) {
    let k_step = (TILE_M / R) * (TILE_N / R) / TILE_M;
    for (var kk = li / TILE_M; kk < TILE_K; kk += k_step) {
        let k = k0 + kk;
        var v = 0.0;
        if (px.ok && k < p.K) {
            let ci = k / (KH * KW);
            let tap = k - ci * (KH * KW);
            let ky = tap / KW;
            let iy = px.iy0 + i32(ky);
            let ix = px.ix0 + i32(tap - ky * KW);
            if (iy >= 0 && iy < i32(p.H) && ix >= 0 && ix < i32(p.W)) {
                v = f32(x[px.x_img + (ci * p.H + u32(iy)) * p.W + u32(ix)]);
            }
        }
        As[kk * (TILE_M / R) + px.mm / R][px.mm % R] = v;
    }
}

fn mac(acc: ptr<function, Acc>, tx: u32, ty: u32) {
    for (var kk = 0u; kk < TILE_K; kk++) {
        let a = As[kk * (TILE_M / R) + tx];
        let wv = Ws[kk * (TILE_N / R) + ty];
        (*acc).c0 += wv.x * a;
        (*acc).c1 += wv.y * a;
        (*acc).c2 += wv.z * a;
        (*acc).c3 += wv.w * a;
    }
}

fn store_channel(n: u32, m0: u32, v: vec4<f32>) {
    if (n >= p.Cout) { return; }
    var bias = 0.0;
    if (p.has_bias != 0u) { bias = f32(b[n]); }
    let plane = p.OH * p.OW;
    for (var i = 0u; i < R; i++) {
        let m = m0 + i;
        if (m < p.M) { y[((m / plane) * p.Cout + n) * plane + m % plane] = T(v[i] + bias); }
    }
}

fn store(acc: Acc, n0: u32, m0: u32) {
    store_channel(n0, m0, acc.c0);
    store_channel(n0 + 1u, m0, acc.c1);
    store_channel(n0 + 2u, m0, acc.c2);
    store_channel(n0 + 3u, m0, acc.c3);
}

@compute @workgroup_size(TILE_M / 4, TILE_N / 4)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let nthreads = (TILE_M / R) * (TILE_N / R);
    let m0 = (wid.z * p.m_tiles_x + wid.x) * TILE_M;
    let n0 = wid.y * TILE_N;
    let px = pixel(m0, li);
    var acc: Acc;
    for (var k0 = 0u; k0 < p.K; k0 += TILE_K) {
        gather_a(px, k0, li);
        for (var i = li; i < TILE_N * TILE_K; i += nthreads) {
            let kk = i % TILE_K;
            let nn = i / TILE_K;
            let n = n0 + nn;
            let k = k0 + kk;
            var v = 0.0;
            if (n < p.Cout && k < p.K) { v = f32(w[n * p.K + k]); }
            Ws[kk * (TILE_N / R) + nn / R][nn % R] = v;
        }
        workgroupBarrier();
        mac(&acc, lid.x, lid.y);
        workgroupBarrier();
    }
    store(acc, n0 + lid.y * R, m0 + lid.x * R);
}

@compute @workgroup_size(TILE_M / 4, TILE_N / 4)
fn main_vec4(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let nthreads = (TILE_M / R) * (TILE_N / R);
    let kq = TILE_K / R;  // vec4s per slab row of Wm
    let m0 = (wid.z * p.m_tiles_x + wid.x) * TILE_M;
    let n0 = wid.y * TILE_N;
    let px = pixel(m0, li);
    var acc: Acc;
    for (var k0 = 0u; k0 < p.K; k0 += TILE_K) {
        gather_a(px, k0, li);
        for (var i = li; i < TILE_N * kq; i += nthreads) {
            let kk = (i % kq) * R;
            let nn = i / kq;
            let n = n0 + nn;
            let k = k0 + kk;
            var v = vec4<f32>();
            if (n < p.Cout && k < p.K) { v = vec4<f32>(w4[(n * p.K + k) / R]); }
            let col = kk * (TILE_N / R) + nn / R;
            Ws[col][nn % R] = v.x;
            Ws[col + TILE_N / R][nn % R] = v.y;
            Ws[col + 2u * (TILE_N / R)][nn % R] = v.z;
            Ws[col + 3u * (TILE_N / R)][nn % R] = v.w;
        }
        workgroupBarrier();
        mac(&acc, lid.x, lid.y);
        workgroupBarrier();
    }
    store(acc, n0 + lid.y * R, m0 + lid.x * R);
}
