// Nearest-neighbour resize, NCHW: y[b, c, oy, ox] = x[b, c, floor(oy*H/OH), floor(ox*W/OW)].
// 2x upsampling is the common case; other sizes happen when the UNet restores an odd skip size.
struct Params { BC: u32, H: u32, W: u32, OH: u32, OW: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<T>;
@group(0) @binding(2) var<storage, read_write> y: array<T>;

@compute @workgroup_size(256)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let i = (wid.y * nwg.x + wid.x) * 256u + li;
    if (i >= p.BC * p.OH * p.OW) { return; }
    let ox = i % p.OW;
    let oy = (i / p.OW) % p.OH;
    let bc = i / (p.OW * p.OH);
    let iy = oy * p.H / p.OH;
    let ix = ox * p.W / p.OW;
    y[i] = x[(bc * p.H + iy) * p.W + ix];
}
