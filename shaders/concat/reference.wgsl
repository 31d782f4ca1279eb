// Channel concatenation: a (B, Ca, S) and b (B, Cb, S) -> y (B, Ca + Cb, S).
struct Params { B: u32, Ca: u32, Cb: u32, S: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> a: array<T>;
@group(0) @binding(2) var<storage, read> b: array<T>;
@group(0) @binding(3) var<storage, read_write> y: array<T>;

fn y_pair(i: u32, v: vec2<f32>) { y[i] = T(v.x); y[i + 1u] = T(v.y); }

fn element(i: u32) -> f32 {
    let C = p.Ca + p.Cb;
    let s = i % p.S;
    let c = (i / p.S) % C;
    let bi = i / (p.S * C);
    if (c < p.Ca) { return f32(a[(bi * p.Ca + c) * p.S + s]); }
    return f32(b[(bi * p.Cb + (c - p.Ca)) * p.S + s]);
}

// Two neighbours an invocation, stored as a pair (one whole word in f16-storage); an odd
// count's last element alone.
@compute @workgroup_size(256)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let i = 2u * ((wid.y * nwg.x + wid.x) * 256u + li);
    let n = p.B * (p.Ca + p.Cb) * p.S;
    if (i >= n) { return; }
    if (i + 1u < n) {
        y_pair(i, vec2<f32>(element(i), element(i + 1u)));
    } else {
        y[i] = T(element(i));
    }
}
