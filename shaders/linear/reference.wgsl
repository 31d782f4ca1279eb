// y = x W^T + b, one invocation per output element, f32 accumulation.
// x: (M, K), W: (N, K) (PyTorch's layout), b: (N), y: (M, N)
struct Params { M: u32, N: u32, K: u32, has_bias: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<T>;
@group(0) @binding(2) var<storage, read> w: array<T>;
@group(0) @binding(3) var<storage, read> b: array<T>;
@group(0) @binding(4) var<storage, read_write> y: array<T>;

@compute @workgroup_size(16, 16)
fn main(@builtin(global_invocation_id) g: vec3<u32>) {
    let n = g.x;
    let m = g.y;
    if (n >= p.N || m >= p.M) { return; }
    var acc = 0.0;
    let xr = m * p.K;
    let wr = n * p.K;
    for (var k = 0u; k < p.K; k++) {
        acc += f32(x[xr + k]) * f32(w[wr + k]);
    }
    if (p.has_bias != 0u) { acc += f32(b[n]); }
    y[m * p.N + n] = T(acc);
}
