// Flash attention (exact, tiled, online softmax); the score matrix is never stored.
// Notation: a workgroup owns BR query rows i0..i0+BR-1 of one (batch, head) pair
// bh = workgroup_id.y, b = bh / H, h = bh % H, and walks the keys in blocks of BC:
//   a_ij  = scale * sum_d Q[b, i, h*dh + d] K[b, j, h*dh + d]
//   m_i   = running max of a_ij over the keys seen, l_i = running sum of exp(a_ij - m_i)
//   acc_i = running sum of exp(a_ij - m_i) V[b, j, h*dh + :]
// On a new block with max m', the old terms are rescaled by exp(m_i - m'). O = acc_i / l_i.
// NT invocations share a query row: invocation t owns head-dim columns t, t + NT, ..., so its
// part of acc_i is at most MAX_DH / NT values, kept in registers. Q, K and V (in turn) and the
// block's scores are staged in workgroup memory: 4 * (BR*MAX_DH + BC*MAX_DH + BR*BC) bytes.
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

override BR: u32 = 16u;      // query rows per workgroup
override BC: u32 = 16u;      // keys per block
override MAX_DH: u32 = 40u;  // largest head dim this pipeline serves (<= NT * ACC_MAX)
const NT = 8u;               // invocations per query row
const ACC_MAX = 20u;         // register accumulators per invocation: 160 / NT
const NEG_BIG = -3.0e38;

var<workgroup> q_tile: array<f32, BR * MAX_DH>;   // [r][d]
var<workgroup> kv_tile: array<f32, BC * MAX_DH>;  // [c][d], K then V
var<workgroup> a_tile: array<f32, BR * BC>;       // [r][c]

@compute @workgroup_size(BR * NT)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let wg = BR * NT;
    let i0 = wid.x * BR;
    let bh = wid.y;
    let b = bh / p.H;
    let h = bh % p.H;
    let r = li / NT;
    let t = li % NT;
    let i = i0 + r;
    let dh = p.dh;
    let n_acc = (MAX_DH + NT - 1u) / NT;

    for (var e = li; e < BR * dh; e += wg) {
        let rr = e / dh;
        let d = e % dh;
        var x = 0.0;
        if (i0 + rr < p.Tq) { x = f32(q[(b * p.Tq + i0 + rr) * p.q_stride + h * dh + d]); }
        q_tile[rr * MAX_DH + d] = x;
    }

    var m = NEG_BIG;
    var l = 0.0;
    var acc: array<f32, ACC_MAX>;
    for (var c = 0u; c < ACC_MAX; c++) { acc[c] = 0.0; }

    var kv_end = p.Tk;
    if (p.causal != 0u) { kv_end = min(p.Tk, i0 + BR); }
    for (var j0 = 0u; j0 < kv_end; j0 += BC) {
        workgroupBarrier();  // the previous block is done with kv_tile and a_tile
        for (var e = li; e < BC * dh; e += wg) {
            let c = e / dh;
            let d = e % dh;
            var x = 0.0;
            if (j0 + c < p.Tk) { x = f32(k[(b * p.Tk + j0 + c) * p.kv_stride + h * dh + d]); }
            kv_tile[c * MAX_DH + d] = x;
        }
        workgroupBarrier();
        for (var c = t; c < BC; c += NT) {
            let j = j0 + c;
            var x = NEG_BIG;
            if (j < p.Tk && (p.causal == 0u || j <= i)) {
                var dot = 0.0;
                for (var d = 0u; d < dh; d++) { dot += q_tile[r * MAX_DH + d] * kv_tile[c * MAX_DH + d]; }
                x = dot * p.scale;
            }
            a_tile[r * BC + c] = x;
        }
        workgroupBarrier();
        // K is consumed: stage V in its place while each row's new max is read off a_tile.
        for (var e = li; e < BC * dh; e += wg) {
            let c = e / dh;
            let d = e % dh;
            var x = 0.0;
            if (j0 + c < p.Tk) { x = f32(v[(b * p.Tk + j0 + c) * p.kv_stride + h * dh + d]); }
            kv_tile[c * MAX_DH + d] = x;
        }
        var m_new = m;
        for (var c = 0u; c < BC; c++) { m_new = max(m_new, a_tile[r * BC + c]); }
        workgroupBarrier();
        // Each score becomes a probability once, by the invocation that computed it. Masked
        // keys hold NEG_BIG; every row sees a real key in its first block, so m_new is finite
        // and exp(NEG_BIG - m_new) is exactly 0.
        for (var c = t; c < BC; c += NT) { a_tile[r * BC + c] = exp(a_tile[r * BC + c] - m_new); }
        workgroupBarrier();
        let alpha = exp(m - m_new);
        l *= alpha;
        for (var n = 0u; n < n_acc; n++) { acc[n] *= alpha; }
        for (var c = 0u; c < BC; c++) {
            let pr = a_tile[r * BC + c];
            l += pr;
            for (var n = 0u; n < n_acc; n++) {
                let d = t + n * NT;
                if (d < dh) { acc[n] += pr * kv_tile[c * MAX_DH + d]; }
            }
        }
        m = m_new;
    }

    if (i < p.Tq) {
        let inv_l = 1.0 / l;
        for (var n = 0u; n < n_acc; n++) {
            let d = t + n * NT;
            if (d < dh) { o[(b * p.Tq + i) * (p.H * dh) + h * dh + d] = T(acc[n] * inv_l); }
        }
    }
}
