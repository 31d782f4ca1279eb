// y = a + b. With `bcast` = 0 the shapes are equal; with `bcast` = 1, a is (B*C, S) and b is
// (B*C): one value per (batch, channel) added over the spatial axis (the ResNet time
// embedding).
struct Params { n: u32, S: u32, bcast: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> a: array<T>;
@group(0) @binding(2) var<storage, read> b: array<T>;
@group(0) @binding(3) var<storage, read_write> y: array<T>;

@compute @workgroup_size(256)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let i = (wid.y * nwg.x + wid.x) * 256u + li;
    if (i >= p.n) { return; }
    var j = i;
    if (p.bcast != 0u) { j = i / p.S; }
    y[i] = T(f32(a[i]) + f32(b[j]));
}
