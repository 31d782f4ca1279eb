// GEGLU: the projection's output (M, 2F) is split into value and gate halves along the last
// dimension; y = value * GELU(gate), y: (M, F). GELU is the exact (erf) form.
struct Params { M: u32, F: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<T>;
@group(0) @binding(2) var<storage, read_write> y: array<T>;

fn erf_approx(z: f32) -> f32 {
    let a = abs(z);
    let t = 1.0 / (1.0 + 0.3275911 * a);
    let poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))));
    return sign(z) * (1.0 - poly * exp(-a * a));
}

fn element(i: u32) -> f32 {
    let m = i / p.F;
    let f = i % p.F;
    let value = f32(x[m * 2u * p.F + f]);
    let gate = f32(x[m * 2u * p.F + p.F + f]);
    return value * 0.5 * gate * (1.0 + erf_approx(gate * 0.7071067811865476));
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
    let n = p.M * p.F;
    if (i >= n) { return; }
    if (i + 1u < n) {
        y_pair(i, vec2<f32>(element(i), element(i + 1u)));
    } else {
        y[i] = T(element(i));
    }
}
