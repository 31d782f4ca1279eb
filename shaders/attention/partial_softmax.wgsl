// Attention with a partially fused softmax ("Speed Is All You Need", section 3.1), over a
// chunk of (batch, head) pairs; z indexes the chunk, bh = bh0 + z, b = bh / H, h = bh % H.
//   scores:       A[z, i, j] = scale * sum_d Q[b, i, h*dh + d] K[b, j, h*dh + d]   (f32, stored)
//   row_stats:    L[z, i] = max_j A[z, i, j],  S[z, i] = sum_j exp(A[z, i, j] - L[z, i])
//   weighted_sum: O[b, i, h*dh + d] = sum_j exp(A[z, i, j] - L[z, i]) / S[z, i] V[b, j, h*dh + d]
// softmax(A) is never stored: the normalisation happens while the A tile is staged for the
// matmul with V. With causal = 1, entries j > i are masked (CLIP); they are neither read nor
// written, so A may hold garbage there.
// Q: rows of q_stride elements (B, Tq, *), K and V: rows of kv_stride elements (B, Tk, *),
// O: (B, Tq, H*dh). stats: (rows, 2) f32 pairs (L, S), rows = chunk * Tq.
struct Params {
    H: u32, Tq: u32, Tk: u32, dh: u32,
    q_stride: u32, kv_stride: u32, bh0: u32, scale: f32,
    causal: u32, rows: u32,
}
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<T>;
@group(0) @binding(2) var<storage, read> k: array<T>;
@group(0) @binding(3) var<storage, read_write> a: array<f32>;
@group(0) @binding(4) var<storage, read> v: array<T>;
@group(0) @binding(5) var<storage, read_write> o: array<T>;
@group(0) @binding(6) var<storage, read_write> stats: array<f32>;

const TILE = 16u;
const NEG_BIG = -3.0e38;  // "minus infinity" that stays finite through exp(x - m)

var<workgroup> tile_a: array<f32, 256>;  // (TILE, TILE)
var<workgroup> tile_b: array<f32, 256>;  // (TILE, TILE)

// One workgroup per 16x16 tile of A; the head dimension is walked in 16-wide slabs staged in
// workgroup memory.
@compute @workgroup_size(16, 16)
fn scores(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let z = wid.z;
    let i0 = wid.y * TILE;
    let j0 = wid.x * TILE;
    // Tiles wholly above the diagonal are masked in every later use.
    if (p.causal != 0u && j0 > i0 + TILE - 1u) { return; }
    let bh = p.bh0 + z;
    let b = bh / p.H;
    let h = bh % p.H;
    let tx = lid.x;
    let ty = lid.y;
    var acc = 0.0;
    for (var d0 = 0u; d0 < p.dh; d0 += TILE) {
        let d = d0 + tx;
        var qv = 0.0;
        var kv = 0.0;
        if (i0 + ty < p.Tq && d < p.dh) { qv = f32(q[(b * p.Tq + i0 + ty) * p.q_stride + h * p.dh + d]); }
        if (j0 + ty < p.Tk && d < p.dh) { kv = f32(k[(b * p.Tk + j0 + ty) * p.kv_stride + h * p.dh + d]); }
        tile_a[ty * TILE + tx] = qv;  // [i][d]
        tile_b[ty * TILE + tx] = kv;  // [j][d]
        workgroupBarrier();
        for (var dd = 0u; dd < TILE; dd++) { acc += tile_a[ty * TILE + dd] * tile_b[tx * TILE + dd]; }
        workgroupBarrier();
    }
    let i = i0 + ty;
    let j = j0 + tx;
    if (i < p.Tq && j < p.Tk) { a[(z * p.Tq + i) * p.Tk + j] = acc * p.scale; }
}

var<workgroup> part_m: array<f32, 256>;
var<workgroup> part_s: array<f32, 256>;

// One workgroup per row of A, in one dispatch: each invocation folds a strided block of the
// row into a running (max, sum) pair, then the 256 pairs are merged in a tree with
// (m1, s1) + (m2, s2) = (m, s1 exp(m1 - m) + s2 exp(m2 - m)), m = max(m1, m2).
@compute @workgroup_size(256)
fn row_stats(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let row = wid.y * nwg.x + wid.x;
    if (row >= p.rows) { return; }
    var limit = p.Tk;
    if (p.causal != 0u) { limit = min(p.Tk, row % p.Tq + 1u); }
    let base = row * p.Tk;
    var m = NEG_BIG;
    var s = 0.0;
    for (var j = li; j < limit; j += 256u) {
        let x = a[base + j];
        if (x > m) { s = s * exp(m - x) + 1.0; m = x; } else { s += exp(x - m); }
    }
    part_m[li] = m;
    part_s[li] = s;
    workgroupBarrier();
    for (var w = 128u; w > 0u; w = w >> 1u) {
        if (li < w) {
            let m1 = part_m[li];
            let m2 = part_m[li + w];
            let mm = max(m1, m2);
            part_s[li] = part_s[li] * exp(m1 - mm) + part_s[li + w] * exp(m2 - mm);
            part_m[li] = mm;
        }
        workgroupBarrier();
    }
    if (li == 0u) {
        stats[2u * row] = part_m[0];
        stats[2u * row + 1u] = part_s[0];
    }
}

// One workgroup per (16 rows) x (16 head-dim columns) tile of O; keys are walked in 16-wide
// slabs: the A slab is turned into probabilities exp(a - L) / S as it is staged.
@compute @workgroup_size(16, 16)
fn weighted_sum(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let z = wid.z;
    let i0 = wid.y * TILE;
    let d0 = wid.x * TILE;
    let bh = p.bh0 + z;
    let b = bh / p.H;
    let h = bh % p.H;
    let tx = lid.x;
    let ty = lid.y;
    // Row statistics of the row this invocation stages (row i0 + ty).
    let si = i0 + ty;
    var row_max = 0.0;
    var inv_sum = 0.0;
    if (si < p.Tq) {
        row_max = stats[2u * (z * p.Tq + si)];
        inv_sum = 1.0 / stats[2u * (z * p.Tq + si) + 1u];
    }
    var kv_end = p.Tk;
    if (p.causal != 0u) { kv_end = min(p.Tk, i0 + TILE); }
    var acc = 0.0;
    for (var j0 = 0u; j0 < kv_end; j0 += TILE) {
        let sj = j0 + tx;  // the key this invocation stages for row si
        var pr = 0.0;
        if (si < p.Tq && sj < p.Tk && (p.causal == 0u || sj <= si)) {
            pr = exp(a[(z * p.Tq + si) * p.Tk + sj] - row_max) * inv_sum;
        }
        tile_a[ty * TILE + tx] = pr;  // [i][j]
        let vj = j0 + ty;
        let d = d0 + tx;
        var vv = 0.0;
        if (vj < p.Tk && d < p.dh) { vv = f32(v[(b * p.Tk + vj) * p.kv_stride + h * p.dh + d]); }
        tile_b[ty * TILE + tx] = vv;  // [j][d]
        workgroupBarrier();
        for (var jj = 0u; jj < TILE; jj++) { acc += tile_a[ty * TILE + jj] * tile_b[jj * TILE + tx]; }
        workgroupBarrier();
    }
    let i = i0 + ty;
    let d = d0 + tx;
    if (p.dh % 2u == 0u) {
        // rows start on a word: the even column of each pair stores both (one whole word in
        // f16-storage), its neighbour's sum passed through workgroup memory
        tile_a[ty * TILE + tx] = acc;
        workgroupBarrier();
        if (tx % 2u == 0u && i < p.Tq && d < p.dh) {
            o_pair((b * p.Tq + i) * (p.H * p.dh) + h * p.dh + d, vec2<f32>(acc, tile_a[ty * TILE + tx + 1u]));
        }
    } else if (i < p.Tq && d < p.dh) {
        o[(b * p.Tq + i) * (p.H * p.dh) + h * p.dh + d] = T(acc);
    }
}

fn o_pair(i: u32, v: vec2<f32>) { o[i] = T(v.x); o[i + 1u] = T(v.y); }
