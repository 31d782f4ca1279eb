// Row softmax in place over the last dimension, in f32, one workgroup per row.
// s: (R, N). With causal = 1 the rows are grouped by Tq (query index i = row % Tq) and
// columns j > i get probability 0 (CLIP's causal mask).
struct Params { R: u32, N: u32, Tq: u32, causal: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> s: array<f32>;

var<workgroup> partial: array<f32, 256>;

@compute @workgroup_size(256)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let row = wid.y * nwg.x + wid.x;
    if (row >= p.R) { return; }
    let base = row * p.N;
    var limit = p.N;
    if (p.causal != 0u) { limit = min(p.N, row % p.Tq + 1u); }

    var m = -3.0e38;
    for (var j = li; j < limit; j += 256u) { m = max(m, s[base + j]); }
    partial[li] = m;
    workgroupBarrier();
    for (var k = 128u; k > 0u; k = k >> 1u) {
        if (li < k) { partial[li] = max(partial[li], partial[li + k]); }
        workgroupBarrier();
    }
    let row_max = partial[0];
    workgroupBarrier();

    var total = 0.0;
    for (var j = li; j < limit; j += 256u) { total += exp(s[base + j] - row_max); }
    partial[li] = total;
    workgroupBarrier();
    for (var k = 128u; k > 0u; k = k >> 1u) {
        if (li < k) { partial[li] += partial[li + k]; }
        workgroupBarrier();
    }
    let inv = 1.0 / partial[0];
    for (var j = li; j < p.N; j += 256u) {
        if (j < limit) { s[base + j] = exp(s[base + j] - row_max) * inv; } else { s[base + j] = 0.0; }
    }
}
