// Multi-head attention, materialised (the plain form), over a chunk of (batch, head) pairs:
//   scores:       S[z, i, j] = scale * sum_d Q[b, i, h*dh + d] K[b, j, h*dh + d]
//   (softmax over j runs as its own op on S)
//   weighted_sum: O[b, i, h*dh + d] = sum_j S[z, i, j] V[b, j, h*dh + d]
// z indexes the chunk, bh = bh0 + z, b = bh / H, h = bh % H.
// Q: rows of q_stride elements (B, Tq, *), K and V: rows of kv_stride elements (B, Tk, *),
// O: (B, Tq, H*dh). S is f32 whatever T is: SD's logits need the range.
struct Params {
    H: u32, Tq: u32, Tk: u32, dh: u32,
    q_stride: u32, kv_stride: u32, bh0: u32, scale: f32,
}
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<T>;
@group(0) @binding(2) var<storage, read> k: array<T>;
@group(0) @binding(3) var<storage, read_write> s: array<f32>;

@compute @workgroup_size(16, 16)
fn scores(@builtin(global_invocation_id) g: vec3<u32>) {
    let j = g.x;
    let i = g.y;
    let z = g.z;
    if (i >= p.Tq || j >= p.Tk) { return; }
    let bh = p.bh0 + z;
    let b = bh / p.H;
    let h = bh % p.H;
    let qo = (b * p.Tq + i) * p.q_stride + h * p.dh;
    let ko = (b * p.Tk + j) * p.kv_stride + h * p.dh;
    var acc = 0.0;
    for (var d = 0u; d < p.dh; d++) { acc += f32(q[qo + d]) * f32(k[ko + d]); }
    s[(z * p.Tq + i) * p.Tk + j] = acc * p.scale;
}

@group(0) @binding(4) var<storage, read> v: array<T>;
@group(0) @binding(5) var<storage, read_write> o: array<T>;

@compute @workgroup_size(16, 16)
fn weighted_sum(@builtin(global_invocation_id) g: vec3<u32>) {
    let d = g.x;
    let i = g.y;
    let z = g.z;
    if (i >= p.Tq || d >= p.dh) { return; }
    let bh = p.bh0 + z;
    let b = bh / p.H;
    let h = bh % p.H;
    var acc = 0.0;
    let srow = (z * p.Tq + i) * p.Tk;
    for (var j = 0u; j < p.Tk; j++) {
        acc += s[srow + j] * f32(v[(b * p.Tk + j) * p.kv_stride + h * p.dh + d]);
    }
    o[(b * p.Tq + i) * (p.H * p.dh) + h * p.dh + d] = T(acc);
}
