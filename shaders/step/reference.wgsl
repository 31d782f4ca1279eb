// The denoising loop's own kernels (engine/schedulers/program.py): the scheduler's step as a
// fixed linear combination of latent-sized f32 tensors, classifier-free guidance, and the
// scaled, batched input of the next network. Latents and the loop's state stay f32 whatever
// element type T the networks run in.
//   combine  dst[o + i] = sum_k c[k] * in_k[off[k] + i] over k < count, clamped to [lo, hi]
//            when clamp != 0 (DDIM's clip_sample); terms summed in order from 0.
//   guide    dst[i] = u + g * (c - u) with u = eps[i], c = eps[n + i] (batch 2: unconditional
//            then text-conditioned), or dst[i] = eps[i] when batch is 1 (no guidance)
//   prepare  y[b * n + i] = T(g * in0[i]) for every b < batch (the UNet's scaled input, twice
//            with guidance; the VAE's 1 / scaling_factor input once)
//   posterior dst[i] = (mean + exp(0.5 * clamp(logvar, lo, hi)) * in0[i]) * g, with mean = eps[i]
//            and logvar = eps[n + i] (the VAE encoder's moments, batch 1): img2img's first sample
//            before the forward noise, g the VAE's scaling factor
struct Params {
    n: u32, count: u32, clamp: u32, batch: u32,
    lo: f32, hi: f32, out_off: u32, g: f32,
    c0: vec4<f32>, c1: vec4<f32>,
    o0: vec4<u32>, o1: vec4<u32>,
}
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> in0: array<f32>;
@group(0) @binding(2) var<storage, read> in1: array<f32>;
@group(0) @binding(3) var<storage, read> in2: array<f32>;
@group(0) @binding(4) var<storage, read> in3: array<f32>;
@group(0) @binding(5) var<storage, read> in4: array<f32>;
@group(0) @binding(6) var<storage, read> in5: array<f32>;
@group(0) @binding(7) var<storage, read_write> dst: array<f32>;
@group(0) @binding(8) var<storage, read> eps: array<T>;
@group(0) @binding(9) var<storage, read_write> y: array<T>;

fn flat_index(wid: vec3<u32>, nwg: vec3<u32>, li: u32) -> u32 {
    return (wid.y * nwg.x + wid.x) * 256u + li;
}

@compute @workgroup_size(256)
fn combine(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let i = flat_index(wid, nwg, li);
    if (i >= p.n) { return; }
    var acc = 0.0;
    acc = acc + p.c0.x * in0[p.o0.x + i];
    if (p.count > 1u) { acc = acc + p.c0.y * in1[p.o0.y + i]; }
    if (p.count > 2u) { acc = acc + p.c0.z * in2[p.o0.z + i]; }
    if (p.count > 3u) { acc = acc + p.c0.w * in3[p.o0.w + i]; }
    if (p.count > 4u) { acc = acc + p.c1.x * in4[p.o1.x + i]; }
    if (p.count > 5u) { acc = acc + p.c1.y * in5[p.o1.y + i]; }
    if (p.clamp != 0u) { acc = clamp(acc, p.lo, p.hi); }
    dst[p.out_off + i] = acc;
}

@compute @workgroup_size(256)
fn guide(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let i = flat_index(wid, nwg, li);
    if (i >= p.n) { return; }
    let u = f32(eps[i]);
    if (p.batch < 2u) {
        dst[i] = u;
        return;
    }
    let c = f32(eps[p.n + i]);
    dst[i] = u + p.g * (c - u);
}

@compute @workgroup_size(256)
fn prepare(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let i = flat_index(wid, nwg, li);
    if (i >= p.n) { return; }
    let v = T(p.g * in0[i]);
    for (var b = 0u; b < p.batch; b++) {
        y[b * p.n + i] = v;
    }
}

@compute @workgroup_size(256)
fn posterior(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let i = flat_index(wid, nwg, li);
    if (i >= p.n) { return; }
    let mean = f32(eps[i]);
    let logvar = clamp(f32(eps[p.n + i]), p.lo, p.hi);
    dst[i] = (mean + exp(0.5 * logvar) * in0[i]) * p.g;
}
