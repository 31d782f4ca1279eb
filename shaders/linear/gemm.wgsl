// The engine's GEMM core: C[z] = epilogue(A[z] B[z]^T), f16 in and out, for linear layers, 1x1
// convolutions and Winograd's 36 products (engine/variants/gemm.py launches it).
//
//   A[z]  M x K, K contiguous                      a4, batch stride a_batch (elements)
//   B[z]  N x K, K contiguous   (B_KN = false)     b4, batch stride b_batch
//         K x N, N contiguous   (B_KN = true)
//   C[z]  M x N, N contiguous                      c4, batch stride c_batch
//   epilogue, in f32: + bias (bias[n], or bias[m] when flags & 2), + R[z] (M x N, flags & 4,
//   the residual, batch stride c_batch), then the activation p.act (0 none, 1 SiLU, 2 GELU)
//
// Blocking: a workgroup computes a TILE_M x TILE_N tile of C; each invocation an 8 x 8 register
// block, rows {4ty..4ty+3} and {TILE_M/2 + 4ty..} by columns {4tx..4tx+3} and {TILE_N/2 + 4tx..}
// (the two halves keep the workgroup-memory reads of a warp contiguous), or with COLS = 4 an
// 8 x 4 block, columns {4tx..4tx+3} only: twice the invocations, half the registers each. K is walked TILE_K at a
// time through two workgroup-memory stages: while the invocations multiply one stage, the next
// slab's global loads are in flight (PREFETCH; else they are issued after the FMAs, which frees
// their registers for more workgroups per SM) and land in the other stage, one barrier per slab. Operands
// are vec4<f16>; each slab's TILE_K products are summed by vec4<f16> FMAs (two f16 lanes per f32
// lane) and then added to f32 accumulators every FLUSH slabs, so f16 rounding is confined to
// sums of FLUSH * TILE_K terms.
//
// GEGLU (GATED): B's N = 2F rows are F value rows then F gate rows; a workgroup's TILE_N rows are
// TILE_N / 2 value rows and the gate rows of the same output columns, so each invocation holds
// value and gate of its columns (its two column halves) and writes value * GELU(gate) (exact
// erf form, bias added to both first) to C, M x F. Needs COLS 8, SPLIT_K 1, B as N x K, F % 4 == 0.
//
// Split-K (SPLIT_K > 1, for products whose M x N tiles alone cannot fill the GPU): the grid's z
// is batch x SPLIT_K, each split sums its share of the slabs into f32 partials
// part (SPLIT_K, batch, M, N), and reduce_main adds them up and applies the epilogue.
// Needs K % 4 == 0, N % 4 == 0 and batch strides that are multiples of 4 (vec4 loads and stores);
// TILE_K <= TILE_M / 2 and TILE_K <= TILE_N / 2 (at most two 4 x 4 load quads per invocation).
struct Params {
    M: u32, N: u32, K: u32, flags: u32,
    a_batch: u32, b_batch: u32, c_batch: u32, act: u32,
    batch: u32,
}
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> a4: array<vec4<T>>;
@group(0) @binding(2) var<storage, read> b4: array<vec4<T>>;
@group(0) @binding(3) var<storage, read> bias: array<T>;
@group(0) @binding(4) var<storage, read> r4: array<vec4<T>>;
@group(0) @binding(5) var<storage, read_write> c4: array<vec4<T>>;
@group(0) @binding(6) var<storage, read_write> part: array<vec4<f32>>;

override TILE_M: u32 = 64;   // multiple of 16
override TILE_N: u32 = 64;   // multiple of 16
override TILE_K: u32 = 16;   // multiple of 8
override B_KN: bool = false;  // B is K x N (N contiguous) instead of N x K
override FLUSH: u32 = 1u;     // slabs summed in f16 before each add to the f32 accumulators (2: in pairs, below)
override SPLIT_K: u32 = 1u;   // splits of K (1: none)
override PREFETCH: bool = true;  // next slab's global loads in flight during the FMAs (more registers)
override COLS: u32 = 8u;      // columns of an invocation's register block: 8 (two vec4 groups) or 4
override GATED: bool = false; // GEGLU epilogue (see above)

const HAS_BIAS: u32 = 1u;
const BIAS_ON_M: u32 = 2u;
const HAS_RESIDUAL: u32 = 4u;

// Rows of the staged slabs, padded by one vec4 so the transposing stores spread over banks.
const PAD: u32 = 1u;
var<workgroup> As: array<vec4<f16>, 2u * TILE_K * (TILE_M / 4u + PAD)>;  // [stage][k][m/4]
var<workgroup> Bs: array<vec4<f16>, 2u * TILE_K * (TILE_N / 4u + PAD)>;  // [stage][k][n/4]

fn sa() -> u32 { return TILE_M / 4u + PAD; }
fn sb() -> u32 { return TILE_N / 4u + PAD; }
fn threads() -> u32 { return (TILE_M / 8u) * (TILE_N / COLS); }

// A quad is 4 rows (of M or N) by 4 k, or for B_KN 4 k by 4 columns: four vec4 loads.
struct Quad { v0: vec4<f16>, v1: vec4<f16>, v2: vec4<f16>, v3: vec4<f16> }

fn load_a(z: u32, m0: u32, k0: u32, q: u32) -> Quad {
    let kq = q % (TILE_K / 4u);
    let m = m0 + 4u * (q / (TILE_K / 4u));
    let k = k0 + 4u * kq;
    var o: Quad;
    if (k >= p.K) { return o; }
    let base = (z * p.a_batch + m * p.K + k) / 4u;
    let row = p.K / 4u;
    if (m < p.M) { o.v0 = vec4<f16>(a4[base]); }
    if (m + 1u < p.M) { o.v1 = vec4<f16>(a4[base + row]); }
    if (m + 2u < p.M) { o.v2 = vec4<f16>(a4[base + 2u * row]); }
    if (m + 3u < p.M) { o.v3 = vec4<f16>(a4[base + 3u * row]); }
    return o;
}

fn store_a(s: u32, q: u32, o: Quad) {
    let kq = q % (TILE_K / 4u);
    let mq = q / (TILE_K / 4u);
    let at = (s * TILE_K + 4u * kq) * sa() + mq;
    As[at] = vec4<f16>(o.v0.x, o.v1.x, o.v2.x, o.v3.x);
    As[at + sa()] = vec4<f16>(o.v0.y, o.v1.y, o.v2.y, o.v3.y);
    As[at + 2u * sa()] = vec4<f16>(o.v0.z, o.v1.z, o.v2.z, o.v3.z);
    As[at + 3u * sa()] = vec4<f16>(o.v0.w, o.v1.w, o.v2.w, o.v3.w);
}

fn load_b(z: u32, n0: u32, k0: u32, q: u32) -> Quad {
    var o: Quad;
    if (B_KN) {  // 4 k rows of 4 columns: already the staged layout
        let nq = q % (TILE_N / 4u);
        let k = k0 + 4u * (q / (TILE_N / 4u));
        let n = n0 + 4u * nq;
        if (n >= p.N) { return o; }
        let base = (z * p.b_batch + k * p.N + n) / 4u;
        let row = p.N / 4u;
        if (k < p.K) { o.v0 = vec4<f16>(b4[base]); }
        if (k + 1u < p.K) { o.v1 = vec4<f16>(b4[base + row]); }
        if (k + 2u < p.K) { o.v2 = vec4<f16>(b4[base + 2u * row]); }
        if (k + 3u < p.K) { o.v3 = vec4<f16>(b4[base + 3u * row]); }
        return o;
    }
    let kq = q % (TILE_K / 4u);
    let r = 4u * (q / (TILE_K / 4u));  // row of the tile
    let k = k0 + 4u * kq;
    if (k >= p.K) { return o; }
    var n = n0 + r;
    var n_end = p.N;
    if (GATED) {  // the value rows of the tile's output columns, then their gate rows
        let f = p.N / 2u;
        let c = n0 / 2u + r % (TILE_N / 2u);
        n = select(c, f + c, r >= TILE_N / 2u);
        n_end = select(f, p.N, r >= TILE_N / 2u);
    }
    let base = (z * p.b_batch + n * p.K + k) / 4u;
    let row = p.K / 4u;
    if (n < n_end) { o.v0 = vec4<f16>(b4[base]); }
    if (n + 1u < n_end) { o.v1 = vec4<f16>(b4[base + row]); }
    if (n + 2u < n_end) { o.v2 = vec4<f16>(b4[base + 2u * row]); }
    if (n + 3u < n_end) { o.v3 = vec4<f16>(b4[base + 3u * row]); }
    return o;
}

fn store_b(s: u32, q: u32, o: Quad) {
    if (B_KN) {
        let nq = q % (TILE_N / 4u);
        let at = (s * TILE_K + 4u * (q / (TILE_N / 4u))) * sb() + nq;
        Bs[at] = o.v0;
        Bs[at + sb()] = o.v1;
        Bs[at + 2u * sb()] = o.v2;
        Bs[at + 3u * sb()] = o.v3;
        return;
    }
    let kq = q % (TILE_K / 4u);
    let nq = q / (TILE_K / 4u);
    let at = (s * TILE_K + 4u * kq) * sb() + nq;
    Bs[at] = vec4<f16>(o.v0.x, o.v1.x, o.v2.x, o.v3.x);
    Bs[at + sb()] = vec4<f16>(o.v0.y, o.v1.y, o.v2.y, o.v3.y);
    Bs[at + 2u * sb()] = vec4<f16>(o.v0.z, o.v1.z, o.v2.z, o.v3.z);
    Bs[at + 3u * sb()] = vec4<f16>(o.v0.w, o.v1.w, o.v2.w, o.v3.w);
}

// An invocation's 8 x 8 block (COLS = 4: 8 x 4, the rRC with C = 1 unused): rRC holds register
// row R (0..7) by column half C (0..1), 4 columns each.
// Acc: the f32 sums.
struct Acc {
    r00: vec4<f32>, r01: vec4<f32>, r10: vec4<f32>, r11: vec4<f32>, r20: vec4<f32>, r21: vec4<f32>,
    r30: vec4<f32>, r31: vec4<f32>, r40: vec4<f32>, r41: vec4<f32>, r50: vec4<f32>, r51: vec4<f32>,
    r60: vec4<f32>, r61: vec4<f32>, r70: vec4<f32>, r71: vec4<f32>,
}
// Sums: one slab's f16 sums.
struct Sums {
    r00: vec4<f16>, r01: vec4<f16>, r10: vec4<f16>, r11: vec4<f16>, r20: vec4<f16>, r21: vec4<f16>,
    r30: vec4<f16>, r31: vec4<f16>, r40: vec4<f16>, r41: vec4<f16>, r50: vec4<f16>, r51: vec4<f16>,
    r60: vec4<f16>, r61: vec4<f16>, r70: vec4<f16>, r71: vec4<f16>,
}

// One k of the slab: the invocation's 8 rows of A (staged at `at`) times its 4 or 8 columns of B
// (at `bt`), each row's value splat over a vec4 of columns. The main loop calls it 8 times per
// iteration: written as a loop over single k's, NVIDIA's compiler (Vulkan) kept the loop and
// re-packed the packed-half sums on every trip (32 permutes per 32 FMAs; FMAs were 36% of the
// loop's instructions); unrolled, the loop pays that once per 8 k's.
fn mac(acc: ptr<function, Sums>, at: u32, bt: u32) {
    let a0 = As[at];
    let a1 = As[at + TILE_M / 8u];
    let b0 = Bs[bt];
    let x0 = vec4<f16>(a0.x);
    let x1 = vec4<f16>(a0.y);
    let x2 = vec4<f16>(a0.z);
    let x3 = vec4<f16>(a0.w);
    let x4 = vec4<f16>(a1.x);
    let x5 = vec4<f16>(a1.y);
    let x6 = vec4<f16>(a1.z);
    let x7 = vec4<f16>(a1.w);
    (*acc).r00 = fma(x0, b0, (*acc).r00);  (*acc).r10 = fma(x1, b0, (*acc).r10);
    (*acc).r20 = fma(x2, b0, (*acc).r20);  (*acc).r30 = fma(x3, b0, (*acc).r30);
    (*acc).r40 = fma(x4, b0, (*acc).r40);  (*acc).r50 = fma(x5, b0, (*acc).r50);
    (*acc).r60 = fma(x6, b0, (*acc).r60);  (*acc).r70 = fma(x7, b0, (*acc).r70);
    if (COLS == 8u) {
        let b1 = Bs[bt + TILE_N / 8u];
        (*acc).r01 = fma(x0, b1, (*acc).r01);  (*acc).r11 = fma(x1, b1, (*acc).r11);
        (*acc).r21 = fma(x2, b1, (*acc).r21);  (*acc).r31 = fma(x3, b1, (*acc).r31);
        (*acc).r41 = fma(x4, b1, (*acc).r41);  (*acc).r51 = fma(x5, b1, (*acc).r51);
        (*acc).r61 = fma(x6, b1, (*acc).r61);  (*acc).r71 = fma(x7, b1, (*acc).r71);
    }
}

// FLUSH 2's add of a pair's sums to the f32 accumulators.
fn flush_pair(c: ptr<function, Acc>, h: Sums) {
    (*c).r00 += vec4<f32>(h.r00); (*c).r01 += vec4<f32>(h.r01); (*c).r10 += vec4<f32>(h.r10); (*c).r11 += vec4<f32>(h.r11);
    (*c).r20 += vec4<f32>(h.r20); (*c).r21 += vec4<f32>(h.r21); (*c).r30 += vec4<f32>(h.r30); (*c).r31 += vec4<f32>(h.r31);
    (*c).r40 += vec4<f32>(h.r40); (*c).r41 += vec4<f32>(h.r41); (*c).r50 += vec4<f32>(h.r50); (*c).r51 += vec4<f32>(h.r51);
    (*c).r60 += vec4<f32>(h.r60); (*c).r61 += vec4<f32>(h.r61); (*c).r70 += vec4<f32>(h.r70); (*c).r71 += vec4<f32>(h.r71);
}

fn erf_approx(z: f32) -> f32 {  // Abramowitz-Stegun 7.1.26, as shaders/activation
    let a = abs(z);
    let t = 1.0 / (1.0 + 0.3275911 * a);
    let poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))));
    return sign(z) * (1.0 - poly * exp(-a * a));
}

fn activate(v: vec4<f32>) -> vec4<f32> {
    switch p.act {
        case 1u: { return v / (1.0 + exp(-v)); }
        case 2u: {
            let e = vec4<f32>(erf_approx(v.x * 0.7071067811865476), erf_approx(v.y * 0.7071067811865476),
                              erf_approx(v.z * 0.7071067811865476), erf_approx(v.w * 0.7071067811865476));
            return 0.5 * v * (1.0 + e);
        }
        default: { return v; }
    }
}

fn store_c(z: u32, m: u32, n: u32, acc: vec4<f32>) {
    if (m >= p.M || n >= p.N) { return; }
    var v = acc;
    if ((p.flags & HAS_BIAS) != 0u) {
        if ((p.flags & BIAS_ON_M) != 0u) {
            v += vec4<f32>(f32(bias[m]));
        } else {
            v += vec4<f32>(f32(bias[n]), f32(bias[n + 1u]), f32(bias[n + 2u]), f32(bias[n + 3u]));
        }
    }
    let at = (z * p.c_batch + m * p.N + n) / 4u;
    if ((p.flags & HAS_RESIDUAL) != 0u) { v += vec4<f32>(r4[at]); }
    c4[at] = vec4<T>(activate(v));
}

// GEGLU's epilogue: output columns c..c+3 of row m from their value and gate sums.
fn store_gated(z: u32, m: u32, c: u32, value: vec4<f32>, gate: vec4<f32>) {
    let f = p.N / 2u;
    if (m >= p.M || c >= f) { return; }
    var a = value;
    var g = gate;
    if ((p.flags & HAS_BIAS) != 0u) {
        a += vec4<f32>(f32(bias[c]), f32(bias[c + 1u]), f32(bias[c + 2u]), f32(bias[c + 3u]));
        g += vec4<f32>(f32(bias[f + c]), f32(bias[f + c + 1u]), f32(bias[f + c + 2u]), f32(bias[f + c + 3u]));
    }
    let e = vec4<f32>(erf_approx(g.x * 0.7071067811865476), erf_approx(g.y * 0.7071067811865476),
                      erf_approx(g.z * 0.7071067811865476), erf_approx(g.w * 0.7071067811865476));
    c4[(z * p.c_batch + m * f + c) / 4u] = vec4<T>(a * 0.5 * g * (1.0 + e));
}

@compute @workgroup_size(TILE_N / COLS, TILE_M / 8u)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let z = wid.z / SPLIT_K;
    let split = wid.z % SPLIT_K;
    let m0 = wid.y * TILE_M;
    let n0 = wid.x * TILE_N;
    let qa = (TILE_M / 4u) * (TILE_K / 4u);
    let qb = (TILE_N / 4u) * (TILE_K / 4u);
    let nt = threads();
    let per = ((p.K + TILE_K - 1u) / TILE_K + SPLIT_K - 1u) / SPLIT_K;  // slabs per split
    let first = split * per;
    let slabs = min((p.K + TILE_K - 1u) / TILE_K, first + per);  // this split: slabs first .. slabs - 1
    let kb = first * TILE_K;

    // Registers are named, not arrays: a function-scope array indexed in a loop may live in
    // local memory on some drivers (seen on NVIDIA through Vulkan), which costs 5x here.
    var pa0: Quad; var pa1: Quad; var pb0: Quad; var pb1: Quad;  // the next slab, in flight
    if (li < qa) { pa0 = load_a(z, m0, kb, li); }
    if (li + nt < qa) { pa1 = load_a(z, m0, kb, li + nt); }
    if (li < qb) { pb0 = load_b(z, n0, kb, li); }
    if (li + nt < qb) { pb1 = load_b(z, n0, kb, li + nt); }
    if (li < qa) { store_a(0u, li, pa0); }
    if (li + nt < qa) { store_a(0u, li + nt, pa1); }
    if (li < qb) { store_b(0u, li, pb0); }
    if (li + nt < qb) { store_b(0u, li + nt, pb1); }
    workgroupBarrier();

    var c = Acc();   // f32 sums
    if (FLUSH == 2u) {
        // FLUSH 2: the slabs in pairs, the first from stage 0 and the second from stage 1, and the
        // pair's partial sums added to the accumulators once after it, with no branch around the
        // FMAs (a pair's second slab past this split's last is staged as zeros). The loop below
        // with FLUSH 2 tested the slab's parity before each flush, and NVIDIA's compiler then
        // re-packed the partial sums at every FMA (1.4-1.7x slower than FLUSH 1).
        for (var t = first; t < slabs; t += 2u) {
            var h = Sums();  // this pair's sums
            let k1 = (t + 1u) * TILE_K;
            let second = t + 1u < slabs;
            if (PREFETCH) {
                pa0 = Quad(); pa1 = Quad(); pb0 = Quad(); pb1 = Quad();
                if (second) {
                    if (li < qa) { pa0 = load_a(z, m0, k1, li); }
                    if (li + nt < qa) { pa1 = load_a(z, m0, k1, li + nt); }
                    if (li < qb) { pb0 = load_b(z, n0, k1, li); }
                    if (li + nt < qb) { pb1 = load_b(z, n0, k1, li + nt); }
                }
            }
            for (var kk = 0u; kk < TILE_K; kk += 8u) {  // stage 0
                let at = lid.y + kk * sa();
                let bt = lid.x + kk * sb();
                mac(&h, at, bt);
                mac(&h, at + sa(), bt + sb());
                mac(&h, at + 2u * sa(), bt + 2u * sb());
                mac(&h, at + 3u * sa(), bt + 3u * sb());
                mac(&h, at + 4u * sa(), bt + 4u * sb());
                mac(&h, at + 5u * sa(), bt + 5u * sb());
                mac(&h, at + 6u * sa(), bt + 6u * sb());
                mac(&h, at + 7u * sa(), bt + 7u * sb());
            }
            if (!PREFETCH) {
                pa0 = Quad(); pa1 = Quad(); pb0 = Quad(); pb1 = Quad();
                if (second) {
                    if (li < qa) { pa0 = load_a(z, m0, k1, li); }
                    if (li + nt < qa) { pa1 = load_a(z, m0, k1, li + nt); }
                    if (li < qb) { pb0 = load_b(z, n0, k1, li); }
                    if (li + nt < qb) { pb1 = load_b(z, n0, k1, li + nt); }
                }
            }
            if (li < qa) { store_a(1u, li, pa0); }
            if (li + nt < qa) { store_a(1u, li + nt, pa1); }
            if (li < qb) { store_b(1u, li, pb0); }
            if (li + nt < qb) { store_b(1u, li + nt, pb1); }
            workgroupBarrier();
            let k2 = (t + 2u) * TILE_K;
            let next = t + 2u < slabs;
            if (next && PREFETCH) {
                if (li < qa) { pa0 = load_a(z, m0, k2, li); }
                if (li + nt < qa) { pa1 = load_a(z, m0, k2, li + nt); }
                if (li < qb) { pb0 = load_b(z, n0, k2, li); }
                if (li + nt < qb) { pb1 = load_b(z, n0, k2, li + nt); }
            }
            for (var kk = 0u; kk < TILE_K; kk += 8u) {  // stage 1
                let at = TILE_K * sa() + lid.y + kk * sa();
                let bt = TILE_K * sb() + lid.x + kk * sb();
                mac(&h, at, bt);
                mac(&h, at + sa(), bt + sb());
                mac(&h, at + 2u * sa(), bt + 2u * sb());
                mac(&h, at + 3u * sa(), bt + 3u * sb());
                mac(&h, at + 4u * sa(), bt + 4u * sb());
                mac(&h, at + 5u * sa(), bt + 5u * sb());
                mac(&h, at + 6u * sa(), bt + 6u * sb());
                mac(&h, at + 7u * sa(), bt + 7u * sb());
            }
            flush_pair(&c, h);
            if (next && !PREFETCH) {
                if (li < qa) { pa0 = load_a(z, m0, k2, li); }
                if (li + nt < qa) { pa1 = load_a(z, m0, k2, li + nt); }
                if (li < qb) { pb0 = load_b(z, n0, k2, li); }
                if (li + nt < qb) { pb1 = load_b(z, n0, k2, li + nt); }
            }
            if (next) {
                if (li < qa) { store_a(0u, li, pa0); }
                if (li + nt < qa) { store_a(0u, li + nt, pa1); }
                if (li < qb) { store_b(0u, li, pb0); }
                if (li + nt < qb) { store_b(0u, li + nt, pb1); }
            }
            workgroupBarrier();
        }
    }
    var h = Sums();  // this slab's f16 sums
    for (var t = select(first, slabs, FLUSH == 2u); t < slabs; t++) {  // (FLUSH 2 ran above)
        let s = (t - first) % 2u;
        let more = t + 1u < slabs;
        let k0 = (t + 1u) * TILE_K;
        if (more && PREFETCH) {
            if (li < qa) { pa0 = load_a(z, m0, k0, li); }
            if (li + nt < qa) { pa1 = load_a(z, m0, k0, li + nt); }
            if (li < qb) { pb0 = load_b(z, n0, k0, li); }
            if (li + nt < qb) { pb1 = load_b(z, n0, k0, li + nt); }
        }
        let abase = s * TILE_K * sa() + lid.y;
        let bbase = s * TILE_K * sb() + lid.x;
        for (var kk = 0u; kk < TILE_K; kk += 8u) {  // TILE_K is a multiple of 8
            let at = abase + kk * sa();
            let bt = bbase + kk * sb();
            mac(&h, at, bt);
            mac(&h, at + sa(), bt + sb());
            mac(&h, at + 2u * sa(), bt + 2u * sb());
            mac(&h, at + 3u * sa(), bt + 3u * sb());
            mac(&h, at + 4u * sa(), bt + 4u * sb());
            mac(&h, at + 5u * sa(), bt + 5u * sb());
            mac(&h, at + 6u * sa(), bt + 6u * sb());
            mac(&h, at + 7u * sa(), bt + 7u * sb());
        }
        if (!more || (t - first + 1u) % FLUSH == 0u) {
            c.r00 += vec4<f32>(h.r00); c.r01 += vec4<f32>(h.r01); c.r10 += vec4<f32>(h.r10); c.r11 += vec4<f32>(h.r11);
            c.r20 += vec4<f32>(h.r20); c.r21 += vec4<f32>(h.r21); c.r30 += vec4<f32>(h.r30); c.r31 += vec4<f32>(h.r31);
            c.r40 += vec4<f32>(h.r40); c.r41 += vec4<f32>(h.r41); c.r50 += vec4<f32>(h.r50); c.r51 += vec4<f32>(h.r51);
            c.r60 += vec4<f32>(h.r60); c.r61 += vec4<f32>(h.r61); c.r70 += vec4<f32>(h.r70); c.r71 += vec4<f32>(h.r71);
            h = Sums();
        }
        if (more && !PREFETCH) {  // loaded now: the registers are free during the FMAs
            if (li < qa) { pa0 = load_a(z, m0, k0, li); }
            if (li + nt < qa) { pa1 = load_a(z, m0, k0, li + nt); }
            if (li < qb) { pb0 = load_b(z, n0, k0, li); }
            if (li + nt < qb) { pb1 = load_b(z, n0, k0, li + nt); }
        }
        if (more) {
            if (li < qa) { store_a(1u - s, li, pa0); }
            if (li + nt < qa) { store_a(1u - s, li + nt, pa1); }
            if (li < qb) { store_b(1u - s, li, pb0); }
            if (li + nt < qb) { store_b(1u - s, li + nt, pb1); }
        }
        workgroupBarrier();
    }

    let n_lo = n0 + 4u * lid.x;
    let n_hi = n0 + TILE_N / 2u + 4u * lid.x;
    let m_lo = m0 + 4u * lid.y;
    let m_hi = m0 + TILE_M / 2u + 4u * lid.y;
    if (GATED) {
        let col = n0 / 2u + 4u * lid.x;
        store_gated(z, m_lo + 0u, col, c.r00, c.r01); store_gated(z, m_lo + 1u, col, c.r10, c.r11);
        store_gated(z, m_lo + 2u, col, c.r20, c.r21); store_gated(z, m_lo + 3u, col, c.r30, c.r31);
        store_gated(z, m_hi + 0u, col, c.r40, c.r41); store_gated(z, m_hi + 1u, col, c.r50, c.r51);
        store_gated(z, m_hi + 2u, col, c.r60, c.r61); store_gated(z, m_hi + 3u, col, c.r70, c.r71);
        return;
    }
    put(z, split, m_lo + 0u, n_lo, c.r00); put(z, split, m_lo + 1u, n_lo, c.r10);
    put(z, split, m_lo + 2u, n_lo, c.r20); put(z, split, m_lo + 3u, n_lo, c.r30);
    put(z, split, m_hi + 0u, n_lo, c.r40); put(z, split, m_hi + 1u, n_lo, c.r50);
    put(z, split, m_hi + 2u, n_lo, c.r60); put(z, split, m_hi + 3u, n_lo, c.r70);
    if (COLS == 8u) {
        put(z, split, m_lo + 0u, n_hi, c.r01); put(z, split, m_lo + 1u, n_hi, c.r11);
        put(z, split, m_lo + 2u, n_hi, c.r21); put(z, split, m_lo + 3u, n_hi, c.r31);
        put(z, split, m_hi + 0u, n_hi, c.r41); put(z, split, m_hi + 1u, n_hi, c.r51);
        put(z, split, m_hi + 2u, n_hi, c.r61); put(z, split, m_hi + 3u, n_hi, c.r71);
    }
}

// One 4-column group of C: the epilogue, or this split's partial.
fn put(z: u32, split: u32, m: u32, n: u32, acc: vec4<f32>) {
    if (SPLIT_K == 1u) {
        store_c(z, m, n, acc);
        return;
    }
    if (m >= p.M || n >= p.N) { return; }
    part[((split * p.batch + z) * p.M + m) * (p.N / 4u) + n / 4u] = acc;
}

// Split-K's second pass: C = epilogue(sum of the partials), one invocation per 4 columns.
@compute @workgroup_size(256)
fn reduce_main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let i = (wid.y * nwg.x + wid.x) * 256u + li;
    let per_item = p.M * (p.N / 4u);
    if (i >= p.batch * per_item) { return; }
    let z = i / per_item;
    let r = i % per_item;
    var acc = vec4<f32>(0.0);
    for (var s = 0u; s < SPLIT_K; s++) { acc += part[(s * p.batch + z) * per_item + r]; }
    store_c(z, r / (p.N / 4u), 4u * (r % (p.N / 4u)), acc);
}
