// The unfolded input of a convolution (im2col), for the GEMM core's product W (Cout x K) by
// X_col[b] (K x P): X_col[b, k, p] = x[b, c, oy * stride - pad_top + ky, ox * stride - pad_left + kx]
// (0 outside the image), k = (c * KH + ky) * KW + kx (the order of a weight row), p = oy * OW + ox.
// Two elements of X_col an invocation, the whole batch's.
struct Params {
    Cin: u32, H: u32, W: u32, KH: u32,
    KW: u32, stride: u32, pad_top: u32, pad_left: u32,
    OH: u32, OW: u32, n: u32,
}
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<T>;
@group(0) @binding(2) var<storage, read_write> col: array<T>;  // (B, Cin * KH * KW, OH * OW)

fn col_pair(i: u32, v: vec2<f32>) { col[i] = T(v.x); col[i + 1u] = T(v.y); }

fn element(i: u32) -> f32 {
    let npix = p.OH * p.OW;
    let kk = p.Cin * p.KH * p.KW;
    let pix = i % npix;
    let k = (i / npix) % kk;
    let b = i / (npix * kk);
    let c = k / (p.KH * p.KW);
    let ky = (k / p.KW) % p.KH;
    let kx = k % p.KW;
    // signed: the padding reaches above and left of the image
    let iy = i32((pix / p.OW) * p.stride + ky) - i32(p.pad_top);
    let ix = i32((pix % p.OW) * p.stride + kx) - i32(p.pad_left);
    if (iy >= 0 && ix >= 0 && iy < i32(p.H) && ix < i32(p.W)) {
        return f32(x[((b * p.Cin + c) * p.H + u32(iy)) * p.W + u32(ix)]);
    }
    return 0.0;
}

// Two neighbours an invocation, stored as a pair (one whole word in f16-storage,
// scripts/make_packed_shaders.py); an odd count's last element alone.
@compute @workgroup_size(256)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let i = 2u * ((wid.y * nwg.x + wid.x) * 256u + li);
    if (i >= p.n) { return; }
    if (i + 1u < p.n) {
        col_pair(i, vec2<f32>(element(i), element(i + 1u)));
    } else {
        col[i] = T(element(i));
    }
}
