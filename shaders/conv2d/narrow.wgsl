// Direct 2-D convolution for a few output channels (Cout <= OUTS: the UNet's conv_out to the 4
// latent channels, the VAE decoder's conv_out to 3 colours), NCHW, f32 accumulation: one
// invocation per output pixel computes all Cout channels (one vec4 of f32 sums, a register block
// as in the GEMM core: no array indexed in a loop), so each input element is read once per tap
// instead of once per output channel, and no GEMM tile is mostly padding. Weights are the same
// address across the workgroup (broadcast reads); channels past Cout read channel Cout - 1's and
// are never written.
// x: (B, Cin, H, W), w: (Cout, Cin, KH, KW), b: (Cout), y: (B, Cout, OH, OW); zero padding as the
// reference kernel (pad_t/pad_l before, whatever the output size implies after).
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
    let bi = g.z;
    if (pix >= p.OH * p.OW) { return; }
    let oy = pix / p.OW;
    let ox = pix % p.OW;
    var acc = vec4<f32>(0.0);
    let taps = p.KH * p.KW;
    let last = p.Cout - 1u;
    let wstride = p.Cin * taps;  // one output channel's weights
    for (var ci = 0u; ci < p.Cin; ci++) {
        let xbase = (bi * p.Cin + ci) * p.H * p.W;
        for (var ky = 0u; ky < p.KH; ky++) {
            let iy = i32(oy * p.stride + ky) - i32(p.pad_t);
            for (var kx = 0u; kx < p.KW; kx++) {
                let ix = i32(ox * p.stride + kx) - i32(p.pad_l);
                let inside = iy >= 0 && iy < i32(p.H) && ix >= 0 && ix < i32(p.W);
                let at = xbase + u32(clamp(iy, 0, i32(p.H) - 1)) * p.W + u32(clamp(ix, 0, i32(p.W) - 1));
                let v = select(0.0, f32(x[at]), inside);
                let tap = ci * taps + ky * p.KW + kx;
                acc += v * vec4<f32>(f32(w[tap]), f32(w[min(1u, last) * wstride + tap]),
                                     f32(w[min(2u, last) * wstride + tap]), f32(w[min(3u, last) * wstride + tap]));
            }
        }
    }
    for (var o = 0u; o < p.Cout; o++) {
        var v = acc[o];
        if (p.has_bias != 0u) { v += f32(b[o]); }
        y[((bi * p.Cout + o) * p.OH + oy) * p.OW + ox] = T(v);
    }
}
