// Flash attention as two register-blocked GEMMs per key block; the score matrix is never stored.
// Notation: a workgroup owns BQ query rows i0..i0+BQ-1 of one (batch, head) pair
// bh = workgroup_id.y, b = bh / H, h = bh % H, and walks the keys in blocks of BK:
//   S     = Q_blk K_blk^T * scale * log2(e)              (BQ, BK), in registers
//   m_i   = running row max of S, l_i = running row sum of exp2(s_ij - m_i)
//   P     = exp2(S - m)                                    (BQ, BK), in workgroup memory
//   acc   = acc * exp2(m_old - m) + P V_blk                (BQ, dh), in registers
//   O     = acc / l
// Invocation (tx, ty) of the TX x TY grid (TY = BQ / 4) owns the query rows ty + TY * r,
// r = 0..3, in both GEMMs: in S the keys tx + TX * e (e < 4, so BK = 4 * TX), in O the vec4
// head-dim columns tx + TX * c (c < CO <= 4, so the head dim is padded with zeros to 4 * DV,
// DV = CO * TX). Its S block is 4 rows x 4 keys (s0..s3) and its accumulator 4 rows x CO
// vec4s (a0..a3), so each vec4 it reads from workgroup memory feeds 16 FMAs. The register
// blocks are named variables, not arrays: indexed private arrays can end up in local memory.
// The same invocation holds the same rows in both GEMMs, so the rescale by exp2(m_old - m)
// needs no exchange; only the block's row max is reduced across the TX invocations of a row
// (through `red`), and the row sums l stay per invocation until the end.
//
// Workgroup memory, all f32 (rows padded to an odd number of vec4s so the strided reads and
// writes fall in distinct banks):
//   qs  [BQ][DVP]   Q of the workgroup's rows, pre-scaled, loaded once
//   kv  [BK][DVP]   the block's K, then (once every S is computed) its V, so V's load
//                   overlaps the softmax
//   pt  [BK][TYP]   P, one vec4 per (key, ty) holding rows ty + TY * r
//   red [TX][TYP]   per-invocation row maxima, at the end the row sums
// With causal = 1, keys j > i are masked (CLIP) and blocks past the last row are skipped.
struct Params {
    H: u32, Tq: u32, Tk: u32, dh: u32,
    q_stride: u32, kv_stride: u32, causal: u32, scale: f32,
}
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<T>;
@group(0) @binding(2) var<storage, read> k: array<T>;
@group(0) @binding(3) var<storage, read> v: array<T>;
@group(0) @binding(4) var<storage, read_write> o: array<T>;

override BQ: u32 = 64u;  // query rows per workgroup, a multiple of 4
override TX: u32 = 10u;  // invocations across the keys (S) and the head-dim columns (O)
override CO: u32 = 1u;   // vec4 head-dim columns per invocation, 1..4
override TY: u32 = BQ / 4u;
override BK: u32 = 4u * TX;  // keys per block
override DV: u32 = CO * TX;  // vec4 columns of the padded head dim
override DVP: u32 = DV | 1u; // odd row pitches (vec4s)
override TYP: u32 = TY | 1u;
const MAX_CO = 4u;  // accumulator columns a0..a3 (the launcher checks CO against it)
const NEG_BIG = -3.0e38;
const LOG2E = 1.4426950408889634;

var<workgroup> qs: array<vec4<f32>, BQ * DVP>;
var<workgroup> kv: array<vec4<f32>, BK * DVP>;
var<workgroup> pt: array<vec4<f32>, BK * TYP>;
var<workgroup> red: array<vec4<f32>, TX * TYP>;

// Head-dim elements 4*dv .. 4*dv+3 of row `row` of a (rows, stride) tensor, 0 past dh.
fn load_q(row: u32, h: u32, dv: u32) -> vec4<f32> {
    let d0 = 4u * dv;
    let base = row * p.q_stride + h * p.dh + d0;
    if (d0 + 4u <= p.dh) { return vec4<f32>(f32(q[base]), f32(q[base + 1u]), f32(q[base + 2u]), f32(q[base + 3u])); }
    var x = vec4<f32>(0.0);
    for (var e = 0u; e < 4u; e++) { if (d0 + e < p.dh) { x[e] = f32(q[base + e]); } }
    return x;
}

fn load_k(row: u32, h: u32, dv: u32) -> vec4<f32> {
    let d0 = 4u * dv;
    let base = row * p.kv_stride + h * p.dh + d0;
    if (d0 + 4u <= p.dh) { return vec4<f32>(f32(k[base]), f32(k[base + 1u]), f32(k[base + 2u]), f32(k[base + 3u])); }
    var x = vec4<f32>(0.0);
    for (var e = 0u; e < 4u; e++) { if (d0 + e < p.dh) { x[e] = f32(k[base + e]); } }
    return x;
}

fn load_v(row: u32, h: u32, dv: u32) -> vec4<f32> {
    let d0 = 4u * dv;
    let base = row * p.kv_stride + h * p.dh + d0;
    if (d0 + 4u <= p.dh) { return vec4<f32>(f32(v[base]), f32(v[base + 1u]), f32(v[base + 2u]), f32(v[base + 3u])); }
    var x = vec4<f32>(0.0);
    for (var e = 0u; e < 4u; e++) { if (d0 + e < p.dh) { x[e] = f32(v[base + e]); } }
    return x;
}

// One vec4 head-dim column of the accumulator for the invocation's rows r = 0..3.
struct Rows { r0: vec4<f32>, r1: vec4<f32>, r2: vec4<f32>, r3: vec4<f32> }

fn rescale(a: ptr<function, Rows>, alpha: vec4<f32>) {
    (*a).r0 *= alpha.x;
    (*a).r1 *= alpha.y;
    (*a).r2 *= alpha.z;
    (*a).r3 *= alpha.w;
}

fn accumulate(a: ptr<function, Rows>, pr: vec4<f32>, vx: vec4<f32>) {
    (*a).r0 = fma(vec4<f32>(pr.x), vx, (*a).r0);
    (*a).r1 = fma(vec4<f32>(pr.y), vx, (*a).r1);
    (*a).r2 = fma(vec4<f32>(pr.z), vx, (*a).r2);
    (*a).r3 = fma(vec4<f32>(pr.w), vx, (*a).r3);
}

// Rows brow + i + TY*r of O (brow = b * Tq), head-dim elements d0..d0+3, divided by the row sums.
fn store(a: Rows, brow: u32, i: u32, h: u32, d0: u32, inv_l: vec4<f32>) {
    store_row_at(brow, i, h, d0, a.r0 * inv_l.x);
    store_row_at(brow, i + TY, h, d0, a.r1 * inv_l.y);
    store_row_at(brow, i + 2u * TY, h, d0, a.r2 * inv_l.z);
    store_row_at(brow, i + 3u * TY, h, d0, a.r3 * inv_l.w);
}

fn store_row_at(brow: u32, i: u32, h: u32, d0: u32, y: vec4<f32>) {
    if (i >= p.Tq) { return; }
    let base = (brow + i) * (p.H * p.dh) + h * p.dh + d0;
    for (var e = 0u; e < 4u; e++) { if (d0 + e < p.dh) { o[base + e] = T(y[e]); } }
}

// The scores of key j for the rows i (NEG_BIG where masked).
fn masked(sv: vec4<f32>, j: u32, i: vec4<u32>) -> vec4<f32> {
    var keep = vec4<bool>(j < p.Tk);
    if (p.causal != 0u) { keep = keep & (vec4<u32>(j) <= i); }
    return select(vec4<f32>(NEG_BIG), sv, keep);
}

fn scores(q0: vec4<f32>, q1: vec4<f32>, q2: vec4<f32>, q3: vec4<f32>, kx: vec4<f32>) -> vec4<f32> {
    return vec4<f32>(dot(q0, kx), dot(q1, kx), dot(q2, kx), dot(q3, kx));
}

@compute @workgroup_size(TX, TY)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let nt = TX * TY;
    let tx = lid.x;
    let ty = lid.y;
    let i0 = wid.x * BQ;
    let bh = wid.y;
    let b = bh / p.H;
    let h = bh % p.H;
    let qscale = p.scale * LOG2E;
    // Rows past Tq compute on zeros and are not stored.
    for (var e = li; e < BQ * DV; e += nt) {
        let r = e / DV;
        let dv = e % DV;
        var x = vec4<f32>(0.0);
        if (i0 + r < p.Tq && 4u * dv < p.dh) { x = load_q(b * p.Tq + i0 + r, h, dv) * qscale; }
        qs[r * DVP + dv] = x;
    }
    let rows = vec4<u32>(i0 + ty) + vec4<u32>(0u, 1u, 2u, 3u) * TY;

    var a0: Rows;  // head-dim columns tx, tx + TX, tx + 2 TX, tx + 3 TX
    var a1: Rows;
    var a2: Rows;
    var a3: Rows;
    var m = vec4<f32>(NEG_BIG);  // running max of the rows
    var l = vec4<f32>(0.0);      // this invocation's share of the running sums

    var kv_end = p.Tk;
    if (p.causal != 0u) { kv_end = min(p.Tk, i0 + BQ); }
    for (var j0 = 0u; j0 < kv_end; j0 += BK) {
        workgroupBarrier();  // the previous block is done with kv and pt
        for (var e = li; e < BK * DV; e += nt) {
            let j = j0 + e / DV;
            let dv = e % DV;
            var x = vec4<f32>(0.0);
            if (j < p.Tk && 4u * dv < p.dh) { x = load_k(b * p.Tk + j, h, dv); }
            kv[(e / DV) * DVP + dv] = x;
        }
        workgroupBarrier();

        // S = Q K^T: s_e holds key tx + TX*e for the 4 rows.
        var s0 = vec4<f32>(0.0);
        var s1 = vec4<f32>(0.0);
        var s2 = vec4<f32>(0.0);
        var s3 = vec4<f32>(0.0);
        for (var dv = 0u; dv < DV; dv++) {
            let q0 = qs[ty * DVP + dv];
            let q1 = qs[(ty + TY) * DVP + dv];
            let q2 = qs[(ty + 2u * TY) * DVP + dv];
            let q3 = qs[(ty + 3u * TY) * DVP + dv];
            s0 += scores(q0, q1, q2, q3, kv[tx * DVP + dv]);
            s1 += scores(q0, q1, q2, q3, kv[(tx + TX) * DVP + dv]);
            s2 += scores(q0, q1, q2, q3, kv[(tx + 2u * TX) * DVP + dv]);
            s3 += scores(q0, q1, q2, q3, kv[(tx + 3u * TX) * DVP + dv]);
        }
        // Masked keys score NEG_BIG. Key 0 is in every row's first block, so m is finite
        // from then on and exp2(NEG_BIG - m) is exactly 0.
        s0 = masked(s0, j0 + tx, rows);
        s1 = masked(s1, j0 + tx + TX, rows);
        s2 = masked(s2, j0 + tx + 2u * TX, rows);
        s3 = masked(s3, j0 + tx + 3u * TX, rows);
        red[tx * TYP + ty] = max(max(s0, s1), max(s2, s3));
        workgroupBarrier();  // every S is computed (kv is free) and every row max posted

        for (var e = li; e < BK * DV; e += nt) {
            let j = j0 + e / DV;
            let dv = e % DV;
            var x = vec4<f32>(0.0);
            if (j < p.Tk && 4u * dv < p.dh) { x = load_v(b * p.Tk + j, h, dv); }
            kv[(e / DV) * DVP + dv] = x;
        }
        // Every invocation of a row reduces the same values in the same order, so they agree on m.
        var m_new = m;
        for (var u = 0u; u < TX; u++) { m_new = max(m_new, red[u * TYP + ty]); }
        let alpha = exp2(m - m_new);
        m = m_new;
        let p0 = exp2(s0 - m_new);
        let p1 = exp2(s1 - m_new);
        let p2 = exp2(s2 - m_new);
        let p3 = exp2(s3 - m_new);
        pt[tx * TYP + ty] = p0;
        pt[(tx + TX) * TYP + ty] = p1;
        pt[(tx + 2u * TX) * TYP + ty] = p2;
        pt[(tx + 3u * TX) * TYP + ty] = p3;
        l = l * alpha + ((p0 + p1) + (p2 + p3));
        rescale(&a0, alpha);
        if (CO > 1u) { rescale(&a1, alpha); }
        if (CO > 2u) { rescale(&a2, alpha); }
        if (CO > 3u) { rescale(&a3, alpha); }
        workgroupBarrier();  // P and V are in place

        // acc += P V for the rows and columns tx + TX*c.
        for (var jj = 0u; jj < BK; jj++) {
            let pr = pt[jj * TYP + ty];
            let vrow = jj * DVP + tx;
            accumulate(&a0, pr, kv[vrow]);
            if (CO > 1u) { accumulate(&a1, pr, kv[vrow + TX]); }
            if (CO > 2u) { accumulate(&a2, pr, kv[vrow + 2u * TX]); }
            if (CO > 3u) { accumulate(&a3, pr, kv[vrow + 3u * TX]); }
        }
    }

    workgroupBarrier();  // the last block's reads of red are done
    red[tx * TYP + ty] = l;
    workgroupBarrier();
    var l_row = vec4<f32>(0.0);
    for (var u = 0u; u < TX; u++) { l_row += red[u * TYP + ty]; }
    let inv_l = 1.0 / l_row;
    let brow = b * p.Tq;
    store(a0, brow, i0 + ty, h, 4u * tx, inv_l);
    if (CO > 1u) { store(a1, brow, i0 + ty, h, 4u * (tx + TX), inv_l); }
    if (CO > 2u) { store(a2, brow, i0 + ty, h, 4u * (tx + 2u * TX), inv_l); }
    if (CO > 3u) { store(a3, brow, i0 + ty, h, 4u * (tx + 3u * TX), inv_l); }
}
