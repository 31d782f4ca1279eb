// Direct 2-D convolution, NCHW, one invocation per output element, f32 accumulation.
// x: (B, Cin, H, W), w: (Cout, Cin, KH, KW), b: (Cout), y: (B, Cout, OH, OW)
// Input rows/columns outside [0, H) x [0, W) read as zero (padding pad_t/pad_l before, and
// whatever the output size implies after: this covers PyTorch's symmetric padding and the
// VAE's asymmetric (0, 1, 0, 1) padding before its stride-2 convolutions).
struct Params {
    B: u32, Cin: u32, H: u32, W: u32,
    Cout: u32, OH: u32, OW: u32, KH: u32,
    KW: u32, stride: u32, pad_t: u32, pad_l: u32,
    has_bias: u32,
}
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<T>;
@group(0) @binding(2) var<storage, read> w: array<T>;
@group(0) @binding(3) var<storage, read> b: array<T>;
@group(0) @binding(4) var<storage, read_write> y: array<T>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) g: vec3<u32>) {
    let pix = g.x;
    let co = g.y;
    let bi = g.z;
    if (pix >= p.OH * p.OW) { return; }
    let oy = pix / p.OW;
    let ox = pix % p.OW;
    var acc = 0.0;
    if (p.has_bias != 0u) { acc = f32(b[co]); }
    for (var ci = 0u; ci < p.Cin; ci++) {
        let xbase = (bi * p.Cin + ci) * p.H * p.W;
        let wbase = (co * p.Cin + ci) * p.KH * p.KW;
        for (var ky = 0u; ky < p.KH; ky++) {
            let iy = i32(oy * p.stride + ky) - i32(p.pad_t);
            if (iy < 0 || iy >= i32(p.H)) { continue; }
            for (var kx = 0u; kx < p.KW; kx++) {
                let ix = i32(ox * p.stride + kx) - i32(p.pad_l);
                if (ix < 0 || ix >= i32(p.W)) { continue; }
                acc += f32(x[xbase + u32(iy) * p.W + u32(ix)]) * f32(w[wbase + ky * p.KW + kx]);
            }
        }
    }
    y[((bi * p.Cout + co) * p.OH + oy) * p.OW + ox] = T(acc);
}
