// y = a + b. With `bcast` = 0 the shapes are equal; with `bcast` = 1, a is (B*C, S) and b is
// (B*C): one value per (batch, channel) added over the spatial axis (the ResNet time
// embedding). Each invocation adds two neighbours (n odd: the last adds one), stored as a
// pair: one whole word in f16-storage (scripts/make_packed_shaders.py).
struct Params { n: u32, S: u32, bcast: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> a: array<T>;
@group(0) @binding(2) var<storage, read> b: array<T>;
@group(0) @binding(3) var<storage, read_write> y: array<T>;

fn y_pair(i: u32, v: vec2<f32>) { y[i] = T(v.x); y[i + 1u] = T(v.y); }

fn sum(i: u32) -> f32 {
    var j = i;
    if (p.bcast != 0u) { j = i / p.S; }
    return f32(a[i]) + f32(b[j]);
}

@compute @workgroup_size(256)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let i = 2u * ((wid.y * nwg.x + wid.x) * 256u + li);
    if (i >= p.n) { return; }
    if (i + 1u < p.n) {
        y_pair(i, vec2<f32>(sum(i), sum(i + 1u)));
    } else {
        y[i] = T(sum(i));
    }
}
