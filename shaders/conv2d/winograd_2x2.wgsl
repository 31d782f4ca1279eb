// Winograd F(2x2, 3x3) through the GEMM core (shaders/linear/gemm.wgsl), stride 1, NCHW, the
// transforms' arithmetic in f32 and the transformed operands stored as T (f16 for f16 models).
// F(2x2) and not F(4x4): its transforms hold only 0, +-1 and +-1/2, so f16 operands and f16
// products stay within 2x of the output's own f16 rounding (F(4x4)'s points +-2 amplify each
// f16 rounding about 10x, about 1% of the output: beyond the fp16 tolerance).
//
//   symbol   meaning                                          layout
//   U        G g G^T, the transformed filters of output       u (16, CC, Cin): A of the core,
//            channels CO0 .. CO0 + CC - 1                     M = CC, K = Cin
//   V        B^T d B, the transformed input tiles T0 ..        v (16, Cin, PCP): B of the core,
//            T0 + PC - 1, zero past the chunk                 stored K x N, N = PCP
//   Mx       U V, per position xi of 16                       mx (16, CC, PCP): C of the core
//   Y        A^T Mx A + b (+ r), the 2x2 output tiles          y (B, Cout, OH, OW)
//   r        a residual added in the output transform          r (B, Cout, OH, OW), if HAS_RES
//            (a ResNet block's shortcut), before Y's rounding
//   PCP      PC rounded up to a multiple of 4 (the core's vec4 rows)
//
// Entry points, in the order the launcher runs them: filter_main (once per channel chunk),
// input_main, then the core's 16 products, then output_main. The transforms are written out
// straight, with no arrays: on some drivers an array in a loop lives in local memory. The two
// input transforms write U and V in vec2<T> pairs (Cin and PCP are multiples of 4, so a pair
// never straddles a row): each invocation transforms two neighbouring filters or tiles, and in
// f16-storage a pair is one whole u32 word, where a lone half costs two global atomics.
//   B^T = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1], G = [1 0 0; .5 .5 .5; .5 -.5 .5; 0 0 1],
//   A^T = [1 1 1 0; 0 1 -1 -1]   (Lavin & Gray 2016)
struct Params {
    B: u32, Cin: u32, H: u32, W: u32,
    Cout: u32, OH: u32, OW: u32, pad_t: u32,
    pad_l: u32, TH: u32, TW: u32, P: u32,
    has_bias: u32, T0: u32, PC: u32, PCP: u32,
    CO0: u32, CC: u32, has_res: u32,
}
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<T>;
@group(0) @binding(2) var<storage, read> w: array<T>;
@group(0) @binding(3) var<storage, read> b: array<T>;
@group(0) @binding(4) var<storage, read_write> u: array<vec2<T>>;
@group(0) @binding(5) var<storage, read_write> v: array<vec2<T>>;
@group(0) @binding(6) var<storage, read> mx: array<T>;
@group(0) @binding(7) var<storage, read_write> y: array<T>;
@group(0) @binding(8) var<storage, read> r: array<T>;

fn flat_index(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
    return (wid.y * nwg.x + wid.x) * 256u + lid;
}

// ---- U = G g G^T, one invocation per (co in the chunk, ci) -----------------------------------

// A 4x4 block of 16 transformed values, row r = positions 4r .. 4r + 3.
struct Tile { r0: vec4<f32>, r1: vec4<f32>, r2: vec4<f32>, r3: vec4<f32> }

// U of output channel CO0 + cc and input channel ci: t = g G^T by rows, U = G t.
fn filter_tile(cc: u32, ci: u32) -> Tile {
    let base = ((p.CO0 + cc) * p.Cin + ci) * 9u;
    let g00 = f32(w[base + 0u]); let g01 = f32(w[base + 1u]); let g02 = f32(w[base + 2u]);
    let g10 = f32(w[base + 3u]); let g11 = f32(w[base + 4u]); let g12 = f32(w[base + 5u]);
    let g20 = f32(w[base + 6u]); let g21 = f32(w[base + 7u]); let g22 = f32(w[base + 8u]);
    let t0 = vec4<f32>(g00, 0.5 * (g00 + g01 + g02), 0.5 * (g00 - g01 + g02), g02);
    let t1 = vec4<f32>(g10, 0.5 * (g10 + g11 + g12), 0.5 * (g10 - g11 + g12), g12);
    let t2 = vec4<f32>(g20, 0.5 * (g20 + g21 + g22), 0.5 * (g20 - g21 + g22), g22);
    return Tile(t0, 0.5 * (t0 + t1 + t2), 0.5 * (t0 - t1 + t2), t2);
}

// Row r of two tiles (lo, hi) as pairs at positions 4r .. 4r + 3, xs pairs apart.
fn put_u(at: u32, xs: u32, lo: vec4<f32>, hi: vec4<f32>) {
    u[at] = vec2<T>(vec2<f32>(lo.x, hi.x));
    u[at + xs] = vec2<T>(vec2<f32>(lo.y, hi.y));
    u[at + 2u * xs] = vec2<T>(vec2<f32>(lo.z, hi.z));
    u[at + 3u * xs] = vec2<T>(vec2<f32>(lo.w, hi.w));
}

fn put_v(at: u32, xs: u32, lo: vec4<f32>, hi: vec4<f32>) {
    v[at] = vec2<T>(vec2<f32>(lo.x, hi.x));
    v[at + xs] = vec2<T>(vec2<f32>(lo.y, hi.y));
    v[at + 2u * xs] = vec2<T>(vec2<f32>(lo.z, hi.z));
    v[at + 3u * xs] = vec2<T>(vec2<f32>(lo.w, hi.w));
}

// ---- U = G g G^T, one invocation per (co in the chunk, input channels ci, ci + 1) -----------

@compute @workgroup_size(256)
fn filter_main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let i = flat_index(wid, nwg, lid);
    let pairs = p.Cin / 2u;
    if (i >= p.CC * pairs) { return; }
    let ci = (i % pairs) * 2u;
    let cc = i / pairs;
    let at = (cc * p.Cin + ci) / 2u;  // in pairs
    let xs = p.CC * p.Cin / 2u;  // pairs between consecutive positions xi
    let lo = filter_tile(cc, ci);
    let hi = filter_tile(cc, ci + 1u);
    put_u(at, xs, lo.r0, hi.r0);
    put_u(at + 4u * xs, xs, lo.r1, hi.r1);
    put_u(at + 8u * xs, xs, lo.r2, hi.r2);
    put_u(at + 12u * xs, xs, lo.r3, hi.r3);
}

// ---- V = B^T d B, one invocation per (ci, tiles tc, tc + 1 of the chunk) ---------------------

fn tap(plane: u32, iy: i32, ix: i32) -> f32 {
    if (iy < 0 || iy >= i32(p.H) || ix < 0 || ix >= i32(p.W)) { return 0.0; }
    return f32(x[plane + u32(iy) * p.W + u32(ix)]);
}

// V of input channel ci and tile tc of the chunk (zero for the padding columns past PC, so
// they add nothing): d, the 4x4 input tile (zero outside the image); e = B^T d; V = e B.
fn input_tile(ci: u32, tc: u32) -> Tile {
    if (tc >= p.PC) { return Tile(); }
    let t = p.T0 + tc;
    let bi = t / (p.TH * p.TW);
    let ty = (t / p.TW) % p.TH;
    let tx = t % p.TW;
    let plane = (bi * p.Cin + ci) * p.H * p.W;
    let iy0 = i32(ty * 2u) - i32(p.pad_t);
    let ix0 = i32(tx * 2u) - i32(p.pad_l);
    let d00 = tap(plane, iy0 + 0, ix0 + 0); let d01 = tap(plane, iy0 + 0, ix0 + 1); let d02 = tap(plane, iy0 + 0, ix0 + 2); let d03 = tap(plane, iy0 + 0, ix0 + 3);
    let d10 = tap(plane, iy0 + 1, ix0 + 0); let d11 = tap(plane, iy0 + 1, ix0 + 1); let d12 = tap(plane, iy0 + 1, ix0 + 2); let d13 = tap(plane, iy0 + 1, ix0 + 3);
    let d20 = tap(plane, iy0 + 2, ix0 + 0); let d21 = tap(plane, iy0 + 2, ix0 + 1); let d22 = tap(plane, iy0 + 2, ix0 + 2); let d23 = tap(plane, iy0 + 2, ix0 + 3);
    let d30 = tap(plane, iy0 + 3, ix0 + 0); let d31 = tap(plane, iy0 + 3, ix0 + 1); let d32 = tap(plane, iy0 + 3, ix0 + 2); let d33 = tap(plane, iy0 + 3, ix0 + 3);
    let e00 = d00 - d20; let e10 = d10 + d20; let e20 = d20 - d10; let e30 = d10 - d30;
    let e01 = d01 - d21; let e11 = d11 + d21; let e21 = d21 - d11; let e31 = d11 - d31;
    let e02 = d02 - d22; let e12 = d12 + d22; let e22 = d22 - d12; let e32 = d12 - d32;
    let e03 = d03 - d23; let e13 = d13 + d23; let e23 = d23 - d13; let e33 = d13 - d33;
    return Tile(vec4<f32>(e00 - e02, e01 + e02, e02 - e01, e01 - e03),
                vec4<f32>(e10 - e12, e11 + e12, e12 - e11, e11 - e13),
                vec4<f32>(e20 - e22, e21 + e22, e22 - e21, e21 - e23),
                vec4<f32>(e30 - e32, e31 + e32, e32 - e31, e31 - e33));
}

@compute @workgroup_size(256)
fn input_main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let i = flat_index(wid, nwg, lid);
    let pairs = p.PCP / 2u;
    if (i >= p.Cin * pairs) { return; }
    let tc = (i % pairs) * 2u;
    let ci = i / pairs;
    let xs = p.Cin * pairs;  // pairs between consecutive positions xi
    let at = ci * pairs + tc / 2u;
    let lo = input_tile(ci, tc);
    let hi = input_tile(ci, tc + 1u);
    put_v(at, xs, lo.r0, hi.r0);
    put_v(at + 4u * xs, xs, lo.r1, hi.r1);
    put_v(at + 8u * xs, xs, lo.r2, hi.r2);
    put_v(at + 12u * xs, xs, lo.r3, hi.r3);
}

// ---- Y = A^T Mx A + b (+ r), one invocation per (co in the chunk, tile of the chunk) ---------

fn y_pair(i: u32, v: vec2<f32>) { y[i] = T(v.x); y[i + 1u] = T(v.y); }

// Output pixels (oy, ox) and (oy, ox + 1), ox even and OW even: a pair (one whole word in
// f16-storage, scripts/make_packed_shaders.py).
fn put2(out: u32, oy: u32, ox: u32, val: vec2<f32>) {
    if (oy < p.OH && ox < p.OW) {
        let at = out + oy * p.OW + ox;
        if (p.has_res != 0u) {
            y_pair(at, val + vec2<f32>(f32(r[at]), f32(r[at + 1u])));
        } else {
            y_pair(at, val);
        }
    }
}

fn put(out: u32, oy: u32, ox: u32, val: f32) {
    if (oy < p.OH && ox < p.OW) {
        let at = out + oy * p.OW + ox;
        if (p.has_res != 0u) {
            y[at] = T(val + f32(r[at]));
        } else {
            y[at] = T(val);
        }
    }
}

@compute @workgroup_size(256)
fn output_main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let i = flat_index(wid, nwg, lid);
    if (i >= p.CC * p.PC) { return; }
    let tc = i % p.PC;
    let cc = i / p.PC;
    let co = p.CO0 + cc;
    let t = p.T0 + tc;
    let bi = t / (p.TH * p.TW);
    let ty = (t / p.TW) % p.TH;
    let tx = t % p.TW;
    let xs = p.CC * p.PCP;
    let base = cc * p.PCP + tc;
    var bias = 0.0;
    if (p.has_bias != 0u) { bias = f32(b[co]); }
    let out = (bi * p.Cout + co) * p.OH * p.OW;
    let m00 = f32(mx[base + 0u * xs]); let m01 = f32(mx[base + 1u * xs]); let m02 = f32(mx[base + 2u * xs]); let m03 = f32(mx[base + 3u * xs]);
    let m10 = f32(mx[base + 4u * xs]); let m11 = f32(mx[base + 5u * xs]); let m12 = f32(mx[base + 6u * xs]); let m13 = f32(mx[base + 7u * xs]);
    let m20 = f32(mx[base + 8u * xs]); let m21 = f32(mx[base + 9u * xs]); let m22 = f32(mx[base + 10u * xs]); let m23 = f32(mx[base + 11u * xs]);
    let m30 = f32(mx[base + 12u * xs]); let m31 = f32(mx[base + 13u * xs]); let m32 = f32(mx[base + 14u * xs]); let m33 = f32(mx[base + 15u * xs]);
    let a00 = m00 + m10 + m20; let a10 = m10 - m20 - m30;
    let a01 = m01 + m11 + m21; let a11 = m11 - m21 - m31;
    let a02 = m02 + m12 + m22; let a12 = m12 - m22 - m32;
    let a03 = m03 + m13 + m23; let a13 = m13 - m23 - m33;
    if (p.OW % 2u == 0u) {
        put2(out, ty * 2u + 0u, tx * 2u, vec2<f32>(a00 + a01 + a02 + bias, a01 - a02 - a03 + bias));
        put2(out, ty * 2u + 1u, tx * 2u, vec2<f32>(a10 + a11 + a12 + bias, a11 - a12 - a13 + bias));
    } else {
        put(out, ty * 2u + 0u, tx * 2u + 0u, a00 + a01 + a02 + bias);
        put(out, ty * 2u + 0u, tx * 2u + 1u, a01 - a02 - a03 + bias);
        put(out, ty * 2u + 1u, tx * 2u + 0u, a10 + a11 + a12 + bias);
        put(out, ty * 2u + 1u, tx * 2u + 1u, a11 - a12 - a13 + bias);
    }
}
