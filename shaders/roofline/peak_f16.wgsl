// peak.wgsl's FMA micro-kernel in vec4<f16> (packed halves where the GPU has them); compiled
// only where the adapter has shader-f16.
enable f16;

// The chains' operands come from the buffer, so no compiler can fold them, and every chain
// ends in the output, so none is dead.
struct Params { iters: u32, n: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read_write> y: array<vec4<u32>>;

fn index(wid: vec3<u32>, nwg: vec3<u32>, li: u32) -> u32 {
    return (wid.y * nwg.x + wid.x) * 256u + li;
}

@compute @workgroup_size(256)
fn fma_f16(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) li: u32) {
    let i = index(wid, nwg, li);
    let seed = vec4<f16>(bitcast<vec4<f32>>(x[i % 64u]));
    let mul = seed * 1e-3h + 0.999h;
    var c0 = seed + f16(0);
    var c1 = seed + f16(1);
    var c2 = seed + f16(2);
    var c3 = seed + f16(3);
    var c4 = seed + f16(4);
    var c5 = seed + f16(5);
    var c6 = seed + f16(6);
    var c7 = seed + f16(7);
    for (var t = 0u; t < p.iters; t++) {
        c0 = fma(c0, mul, seed); c1 = fma(c1, mul, seed); c2 = fma(c2, mul, seed); c3 = fma(c3, mul, seed);
        c4 = fma(c4, mul, seed); c5 = fma(c5, mul, seed); c6 = fma(c6, mul, seed); c7 = fma(c7, mul, seed);
    }
    let s = vec4<f32>(c0 + c1 + c2 + c3 + c4 + c5 + c6 + c7);
    if (i < p.n) { y[i] = bitcast<vec4<u32>>(s); }
}
