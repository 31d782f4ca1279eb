// y = x W^T + b for a few rows of x (M <= ROWS): the UNet's time-embedding projections (M = the
// batch), products bound by reading W once. Each workgroup computes COLS output columns; the
// LANES invocations of a column split its K, consecutive invocations reading consecutive
// elements of W's row, each keeping one f32 partial sum per row of x; the partial sums are then
// added in workgroup memory (a tree of LANES / 2, / 4, ...).
// x: (M, K), W: (N, K) (PyTorch's layout), b: (N), y: (M, N)
struct Params { M: u32, N: u32, K: u32, has_bias: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<T>;
@group(0) @binding(2) var<storage, read> w: array<T>;
@group(0) @binding(3) var<storage, read> b: array<T>;
@group(0) @binding(4) var<storage, read_write> y: array<T>;

const ROWS = 8u;
const LANES = 32u;
const COLS = 8u;  // LANES * COLS = the workgroup size
var<workgroup> part: array<f32, 2048>;  // ROWS * COLS * LANES, row-major in (row, column, lane)

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let lane = li % LANES;
    let col = li / LANES;
    let n = wg.x * COLS + col;
    var acc: array<f32, ROWS>;
    if (n < p.N) {
        let wr = n * p.K;
        for (var k = lane; k < p.K; k += LANES) {
            let wk = f32(w[wr + k]);
            for (var m = 0u; m < p.M; m++) {
                acc[m] += f32(x[m * p.K + k]) * wk;
            }
        }
    }
    for (var m = 0u; m < ROWS; m++) {
        part[(m * COLS + col) * LANES + lane] = acc[m];
    }
    workgroupBarrier();
    for (var s = LANES / 2u; s > 0u; s >>= 1u) {
        if (lane < s) {
            for (var m = 0u; m < ROWS; m++) {
                let i = (m * COLS + col) * LANES + lane;
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
