// y = x W^T + b for a few rows of x (M <= ROWS): the UNet's time-embedding projections (M = the
// batch), products bound by reading W once. Each workgroup computes COLS output columns; the
// LANES invocations of a column split its K, consecutive invocations reading consecutive
// elements of W's row, UNROLL elements apart in flight at once (their loads issued before their
// products: one memory latency per UNROLL elements, not per element), each invocation keeping
// one f32 partial sum per row; the partial sums are then added in workgroup memory (a tree).
// No branch in the loop: indices past M, N or K are clamped, their W elements taken as zero, and
// what clamped rows and columns compute is never written.
// x: (M, K), W: (N, K) (PyTorch's layout), b: (N), y: (M, N)
struct Params { M: u32, N: u32, K: u32, has_bias: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<T>;
@group(0) @binding(2) var<storage, read> w: array<T>;
@group(0) @binding(3) var<storage, read> b: array<T>;
@group(0) @binding(4) var<storage, read_write> y: array<T>;

const ROWS = 4u;
const LANES = 64u;
const COLS = 4u;  // LANES * COLS = the workgroup size
const UNROLL = 4u;
var<workgroup> part: array<f32, 1024>;  // ROWS * COLS * LANES, in (row, column, lane) order

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let lane = li % LANES;
    let col = li / LANES;
    let n = wg.x * COLS + col;
    let wr = min(n, p.N - 1u) * p.K;
    var acc: array<f32, ROWS>;
    for (var k0 = lane; k0 < p.K; k0 += LANES * UNROLL) {
        var wv: array<f32, UNROLL>;
        var kk: array<u32, UNROLL>;
        for (var j = 0u; j < UNROLL; j++) {
            let k = k0 + j * LANES;
            kk[j] = min(k, p.K - 1u);
            wv[j] = select(0.0, f32(w[wr + kk[j]]), k < p.K);
        }
        for (var r = 0u; r < ROWS; r++) {
            let xr = min(r, p.M - 1u) * p.K;
            for (var j = 0u; j < UNROLL; j++) {
                acc[r] += f32(x[xr + kk[j]]) * wv[j];
            }
        }
    }
    for (var r = 0u; r < ROWS; r++) {
        part[(r * COLS + col) * LANES + lane] = acc[r];
    }
    workgroupBarrier();
    for (var s = LANES / 2u; s > 0u; s >>= 1u) {
        if (lane < s) {
            for (var r = 0u; r < ROWS; r++) {
                let i = (r * COLS + col) * LANES + lane;
                part[i] += part[i + s];
            }
        }
        workgroupBarrier();
    }
    // the column's first M invocations write its M outputs: invocation `lane` row `lane`
    if (lane < p.M && n < p.N) {
        var v = part[(lane * COLS + col) * LANES];
        if (p.has_bias != 0u) { v += f32(b[n]); }
        y[lane * p.N + n] = T(v);
    }
}
