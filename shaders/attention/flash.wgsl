// Flash attention (exact, tiled, online softmax); the score matrix is never stored.
// Notation: a workgroup owns BR query rows i0..i0+BR-1 of one (batch, head) pair
// bh = workgroup_id.y, b = bh / H, h = bh % H, and walks the keys in blocks of BC:
//   a_ij  = scale * sum_d Q[b, i, h*dh + d] K[b, j, h*dh + d]
//   m_i   = running max of a_ij over the keys seen, l_i = running sum of exp(a_ij - m_i)
//   acc_i = running sum of exp(a_ij - m_i) V[b, j, h*dh + :]
// On a new block with max m', the old terms are rescaled by exp(m_i - m'). O = acc_i / l_i.
// The scores are kept in base 2 (q is pre-scaled by scale * log2(e), exp2 replaces exp).
//
// Registers, not workgroup memory, hold the per-row state. The head dim is padded with zeros
// to MAX_DH = 4 * DV and handled as DV vec4 columns. SPLIT invocations share a query row:
// invocation `lane` owns the vec4 columns lane, lane + SPLIT, ... (DVS = DV / SPLIT of them),
// of q (pre-scaled) and of the accumulator acc, for RPI query rows i0 + g + r * NG. Every
// loop that indexes a private array runs to an override bound, so the driver can unroll it and
// keep the arrays in registers. Per block of BC keys: K and V are staged in workgroup memory as vec4
// (32 * BC * DV bytes, loads coalesced along the head dim); each invocation computes its
// rows' BC (partial) dot products in registers; with SPLIT > 1 the partial dots are summed
// through workgroup memory (4 * BR * BC * SPLIT bytes); then the online softmax and
// acc += p V run in registers (f32 whatever T is).
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

fn o_pair(i: u32, v: vec2<f32>) { o[i] = T(v.x); o[i + 1u] = T(v.y); }

override BR: u32 = 64u;      // query rows per workgroup
override BC: u32 = 16u;      // keys per block
override MAX_DH: u32 = 40u;  // largest head dim served, padded; a multiple of 4 * SPLIT
override SPLIT: u32 = 1u;    // invocations sharing one query row (1, 2 or 4)
override RPI: u32 = 1u;      // query rows per invocation (1 or 2)
override DV: u32 = (MAX_DH + 3u) / 4u;  // vec4 columns of the (padded) head dim
override DVS: u32 = DV / SPLIT;         // vec4 columns per invocation
override NG: u32 = BR / RPI;            // row groups: invocation li = g * SPLIT + lane
const MAX_DVS = 16u;  // private array bounds (the launcher checks DVS, RPI, BC against them)
const MAX_RPI = 2u;
const MAX_BC = 64u;
const NEG_BIG = -3.0e38;
const LOG2E = 1.4426950408889634;

var<workgroup> k_tile: array<vec4<f32>, BC * DV>;  // [c][dv]
var<workgroup> v_tile: array<vec4<f32>, BC * DV>;  // [c][dv]
// Partial dots [c][r][li] of the SPLIT invocations of a row (one float when SPLIT = 1).
var<workgroup> part: array<f32, BC * RPI * NG * SPLIT * min(SPLIT - 1u, 1u) + 1u>;

// Head-dim elements 4*dv .. 4*dv+3 of row `row` of a (rows, stride) tensor, 0 past dh.
fn load_q(row: u32, stride: u32, h: u32, dv: u32) -> vec4<f32> {
    let d0 = 4u * dv;
    let base = row * stride + h * p.dh + d0;
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

@compute @workgroup_size(NG * SPLIT)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let wg = NG * SPLIT;
    let i0 = wid.x * BR;
    let bh = wid.y;
    let b = bh / p.H;
    let h = bh % p.H;
    let g = li / SPLIT;
    let lane = li % SPLIT;
    let qscale = p.scale * LOG2E;

    // Row r of this invocation is i0 + g + r * NG; rows past Tq compute on zeros, unstored.
    var qr: array<vec4<f32>, MAX_RPI * MAX_DVS>;
    var acc: array<vec4<f32>, MAX_RPI * MAX_DVS>;
    var m: array<f32, MAX_RPI>;
    var l: array<f32, MAX_RPI>;
    var s: array<f32, MAX_RPI * MAX_BC>;  // the block's scores, then probabilities
    for (var r = 0u; r < RPI; r++) {
        let i = i0 + g + r * NG;
        for (var d = 0u; d < DVS; d++) {
            var x = vec4<f32>(0.0);
            if (i < p.Tq) { x = load_q(b * p.Tq + i, p.q_stride, h, d * SPLIT + lane) * qscale; }
            qr[r * DVS + d] = x;
            acc[r * DVS + d] = vec4<f32>(0.0);
        }
        m[r] = NEG_BIG;
        l[r] = 0.0;
    }

    var kv_end = p.Tk;
    if (p.causal != 0u) { kv_end = min(p.Tk, i0 + BR); }
    for (var j0 = 0u; j0 < kv_end; j0 += BC) {
        workgroupBarrier();  // the previous block is done with the tiles and `part`
        for (var e = li; e < BC * DV; e += wg) {
            let j = j0 + e / DV;
            var kx = vec4<f32>(0.0);
            var vx = vec4<f32>(0.0);
            if (j < p.Tk) {
                kx = load_k(b * p.Tk + j, h, e % DV);
                vx = load_v(b * p.Tk + j, h, e % DV);
            }
            k_tile[e] = kx;
            v_tile[e] = vx;
        }
        workgroupBarrier();

        for (var c = 0u; c < BC; c++) {
            for (var r = 0u; r < RPI; r++) {
                var sv = vec4<f32>(0.0);
                for (var d = 0u; d < DVS; d++) { sv = fma(qr[r * DVS + d], k_tile[c * DV + d * SPLIT + lane], sv); }
                s[r * BC + c] = (sv.x + sv.y) + (sv.z + sv.w);
            }
        }
        if (SPLIT > 1u) {
            // Every invocation of a row adds the row's SPLIT partial dots in the same order,
            // so they agree on the scores (and on m and l).
            for (var c = 0u; c < BC; c++) {
                for (var r = 0u; r < RPI; r++) { part[(c * RPI + r) * wg + li] = s[r * BC + c]; }
            }
            workgroupBarrier();
            for (var c = 0u; c < BC; c++) {
                for (var r = 0u; r < RPI; r++) {
                    var x = 0.0;
                    for (var u = 0u; u < SPLIT; u++) { x += part[(c * RPI + r) * wg + g * SPLIT + u]; }
                    s[r * BC + c] = x;
                }
            }
        }

        for (var r = 0u; r < RPI; r++) {
            let i = i0 + g + r * NG;
            // Masked keys score NEG_BIG. Key 0 is in every row's first block, so m_new is
            // finite from then on and exp2(NEG_BIG - m_new) is exactly 0.
            var m_new = m[r];
            for (var c = 0u; c < BC; c++) {
                let j = j0 + c;
                var x = s[r * BC + c];
                if (j >= p.Tk || (p.causal != 0u && j > i)) { x = NEG_BIG; }
                s[r * BC + c] = x;
                m_new = max(m_new, x);
            }
            var l_blk = 0.0;
            for (var c = 0u; c < BC; c++) {
                let pr = exp2(s[r * BC + c] - m_new);
                s[r * BC + c] = pr;
                l_blk += pr;
            }
            let alpha = exp2(m[r] - m_new);
            l[r] = l[r] * alpha + l_blk;
            m[r] = m_new;
            for (var d = 0u; d < DVS; d++) { acc[r * DVS + d] *= alpha; }
        }
        for (var c = 0u; c < BC; c++) {
            for (var d = 0u; d < DVS; d++) {
                let vx = v_tile[c * DV + d * SPLIT + lane];
                for (var r = 0u; r < RPI; r++) { acc[r * DVS + d] = fma(vec4<f32>(s[r * BC + c]), vx, acc[r * DVS + d]); }
            }
        }
    }

    for (var r = 0u; r < RPI; r++) {
        let i = i0 + g + r * NG;
        if (i < p.Tq) {
            let inv_l = 1.0 / l[r];
            let base = (b * p.Tq + i) * (p.H * p.dh) + h * p.dh;
            for (var d = 0u; d < DVS; d++) {
                let y = acc[r * DVS + d] * inv_l;
                let d0 = 4u * (d * SPLIT + lane);
                if (p.dh % 2u == 0u) {  // rows start on a word: pairs (one word each in f16-storage)
                    if (d0 < p.dh) { o_pair(base + d0, y.xy); }
                    if (d0 + 2u < p.dh) { o_pair(base + d0 + 2u, y.zw); }
                } else {
                    for (var e = 0u; e < 4u; e++) { if (d0 + e < p.dh) { o[base + d0 + e] = T(y[e]); } }
                }
            }
        }
    }
}
