// Nearest-neighbour resize, NCHW: y[b, c, oy, ox] = x[b, c, floor(oy*H/OH), floor(ox*W/OW)].
// 2x upsampling is the common case; other sizes happen when the UNet restores an odd skip size.
struct Params { BC: u32, H: u32, W: u32, OH: u32, OW: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<T>;
@group(0) @binding(2) var<storage, read_write> y: array<T>;

fn element(i: u32) -> f32 {
    let ox = i % p.OW;
    let oy = (i / p.OW) % p.OH;
    let bc = i / (p.OW * p.OH);
    let iy = oy * p.H / p.OH;
    let ix = ox * p.W / p.OW;
    return f32(x[(bc * p.H + iy) * p.W + ix]);
}

fn y_pair(i: u32, v: vec2<f32>) { y[i] = T(v.x); y[i + 1u] = T(v.y); }

// Two neighbours an invocation, stored as a pair (one whole word in f16-storage,
// scripts/make_packed_shaders.py); an odd count's last element alone.
@compute @workgroup_size(256)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let i = 2u * ((wid.y * nwg.x + wid.x) * 256u + li);
    let n = p.BC * p.OH * p.OW;
    if (i >= n) { return; }
    if (i + 1u < n) {
        y_pair(i, vec2<f32>(element(i), element(i + 1u)));
    } else {
        y[i] = T(element(i));
    }
}
