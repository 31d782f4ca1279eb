// The row softmax of attention through the GEMM core (engine/variants/attention.py,
// `gemm_softmax`): the core writes S = Q K^T (unscaled, the model's type) for a batch of
// one-head attentions, this pass turns each row into P = softmax(scale * S) in place, and the
// core computes O = P V. One workgroup per row of Tk scores: the row max, then the sum of
// exp2((s - max) * scale * log2(e)), then the normalised values, all in f32; with causal = 1,
// keys j > i (i = the row's query) are masked and written as 0.
struct Params { rows: u32, Tq: u32, Tk: u32, causal: u32, scale: f32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> s: array<T>;  // (rows, Tk), rows = batch * Tq

const WG: u32 = 256u;
const LOG2E = 1.4426950408889634;
const NEG_BIG = -3.0e38;

var<workgroup> red: array<f32, WG>;

fn reduce(li: u32, v: f32, is_max: bool) -> f32 {
    red[li] = v;
    workgroupBarrier();
    for (var h = WG / 2u; h > 0u; h = h >> 1u) {
        if (li < h) {
            if (is_max) { red[li] = max(red[li], red[li + h]); } else { red[li] += red[li + h]; }
        }
        workgroupBarrier();
    }
    let total = red[0];
    workgroupBarrier();  // red is reused by the next reduction
    return total;
}

@compute @workgroup_size(256)
fn softmax_main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let row = wid.y * nwg.x + wid.x;
    if (row >= p.rows) { return; }  // uniform across the workgroup
    let base = row * p.Tk;
    var end = p.Tk;
    if (p.causal != 0u) { end = min(p.Tk, row % p.Tq + 1u); }
    let k = p.scale * LOG2E;
    var m = NEG_BIG;
    for (var j = li; j < end; j += WG) { m = max(m, f32(s[base + j]) * k); }
    m = reduce(li, m, true);
    var l = 0.0;
    for (var j = li; j < end; j += WG) { l += exp2(f32(s[base + j]) * k - m); }
    let inv_l = 1.0 / reduce(li, l, false);
    for (var j = li; j < p.Tk; j += WG) {
        var e = 0.0;
        if (j < end) { e = exp2(f32(s[base + j]) * k - m) * inv_l; }
        s[base + j] = T(e);
    }
}
