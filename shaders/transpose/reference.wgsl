// Swap the last two axes: x (B, R, C) -> y (B, C, R). Moves activations between the
// convolutional layout (B, C, H*W) and the token layout (B, H*W, C).
struct Params { B: u32, R: u32, C: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<T>;
@group(0) @binding(2) var<storage, read_write> y: array<T>;

fn element(i: u32) -> f32 {
    let r = i % p.R;
    let c = (i / p.R) % p.C;
    let bi = i / (p.R * p.C);
    return f32(x[(bi * p.R + r) * p.C + c]);
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
    let n = p.B * p.R * p.C;
    if (i >= n) { return; }
    if (i + 1u < n) {
        y_pair(i, vec2<f32>(element(i), element(i + 1u)));
    } else {
        y[i] = T(element(i));
    }
}
