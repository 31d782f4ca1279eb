// Micro-kernels that measure an adapter's own ceilings for the roofline (engine/roofline.py):
//   fma_f32   CHAINS independent vec4<f32> FMA chains per invocation, ITERS steps each
//   fma_f16   the same with vec4<f16> (packed halves where the GPU has them); needs shader-f16
//   copy      y = x over vec4<u32>: read and write bandwidth
// The chains' operands come from the buffer, so no compiler can fold them, and every chain
// ends in the output, so none is dead.
struct Params { iters: u32, n: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read_write> y: array<vec4<u32>>;

const CHAINS: u32 = 8u;

fn index(wid: vec3<u32>, nwg: vec3<u32>, li: u32) -> u32 {
    return (wid.y * nwg.x + wid.x) * 256u + li;
}

@compute @workgroup_size(256)
fn fma_f32(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) li: u32) {
    let i = index(wid, nwg, li);
    let seed = bitcast<vec4<f32>>(x[i % 64u]);
    let mul = seed * 1e-3 + 0.999;
    var c: array<vec4<f32>, CHAINS>;
    for (var j = 0u; j < CHAINS; j++) { c[j] = seed + f32(j); }
    for (var t = 0u; t < p.iters; t++) {
        for (var j = 0u; j < CHAINS; j++) { c[j] = fma(c[j], mul, seed); }
    }
    var s = vec4<f32>(0.0);
    for (var j = 0u; j < CHAINS; j++) { s += c[j]; }
    if (i < p.n) { y[i] = bitcast<vec4<u32>>(s); }
}

@compute @workgroup_size(256)
fn copy(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) li: u32) {
    let i = index(wid, nwg, li);
    if (i < p.n) { y[i] = x[i]; }
}
