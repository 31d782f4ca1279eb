// Swap the last two axes: x (B, R, C) -> y (B, C, R). Moves activations between the
// convolutional layout (B, C, H*W) and the token layout (B, H*W, C).
struct Params { B: u32, R: u32, C: u32 }
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
    if (i >= p.B * p.R * p.C) { return; }
    let r = i % p.R;
    let c = (i / p.R) % p.C;
    let bi = i / (p.R * p.C);
    y[i] = x[(bi * p.R + r) * p.C + c];
}
