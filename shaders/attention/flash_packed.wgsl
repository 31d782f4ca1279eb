// Flash attention as flash_gemm.wgsl computes it (the same workgroup, invocation and key-block
// layout, the same online softmax), with Q, K, V and P staged in the model's type T and both
// products summed in T before they reach the f32 scores and accumulators, as the GEMM core does:
//   S: each invocation's 4 rows x KPI keys (4 or 8) are 4 KPI vec2<T> partial dot products, two
//      T FMAs per 4 head-dim elements (packed, two lanes per f32 lane where T = f16); every
//      FLUSH_DV vec4 columns they are summed into the f32 scores s0..s7, so T rounding is confined
//      to sums of 2 * FLUSH_DV terms (5: on the H100 3% slower than 10 at half its error for large
//      logits); the loop over those columns is unrolled (scores_step), as P V's by 4 keys;
//   P V: the block's P (in (0, 1]) times V is summed over the BK keys in vec4<T> and then added
//      to the f32 accumulator, after its rescale by exp2(m_old - m).
// The row max, the exponentials and the row sums stay in f32. With T = f32 this is flash_gemm
// with other summation order. Workgroup memory (rows padded to an odd number of vec4s):
//   qs  [BQ][DVP]   vec4<T>   Q of the workgroup's rows, pre-scaled by scale * log2(e)
//   kv  [BK][DVP]   vec4<T>   the block's K, then its V
//   pt  [BK][TYP]   vec4<T>   P, one vec4 per (key, ty) holding rows ty + TY * r
//   red [TX][TYP]   vec4<f32> per-invocation row maxima, at the end the row sums
// With causal = 1, keys j > i are masked (CLIP) and blocks past the last row are skipped.
// Q, K and V are read as vec4s: the head dim and the row strides must be multiples of 4 (the
// launcher runs flash_gemm otherwise). Each invocation's first four staged vec4s of a K or V
// block travel in registers, loaded a phase ahead: V during S, the next block's K during the
// softmax and P V, so their latency hides behind the FMAs; any further ones (blocks of more than
// 4 vec4s per invocation) are loaded when staged.
struct Params {
    H: u32, Tq: u32, Tk: u32, dh: u32,
    q_stride: u32, kv_stride: u32, causal: u32, scale: f32,
}
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<vec4<T>>;
@group(0) @binding(2) var<storage, read> k: array<vec4<T>>;
@group(0) @binding(3) var<storage, read> v: array<vec4<T>>;
@group(0) @binding(4) var<storage, read_write> o: array<vec4<T>>;  // vec4 rows: dh % 4 == 0

override BQ: u32 = 64u;  // query rows per workgroup, a multiple of 4
override TX: u32 = 10u;  // invocations across the keys (S) and the head-dim columns (O)
override CO: u32 = 1u;   // vec4 head-dim columns per invocation, 1..4
override TY: u32 = BQ / 4u;
override KPI: u32 = 4u;  // keys of S per invocation: 4 or 8 (twice the FMAs per Q load, half the barriers per key)
override BK: u32 = KPI * TX;  // keys per block
override DV: u32 = CO * TX;  // vec4 columns of the padded head dim
override DVP: u32 = DV | 1u; // odd row pitches (vec4s)
override TYP: u32 = TY | 1u;
override FLUSH_DV: u32 = 5u;  // vec4 head-dim columns of S summed in T before each add to f32
const NEG_BIG = -3.0e38;
const LOG2E = 1.4426950408889634;

var<workgroup> qs: array<vec4<T>, BQ * DVP>;
var<workgroup> kv: array<vec4<T>, BK * DVP>;
var<workgroup> pt: array<vec4<T>, BK * TYP>;
var<workgroup> red: array<vec4<f32>, TX * TYP>;

// Staged vec4 e (row e / DV, head-dim column e % DV) of the K (src 1) or V (src 2) block at key
// j0: zero past the block, past Tk and past the head dim. The call sites pass src as a literal.
fn fetch(src: u32, b: u32, h: u32, j0: u32, e: u32) -> vec4<T> {
    let j = j0 + e / DV;
    let dv = e % DV;
    if (e >= BK * DV || j >= p.Tk || 4u * dv >= p.dh) { return vec4<T>(); }
    let i = ((b * p.Tk + j) * p.kv_stride + h * p.dh) / 4u + dv;
    if (src == 1u) { return k[i]; }
    return v[i];
}

fn stage(e: u32, x: vec4<T>) {
    if (e < BK * DV) { kv[(e / DV) * DVP + e % DV] = x; }
}

// The partial dot products of one key with the invocation's rows r = 0..3 (two T lanes each).
struct Dots { r0: vec2<T>, r1: vec2<T>, r2: vec2<T>, r3: vec2<T> }

fn dots(q0: vec4<T>, q1: vec4<T>, q2: vec4<T>, q3: vec4<T>, kx: vec4<T>, h: Dots) -> Dots {
    return Dots(fma(q0.zw, kx.zw, fma(q0.xy, kx.xy, h.r0)), fma(q1.zw, kx.zw, fma(q1.xy, kx.xy, h.r1)),
                fma(q2.zw, kx.zw, fma(q2.xy, kx.xy, h.r2)), fma(q3.zw, kx.zw, fma(q3.xy, kx.xy, h.r3)));
}

// The partial dot products of the invocation's KPI keys (tx + TX * c) with its 4 rows.
struct Block { k0: Dots, k1: Dots, k2: Dots, k3: Dots, k4: Dots, k5: Dots, k6: Dots, k7: Dots }

// S's step for head-dim vec4 column dv: 4 Q and KPI K vec4s from workgroup memory, 8 KPI T FMAs
// (4 KPI packed pairs where T = f16). The S loop calls it FLUSH_DV times per trip (unrolled: the
// packing of the partial sums and the loop's counting are paid once per trip, not per column).
fn scores_step(s: ptr<function, Block>, tx: u32, ty: u32, dv: u32) {
    let q0 = qs[ty * DVP + dv];
    let q1 = qs[(ty + TY) * DVP + dv];
    let q2 = qs[(ty + 2u * TY) * DVP + dv];
    let q3 = qs[(ty + 3u * TY) * DVP + dv];
    (*s).k0 = dots(q0, q1, q2, q3, kv[tx * DVP + dv], (*s).k0);
    (*s).k1 = dots(q0, q1, q2, q3, kv[(tx + TX) * DVP + dv], (*s).k1);
    (*s).k2 = dots(q0, q1, q2, q3, kv[(tx + 2u * TX) * DVP + dv], (*s).k2);
    (*s).k3 = dots(q0, q1, q2, q3, kv[(tx + 3u * TX) * DVP + dv], (*s).k3);
    if (KPI > 4u) {
        (*s).k4 = dots(q0, q1, q2, q3, kv[(tx + 4u * TX) * DVP + dv], (*s).k4);
        (*s).k5 = dots(q0, q1, q2, q3, kv[(tx + 5u * TX) * DVP + dv], (*s).k5);
        (*s).k6 = dots(q0, q1, q2, q3, kv[(tx + 6u * TX) * DVP + dv], (*s).k6);
        (*s).k7 = dots(q0, q1, q2, q3, kv[(tx + 7u * TX) * DVP + dv], (*s).k7);
    }
}

fn total(h: Dots) -> vec4<f32> {
    let a = vec2<f32>(h.r0);
    let b = vec2<f32>(h.r1);
    let c = vec2<f32>(h.r2);
    let d = vec2<f32>(h.r3);
    return vec4<f32>(a.x + a.y, b.x + b.y, c.x + c.y, d.x + d.y);
}

// One vec4 head-dim column of an accumulator for the invocation's rows r = 0..3.
struct Rows { r0: vec4<f32>, r1: vec4<f32>, r2: vec4<f32>, r3: vec4<f32> }
struct RowsT { r0: vec4<T>, r1: vec4<T>, r2: vec4<T>, r3: vec4<T> }

fn rescale(a: ptr<function, Rows>, alpha: vec4<f32>) {
    (*a).r0 *= alpha.x;
    (*a).r1 *= alpha.y;
    (*a).r2 *= alpha.z;
    (*a).r3 *= alpha.w;
}

fn accumulate(pr: vec4<T>, vx: vec4<T>, g: RowsT) -> RowsT {
    return RowsT(fma(vec4<T>(pr.x), vx, g.r0), fma(vec4<T>(pr.y), vx, g.r1), fma(vec4<T>(pr.z), vx, g.r2),
                 fma(vec4<T>(pr.w), vx, g.r3));
}

// The block's P V partial sums in T, head-dim columns tx + TX * c.
struct Sums { g0: RowsT, g1: RowsT, g2: RowsT, g3: RowsT }

// P V's step for key jj of the block: its 4 rows' P and the CO columns of V (4 calls a trip).
fn pv_step(g: ptr<function, Sums>, tx: u32, ty: u32, jj: u32) {
    let pr = pt[jj * TYP + ty];
    let vrow = jj * DVP + tx;
    (*g).g0 = accumulate(pr, kv[vrow], (*g).g0);
    if (CO > 1u) { (*g).g1 = accumulate(pr, kv[vrow + TX], (*g).g1); }
    if (CO > 2u) { (*g).g2 = accumulate(pr, kv[vrow + 2u * TX], (*g).g2); }
    if (CO > 3u) { (*g).g3 = accumulate(pr, kv[vrow + 3u * TX], (*g).g3); }
}

fn flush(a: ptr<function, Rows>, g: RowsT) {
    (*a).r0 += vec4<f32>(g.r0);
    (*a).r1 += vec4<f32>(g.r1);
    (*a).r2 += vec4<f32>(g.r2);
    (*a).r3 += vec4<f32>(g.r3);
}

// Rows brow + i + TY*r of O (brow = b * Tq), head-dim elements d0..d0+3, divided by the row sums.
fn store(a: Rows, brow: u32, i: u32, h: u32, d0: u32, inv_l: vec4<f32>) {
    store_row_at(brow, i, h, d0, a.r0 * inv_l.x);
    store_row_at(brow, i + TY, h, d0, a.r1 * inv_l.y);
    store_row_at(brow, i + 2u * TY, h, d0, a.r2 * inv_l.z);
    store_row_at(brow, i + 3u * TY, h, d0, a.r3 * inv_l.w);
}

// One vec4 store (d0 and the head dim are multiples of 4): in f16-storage two whole words.
fn store_row_at(brow: u32, i: u32, h: u32, d0: u32, y: vec4<f32>) {
    if (i >= p.Tq || d0 >= p.dh) { return; }
    o[((brow + i) * (p.H * p.dh) + h * p.dh + d0) / 4u] = vec4<T>(y);
}

// The scores of key j for the rows i (NEG_BIG where masked).
fn masked(sv: vec4<f32>, j: u32, i: vec4<u32>) -> vec4<f32> {
    var keep = vec4<bool>(j < p.Tk);
    if (p.causal != 0u) { keep = keep & (vec4<u32>(j) <= i); }
    return select(vec4<f32>(NEG_BIG), sv, keep);
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
        if (i0 + r < p.Tq && 4u * dv < p.dh) {
            x = vec4<f32>(q[((b * p.Tq + i0 + r) * p.q_stride + h * p.dh) / 4u + dv]) * qscale;
        }
        qs[r * DVP + dv] = vec4<T>(x);
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
    let e1 = li + nt;
    let e2 = li + 2u * nt;
    let e3 = li + 3u * nt;
    var r0 = fetch(1u, b, h, 0u, li);  // the staged vec4s in flight: K of block 0
    var r1 = fetch(1u, b, h, 0u, e1);
    var r2 = fetch(1u, b, h, 0u, e2);
    var r3 = fetch(1u, b, h, 0u, e3);
    for (var j0 = 0u; j0 < kv_end; j0 += BK) {
        workgroupBarrier();  // the previous block is done with kv and pt
        stage(li, r0); stage(e1, r1); stage(e2, r2); stage(e3, r3);
        for (var e = li + 4u * nt; e < BK * DV; e += nt) { stage(e, fetch(1u, b, h, j0, e)); }
        workgroupBarrier();
        r0 = fetch(2u, b, h, j0, li);  // this block's V, in flight during S
        r1 = fetch(2u, b, h, j0, e1);
        r2 = fetch(2u, b, h, j0, e2);
        r3 = fetch(2u, b, h, j0, e3);

        // S = Q K^T: s_e holds key tx + TX*e for the 4 rows (s4..s7 where KPI = 8).
        var s0 = vec4<f32>(0.0);
        var s1 = vec4<f32>(0.0);
        var s2 = vec4<f32>(0.0);
        var s3 = vec4<f32>(0.0);
        var s4 = vec4<f32>(0.0);
        var s5 = vec4<f32>(0.0);
        var s6 = vec4<f32>(0.0);
        var s7 = vec4<f32>(0.0);
        for (var d0 = 0u; d0 < DV; d0 += FLUSH_DV) {
            // Initialised explicitly (zero) so that every key block and flush starts anew.
            var hs = Block();
            let d1 = min(d0 + FLUSH_DV, DV);
            var dv = d0;
            if (FLUSH_DV == 5u) {  // the shipped summation length, unrolled (SD's 10 / 20 / 40 columns)
                for (; dv + 5u <= d1; dv += 5u) {
                    scores_step(&hs, tx, ty, dv);
                    scores_step(&hs, tx, ty, dv + 1u);
                    scores_step(&hs, tx, ty, dv + 2u);
                    scores_step(&hs, tx, ty, dv + 3u);
                    scores_step(&hs, tx, ty, dv + 4u);
                }
            }
            for (; dv < d1; dv++) { scores_step(&hs, tx, ty, dv); }  // a shorter last flush, other lengths
            s0 += total(hs.k0);
            s1 += total(hs.k1);
            s2 += total(hs.k2);
            s3 += total(hs.k3);
            if (KPI > 4u) {
                s4 += total(hs.k4);
                s5 += total(hs.k5);
                s6 += total(hs.k6);
                s7 += total(hs.k7);
            }
        }
        // Masked keys score NEG_BIG. Key 0 is in every row's first block, so m is finite
        // from then on and exp2(NEG_BIG - m) is exactly 0.
        s0 = masked(s0, j0 + tx, rows);
        s1 = masked(s1, j0 + tx + TX, rows);
        s2 = masked(s2, j0 + tx + 2u * TX, rows);
        s3 = masked(s3, j0 + tx + 3u * TX, rows);
        var smax = max(max(s0, s1), max(s2, s3));
        if (KPI > 4u) {
            s4 = masked(s4, j0 + tx + 4u * TX, rows);
            s5 = masked(s5, j0 + tx + 5u * TX, rows);
            s6 = masked(s6, j0 + tx + 6u * TX, rows);
            s7 = masked(s7, j0 + tx + 7u * TX, rows);
            smax = max(smax, max(max(s4, s5), max(s6, s7)));
        }
        red[tx * TYP + ty] = smax;
        workgroupBarrier();  // every S is computed (kv is free) and every row max posted

        stage(li, r0); stage(e1, r1); stage(e2, r2); stage(e3, r3);
        for (var e = li + 4u * nt; e < BK * DV; e += nt) { stage(e, fetch(2u, b, h, j0, e)); }
        r0 = fetch(1u, b, h, j0 + BK, li);  // the next block's K, in flight during the softmax and P V
        r1 = fetch(1u, b, h, j0 + BK, e1);
        r2 = fetch(1u, b, h, j0 + BK, e2);
        r3 = fetch(1u, b, h, j0 + BK, e3);
        // Every invocation of a row reduces the same values in the same order, so they agree on m.
        var m_new = m;
        for (var u = 0u; u < TX; u++) { m_new = max(m_new, red[u * TYP + ty]); }
        let alpha = exp2(m - m_new);
        m = m_new;
        let p0 = exp2(s0 - m_new);
        let p1 = exp2(s1 - m_new);
        let p2 = exp2(s2 - m_new);
        let p3 = exp2(s3 - m_new);
        pt[tx * TYP + ty] = vec4<T>(p0);
        pt[(tx + TX) * TYP + ty] = vec4<T>(p1);
        pt[(tx + 2u * TX) * TYP + ty] = vec4<T>(p2);
        pt[(tx + 3u * TX) * TYP + ty] = vec4<T>(p3);
        var psum = (p0 + p1) + (p2 + p3);
        if (KPI > 4u) {
            let p4 = exp2(s4 - m_new);
            let p5 = exp2(s5 - m_new);
            let p6 = exp2(s6 - m_new);
            let p7 = exp2(s7 - m_new);
            pt[(tx + 4u * TX) * TYP + ty] = vec4<T>(p4);
            pt[(tx + 5u * TX) * TYP + ty] = vec4<T>(p5);
            pt[(tx + 6u * TX) * TYP + ty] = vec4<T>(p6);
            pt[(tx + 7u * TX) * TYP + ty] = vec4<T>(p7);
            psum += (p4 + p5) + (p6 + p7);
        }
        l = l * alpha + psum;
        rescale(&a0, alpha);
        if (CO > 1u) { rescale(&a1, alpha); }
        if (CO > 2u) { rescale(&a2, alpha); }
        if (CO > 3u) { rescale(&a3, alpha); }
        workgroupBarrier();  // P and V are in place

        // acc += P V for the rows and columns tx + TX*c, summed over the block in T.
        var g = Sums();
        for (var jj = 0u; jj < BK; jj += 4u) {  // BK = KPI TX: unrolled by 4 keys
            pv_step(&g, tx, ty, jj);
            pv_step(&g, tx, ty, jj + 1u);
            pv_step(&g, tx, ty, jj + 2u);
            pv_step(&g, tx, ty, jj + 3u);
        }
        flush(&a0, g.g0);
        if (CO > 1u) { flush(&a1, g.g1); }
        if (CO > 2u) { flush(&a2, g.g2); }
        if (CO > 3u) { flush(&a3, g.g3); }
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
