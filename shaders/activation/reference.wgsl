// Element-wise activations, chosen by the override ACT:
//   0 SiLU        x * sigmoid(x)
//   1 GELU        x * Phi(x), Phi through erf (Abramowitz-Stegun 7.1.26, |error| <= 1.5e-7)
//   2 QuickGELU   x * sigmoid(1.702 x)   (CLIP)
override ACT: u32 = 0u;
struct Params { n: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<T>;
@group(0) @binding(2) var<storage, read_write> y: array<T>;

// WGSL has no erf. 7.1.26 is a rational-exponential fit valid for x >= 0; odd symmetry
// gives the rest. exp() of a large negative argument underflows to 0, which is the limit.
fn erf_approx(z: f32) -> f32 {
    let a = abs(z);
    let t = 1.0 / (1.0 + 0.3275911 * a);
    let poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))));
    return sign(z) * (1.0 - poly * exp(-a * a));
}

fn sigmoid(v: f32) -> f32 { return 1.0 / (1.0 + exp(-v)); }

@compute @workgroup_size(256)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let i = (wid.y * nwg.x + wid.x) * 256u + li;
    if (i >= p.n) { return; }
    let v = f32(x[i]);
    var r: f32;
    switch ACT {
        case 1u: { r = 0.5 * v * (1.0 + erf_approx(v * 0.7071067811865476)); }
        case 2u: { r = v * sigmoid(1.702 * v); }
        default: { r = v * sigmoid(v); }
    }
    y[i] = T(r);
}
