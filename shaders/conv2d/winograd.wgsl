// Winograd F(4x4, 3x3) convolution, stride 1, NCHW, all transform arithmetic in f32.
//
//   symbol   meaning                                         layout
//   g        one 3x3 filter of w (Cout, Cin, 3, 3)
//   d        a 6x6 input tile; output tile (ty, tx) reads rows 4ty - pad_t .. +5
//   U        G g G^T, the transformed filters                computed in gemm_main, never stored
//   V        B^T d B, the transformed input tiles            v (36, Cin, PC), f32
//   Mx       sum over ci of U * V, per position xi of 36     mx (36, Cout, PC), f32
//   Y        A^T Mx A + b, a 4x4 output tile                 y (B, Cout, OH, OW)
//   P        B * TH * TW tiles, TH = ceil(OH / 4), TW = ceil(OW / 4)
//   T0, PC   the tiles T0 .. T0 + PC - 1 this round of dispatches computes: the launcher walks
//            P in chunks so V and Mx stay small at any resolution (they are 36 x channels x
//            tiles, e.g. 600 MB each for a 256-channel 512x512 VAE conv in one piece)
//
// Entry points, in the order they run: input_main,
// gemm_main (36 independent (Cout x Cin) @ (Cin x P) products, one per z of the grid) and
// output_main. Interpolation points 0, +-1, +-2 and infinity (Lavin & Gray 2016), the ones
// TFLite GPU's Winograd4x4To36 / Winograd36To4x4 use.
struct Params {
    B: u32, Cin: u32, H: u32, W: u32,
    Cout: u32, OH: u32, OW: u32, pad_t: u32,
    pad_l: u32, TH: u32, TW: u32, P: u32,
    has_bias: u32, T0: u32, PC: u32,
}
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<T>;
@group(0) @binding(2) var<storage, read> w: array<T>;
@group(0) @binding(3) var<storage, read> b: array<T>;
@group(0) @binding(5) var<storage, read_write> v: array<f32>;
@group(0) @binding(6) var<storage, read_write> mx: array<f32>;
@group(0) @binding(7) var<storage, read_write> y: array<T>;

// ---- the three one-dimensional transforms ---------------------------------------------------

// The rows of G (6x3): U = G g G^T, so U[r][c] = G[r] . (g G[c]^T) for position xi = 6r + c.
var<private> G: array<vec3<f32>, 6> = array<vec3<f32>, 6>(
    vec3<f32>(0.25, 0.0, 0.0),
    vec3<f32>(-1.0 / 6.0, -1.0 / 6.0, -1.0 / 6.0),
    vec3<f32>(-1.0 / 6.0, 1.0 / 6.0, -1.0 / 6.0),
    vec3<f32>(1.0 / 24.0, 1.0 / 12.0, 1.0 / 6.0),
    vec3<f32>(1.0 / 24.0, -1.0 / 12.0, 1.0 / 6.0),
    vec3<f32>(0.0, 0.0, 1.0),
);

// U[xi] of filter g = w[co, ci]: nine loads and twelve multiply-adds, so the transformed filters
// (4x the weights) never take memory.
fn u_at(co: u32, ci: u32, gr: vec3<f32>, gc: vec3<f32>) -> f32 {
    let base = (co * p.Cin + ci) * 9u;
    let t = vec3<f32>(
        dot(vec3<f32>(f32(w[base]), f32(w[base + 1u]), f32(w[base + 2u])), gc),
        dot(vec3<f32>(f32(w[base + 3u]), f32(w[base + 4u]), f32(w[base + 5u])), gc),
        dot(vec3<f32>(f32(w[base + 6u]), f32(w[base + 7u]), f32(w[base + 8u])), gc),
    );
    return dot(gr, t);
}

fn bt_col(d: array<f32, 6>) -> array<f32, 6> {  // B^T (6x6) times a column
    return array<f32, 6>(
        4.0 * d[0] - 5.0 * d[2] + d[4],
        -4.0 * (d[1] + d[2]) + d[3] + d[4],
        4.0 * (d[1] - d[2]) - d[3] + d[4],
        2.0 * (d[3] - d[1]) - d[2] + d[4],
        2.0 * (d[1] - d[3]) - d[2] + d[4],
        4.0 * d[1] - 5.0 * d[3] + d[5],
    );
}

fn at_col(m: array<f32, 6>) -> array<f32, 4> {  // A^T (4x6) times a column
    let s12 = m[1] + m[2];
    let d12 = m[1] - m[2];
    let s34 = m[3] + m[4];
    let d34 = m[3] - m[4];
    return array<f32, 4>(m[0] + s12 + s34, d12 + 2.0 * d34, s12 + 4.0 * s34, d12 + 8.0 * d34 + m[5]);
}

fn flat_index(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
    return (wid.y * nwg.x + wid.x) * 256u + lid;
}

// ---- V = B^T d B, one invocation per (ci, tile) ----------------------------------------------

@compute @workgroup_size(256)
fn input_main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let i = flat_index(wid, nwg, lid);
    if (i >= p.Cin * p.PC) { return; }
    let tc = i % p.PC;
    let t = p.T0 + tc;
    let ci = i / p.PC;
    let bi = t / (p.TH * p.TW);
    let ty = (t / p.TW) % p.TH;
    let tx = t % p.TW;
    let plane = (bi * p.Cin + ci) * p.H * p.W;
    let iy0 = i32(ty * 4u) - i32(p.pad_t);
    let ix0 = i32(tx * 4u) - i32(p.pad_l);

    var bd: array<array<f32, 6>, 6>;  // bd[c] = B^T times column c of d
    for (var c = 0u; c < 6u; c++) {
        let ix = ix0 + i32(c);
        var col: array<f32, 6>;
        for (var r = 0u; r < 6u; r++) {
            let iy = iy0 + i32(r);
            var val = 0.0;
            if (iy >= 0 && iy < i32(p.H) && ix >= 0 && ix < i32(p.W)) {
                val = f32(x[plane + u32(iy) * p.W + u32(ix)]);
            }
            col[r] = val;
        }
        bd[c] = bt_col(col);
    }
    for (var r = 0u; r < 6u; r++) {
        let row = bt_col(array<f32, 6>(bd[0][r], bd[1][r], bd[2][r], bd[3][r], bd[4][r], bd[5][r]));
        for (var c = 0u; c < 6u; c++) {
            v[((r * 6u + c) * p.Cin + ci) * p.PC + tc] = row[c];
        }
    }
}

// ---- Mx[xi] = U[xi]^T V[xi]: batched, tiled GEMM (the blocking of implicit_gemm.wgsl) -------
// m = tile (P), n = co (Cout), k = ci (Cin); z of the grid = xi. V is k-major (rows of tiles),
// read row by row, coalesced; the U slab is computed from w while it is staged (u_at).
// Invocation (lid.x, lid.y) owns 4 channels x 4 consecutive tiles.

override TILE_M: u32 = 64;  // tiles per workgroup tile, multiple of 4
override TILE_N: u32 = 64;  // output channels per workgroup tile, multiple of 16
override TILE_K: u32 = 16;  // input channels per staged slab
const R: u32 = 4u;

var<workgroup> Vs: array<vec4<f32>, TILE_K * TILE_M / R>;  // [kk][m/4]
var<workgroup> Us: array<vec4<f32>, TILE_K * TILE_N / R>;  // [kk][n/4]

fn store_mx(xi: u32, n: u32, m0: u32, acc: vec4<f32>) {
    if (n >= p.Cout) { return; }
    for (var i = 0u; i < R; i++) {
        if (m0 + i < p.PC) { mx[(xi * p.Cout + n) * p.PC + m0 + i] = acc[i]; }
    }
}

@compute @workgroup_size(TILE_M / 4, TILE_N / 4)
fn gemm_main(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
) {
    let nthreads = (TILE_M / R) * (TILE_N / R);
    let m0 = wid.x * TILE_M;
    let n0 = wid.y * TILE_N;
    let xi = wid.z;
    let vbase = xi * p.Cin * p.PC;
    let gr = G[xi / 6u];
    let gc = G[xi % 6u];

    var c0 = vec4<f32>();
    var c1 = vec4<f32>();
    var c2 = vec4<f32>();
    var c3 = vec4<f32>();
    for (var k0 = 0u; k0 < p.Cin; k0 += TILE_K) {
        for (var i = li; i < TILE_K * TILE_M; i += nthreads) {
            let mm = i % TILE_M;
            let kk = i / TILE_M;
            var val = 0.0;
            if (m0 + mm < p.PC && k0 + kk < p.Cin) { val = v[vbase + (k0 + kk) * p.PC + m0 + mm]; }
            Vs[kk * (TILE_M / R) + mm / R][mm % R] = val;
        }
        for (var i = li; i < TILE_K * TILE_N; i += nthreads) {
            let kk = i % TILE_K;  // consecutive invocations read consecutive filters of w
            let nn = i / TILE_K;
            var val = 0.0;
            if (n0 + nn < p.Cout && k0 + kk < p.Cin) { val = u_at(n0 + nn, k0 + kk, gr, gc); }
            Us[kk * (TILE_N / R) + nn / R][nn % R] = val;
        }
        workgroupBarrier();
        for (var kk = 0u; kk < TILE_K; kk++) {
            let a = Vs[kk * (TILE_M / R) + lid.x];
            let c = Us[kk * (TILE_N / R) + lid.y];
            c0 += c.x * a;
            c1 += c.y * a;
            c2 += c.z * a;
            c3 += c.w * a;
        }
        workgroupBarrier();
    }
    let n = n0 + lid.y * R;
    let m = m0 + lid.x * R;
    store_mx(xi, n, m, c0);
    store_mx(xi, n + 1u, m, c1);
    store_mx(xi, n + 2u, m, c2);
    store_mx(xi, n + 3u, m, c3);
}

// ---- Y = A^T Mx A + b, one invocation per (co, tile); partial edge tiles clipped --------------

fn y_pair(i: u32, v: vec2<f32>) { y[i] = T(v.x); y[i + 1u] = T(v.y); }

@compute @workgroup_size(256)
fn output_main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let i = flat_index(wid, nwg, lid);
    if (i >= p.Cout * p.PC) { return; }
    let tc = i % p.PC;
    let t = p.T0 + tc;
    let co = i / p.PC;
    let bi = t / (p.TH * p.TW);
    let ty = (t / p.TW) % p.TH;
    let tx = t % p.TW;
    let stride = p.Cout * p.PC;  // between consecutive positions xi
    let base = co * p.PC + tc;

    var am: array<array<f32, 4>, 6>;  // am[c] = A^T times column c of Mx
    for (var c = 0u; c < 6u; c++) {
        var col: array<f32, 6>;
        for (var r = 0u; r < 6u; r++) { col[r] = mx[(r * 6u + c) * stride + base]; }
        am[c] = at_col(col);
    }
    var bias = 0.0;
    if (p.has_bias != 0u) { bias = f32(b[co]); }
    let out = (bi * p.Cout + co) * p.OH * p.OW;
    for (var r = 0u; r < 4u; r++) {
        let oy = ty * 4u + r;
        if (oy >= p.OH) { break; }
        let row = at_col(array<f32, 6>(am[0][r], am[1][r], am[2][r], am[3][r], am[4][r], am[5][r]));
        if (p.OW % 2u == 0u) {  // rows start on a word: pairs (one whole word each in f16-storage)
            for (var c = 0u; c < 4u; c += 2u) {
                let ox = tx * 4u + c;
                if (ox >= p.OW) { break; }
                y_pair(out + oy * p.OW + ox, vec2<f32>(row[c] + bias, row[c + 1u] + bias));
            }
        } else {
            for (var c = 0u; c < 4u; c++) {
                let ox = tx * 4u + c;
                if (ox >= p.OW) { break; }
                y[out + oy * p.OW + ox] = T(row[c] + bias);
            }
        }
    }
}
