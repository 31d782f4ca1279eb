// Channel concatenation: a (B, Ca, S) and b (B, Cb, S) -> y (B, Ca + Cb, S).
struct Params { B: u32, Ca: u32, Cb: u32, S: u32 }
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
    let C = p.Ca + p.Cb;
    if (i >= p.B * C * p.S) { return; }
    let s = i % p.S;
    let c = (i / p.S) % C;
    let bi = i / (p.S * C);
    if (c < p.Ca) {
        y[i] = a[(bi * p.Ca + c) * p.S + s];
    } else {
        y[i] = b[(bi * p.Cb + (c - p.Ca)) * p.S + s];
    }
}
