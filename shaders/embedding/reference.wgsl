// Token plus position embedding: y[b, t, :] = tok[ids[b, t], :] + pos[t, :].
// ids: (B, T) u32; tok: (V, D); pos: (P, D) with P >= T; y: (B, T, D).
struct Params { B: u32, T: u32, D: u32, V: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> ids: array<u32>;
@group(0) @binding(2) var<storage, read> tok: array<T>;
@group(0) @binding(3) var<storage, read> pos: array<T>;
@group(0) @binding(4) var<storage, read_write> y: array<T>;

@compute @workgroup_size(256)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let i = (wid.y * nwg.x + wid.x) * 256u + li;
    if (i >= p.B * p.T * p.D) { return; }
    let d = i % p.D;
    let bt = i / p.D;
    let t = bt % p.T;
    let id = min(ids[bt], p.V - 1u);  // ids are validated on the host; clamp keeps reads in bounds
    y[i] = T(f32(tok[id * p.D + d]) + f32(pos[t * p.D + d]));
}
