// The browser executor of engine plans (docs/engine-plans.md): WebGPU, ES modules, no build
// step. A PlanRunner loads one plan on one GPUDevice (pipelines, buffers, uniform buffers,
// bind groups, weights fetched by byte range and cached by sha256), then runs its stages or its
// whole generation and returns host arrays, wall times per stage (the denoising loop, run back
// to back, as one), GPU time per kernel where the adapter has timestamp queries, and the bytes
// its buffers hold. It keeps a plan within a GPU memory budget: its weights are resident (all
// uploaded at load) or staged (a stage's weights uploaded before it runs, those of other stages
// released first), as engine/fit.py decides, and a plan that fits neither way is refused before
// anything is allocated. Every failure is a PlanError with a kind the host can act on.

import { BYTES_PER, HALVES, b64ToBytes, convertWeight, floatToHalf, pad4, sha256Hex } from "./bytes.js";
import { PlanError } from "./errors.js";

export const SCHEMA = 1;
export const FORMAT = "devicefarm-engine-plan";
const WEIGHT_CACHE = "devicefarm-weights-v1";
const SUBMIT_EVERY = 64; // dispatches per queue submit, as the Python executors do

// ---- the adapter ---------------------------------------------------------------------------

const LIMITS = ["maxStorageBufferBindingSize", "maxBufferSize", "maxComputeWorkgroupsPerDimension",
  "maxStorageBuffersPerShaderStage", "maxComputeWorkgroupStorageSize", "maxComputeInvocationsPerWorkgroup",
  "maxComputeWorkgroupSizeX", "maxComputeWorkgroupSizeY"];
const WANTED_FEATURES = ["shader-f16", "timestamp-query", "subgroups"];

export async function requestAdapter() {
  if (!("gpu" in navigator)) {
    throw new PlanError("no-webgpu", `this browser has no WebGPU (navigator.gpu is missing; secure context: ${isSecureContext})`);
  }
  const adapter = await navigator.gpu.requestAdapter({ powerPreference: "high-performance" });
  if (!adapter) throw new PlanError("adapter", "navigator.gpu.requestAdapter() found no adapter");
  return adapter;
}

// An adapter description as engine/device.py writes it (engine/adapters/*.json: kebab-case
// limits, "subgroup") can be given to the page to behave as that adapter: it requests exactly
// that adapter's limits (where this one offers as much), none of the features it lacks, and
// keeps its memory budget. How a phone's browser is tested on a machine without that phone.
const FEATURE_NAMES = { subgroup: "subgroups" };
const camel = (name) => name.replace(/-([a-z])/g, (_, c) => c.toUpperCase());

export function emulatedAdapter(caps) {
  if (!caps) return null;
  const limits = {};
  for (const [name, value] of Object.entries(caps.limits || {})) limits[camel(name)] = Number(value);
  return { vendor: caps.vendor || "", architecture: caps.architecture || "", device: caps.device || "",
    description: caps.description || "", features: (caps.features || []).map((f) => FEATURE_NAMES[f] || f),
    limits, memoryBudgetBytes: caps.memory_budget_bytes ?? null };
}

function deviceLimits(adapter, emulate) {
  const limits = {};
  for (const name of LIMITS) {
    const want = emulate && emulate.limits[name] != null ? emulate.limits[name] : adapter.limits[name];
    limits[name] = Math.min(want, adapter.limits[name]);
  }
  return limits;
}

function deviceFeatures(adapter, emulate) {
  return WANTED_FEATURES.filter((f) => adapter.features.has(f) && (!emulate || emulate.features.includes(f)));
}

export function describeAdapter(adapter, emulate = null) {
  const info = adapter.info || {};
  const own = { vendor: info.vendor || "", architecture: info.architecture || "", device: info.device || "",
    description: info.description || "" };
  if (emulate) {
    return { vendor: emulate.vendor, architecture: emulate.architecture, device: emulate.device,
      description: emulate.description, features: deviceFeatures(adapter, emulate).sort(),
      limits: deviceLimits(adapter, emulate), user_agent: navigator.userAgent, emulated_on: own,
      memory_budget_bytes: emulate.memoryBudgetBytes };
  }
  const limits = {};
  for (const name of LIMITS) limits[name] = adapter.limits[name];
  return { ...own, features: Array.from(adapter.features).sort(), limits, user_agent: navigator.userAgent };
}

// A device with every wanted feature the adapter has and the adapter's own maximum for the
// limits plans need (the defaults are far below what Stable Diffusion needs); or, emulating
// another adapter, its features and limits.
export async function openDevice(adapter, emulate = null) {
  const requiredFeatures = deviceFeatures(adapter, emulate);
  const requiredLimits = deviceLimits(adapter, emulate);
  const device = await adapter.requestDevice({ requiredFeatures, requiredLimits });
  return device;
}

// What a device has compiled, for every plan loaded on it: shader modules by their source,
// then each module's pipelines by entry point and override constants. Pipelines (layout "auto")
// are immutable and their bind groups are each runner's own, so plans can share them.
const COMPILED = new WeakMap();

function compiledOf(device) {
  if (!COMPILED.has(device)) COMPILED.set(device, { modules: new Map(), pipelines: new Map() });
  return COMPILED.get(device);
}

// ---- memory ---------------------------------------------------------------------------------

// What a plan's runner allocates (engine/fit.py's plan_memory, the same numbers): a weight or
// activation buffer that only one stage's commands use (its dispatches, copies and writes, and
// the stage's own inputs and outputs) is that stage's; every other buffer, and the uniforms,
// the plan's.
export function planMemory(plan) {
  const users = new Map();
  const note = (id, who) => { if (!users.has(id)) users.set(id, new Set()); users.get(id).add(who); };
  const scan = (commands, who) => {
    for (const c of commands) {
      if (c.op === "dispatch") for (const [, id] of c.bindings) note(id, who);
      else if (c.op === "write" || c.op === "input") note(c.buffer, who);
      else if (c.op === "copy") { note(c.src, who); note(c.dst, who); }
    }
  };
  for (const [name, stage] of Object.entries(plan.stages)) {
    scan(stage.commands, name);
    for (const io of [...Object.values(stage.inputs), ...Object.values(stage.outputs)]) note(io.buffer, name);
  }
  scan(plan.generate, "generate");
  for (const io of Object.values(plan.outputs)) note(io.buffer, "generate");
  const stageBuffers = Object.fromEntries(Object.keys(plan.stages).map((name) => [name, []]));
  const persistent = [];
  for (const b of plan.buffers) {
    const who = users.get(b.id) || new Set();
    const only = who.size === 1 ? [...who][0] : null;
    if ((b.kind === "weight" || b.kind === "activation") && only in stageBuffers) stageBuffers[only].push(b.id);
    else persistent.push(b.id);
  }
  const size = (ids) => ids.reduce((a, id) => a + plan.buffers[id].size, 0);
  let uniformBytes = 0;
  for (const u of plan.uniforms) uniformBytes += atob(u).length;
  const stageBytes = Object.fromEntries(Object.entries(stageBuffers).map(([n, ids]) => [n, size(ids)]));
  const persistentBytes = size(persistent) + uniformBytes;
  return { persistent, persistentBytes, stageBuffers, stageBytes, uniformBytes,
    residentBytes: size(plan.buffers.map((b) => b.id)) + uniformBytes,
    stagedBytes: persistentBytes + Math.max(0, ...Object.values(stageBytes)) };
}

// "auto", "resident" or "staged" resolved against a budget (null: none), as engine/fit.py does.
export function chooseResidency(memory, budgetBytes, residency = "auto") {
  if (!["auto", "resident", "staged"].includes(residency)) {
    throw new PlanError("input", `residency ${residency}: expected auto, resident or staged`);
  }
  if (residency !== "auto") return residency;
  return budgetBytes == null || memory.residentBytes <= budgetBytes ? "resident" : "staged";
}

// ---- the page's weights -----------------------------------------------------------------------

// One GPU copy of each weight for every plan a page has loaded: keyed by the stored bytes'
// sha256 and the GPU element type, counted by the runners holding it, destroyed when the last
// lets it go. Plans of one model (other sizes, step counts, guidance) share their weights.
export class WeightStore {
  constructor(device) {
    this.device = device;
    this.entries = new Map(); // key -> {buffer, size, holders}
    this.bytes = 0; // GPU bytes of the weights held
  }

  static key(b) {
    return `${b.sha256}/${b.dtype}/${b.size}`;
  }

  // The buffer of weight `b` and how it was got: "shared" (on the GPU already), or what
  // fetchWeight did ("cached" or "fetched", with the bytes fetched).
  async acquire(b, fetchWeight, usage) {
    const key = WeightStore.key(b);
    const held = this.entries.get(key);
    if (held) {
      held.holders++;
      return { buffer: held.buffer, how: "shared", fetchedBytes: 0 };
    }
    const got = await fetchWeight(b);
    const again = this.entries.get(key); // another runner put it there while this one fetched
    if (again) {
      again.holders++;
      return { buffer: again.buffer, how: "shared", fetchedBytes: got.fetchedBytes };
    }
    const buffer = this.device.createBuffer({ size: b.size, usage, label: `weight ${b.name}` });
    this.device.queue.writeBuffer(buffer, 0, pad4(convertWeight(got.bytes, b.stored, b.dtype)));
    this.entries.set(key, { buffer, size: b.size, holders: 1 });
    this.bytes += b.size;
    return { buffer, how: got.fetchedBytes ? "fetched" : "cached", fetchedBytes: got.fetchedBytes };
  }

  release(b) {
    const key = WeightStore.key(b);
    const held = this.entries.get(key);
    if (!held || --held.holders > 0) return;
    held.buffer.destroy();
    this.entries.delete(key);
    this.bytes -= held.size;
  }
}

// ---- the executor --------------------------------------------------------------------------

export class PlanRunner {
  // plan: the parsed plan; fetchWeight(buffer) -> Promise<Uint8Array> of its stored bytes;
  // fetchShader(path, sha256) -> Promise<string>
  // weights: the page's WeightStore (one is made for this runner alone when none is given)
  constructor(device, plan, weights = null) {
    this.device = device;
    this.plan = plan;
    this.weights = weights || new WeightStore(device);
    this.lost = null;
    device.lost.then((info) => { this.lost = info; });
  }

  static check(plan, adapterFeatures, adapterLimits) {
    if (!plan || plan.format !== FORMAT) throw new PlanError("schema", `not an engine plan (format ${plan && plan.format})`);
    if (plan.schema !== SCHEMA) throw new PlanError("schema", `plan schema ${plan.schema}; this executor reads schema ${SCHEMA}`);
    const missing = plan.requires.features.filter((f) => !adapterFeatures.has(f));
    if (missing.length) throw new PlanError("missing-feature", `the plan needs adapter feature(s) ${missing.join(", ")}, which this adapter lacks`);
    for (const [name, need] of Object.entries(plan.requires.limits)) {
      if (adapterLimits[name] !== undefined && need > adapterLimits[name]) {
        throw new PlanError("limit", `the plan needs ${name} >= ${need}; this adapter allows ${adapterLimits[name]}`);
      }
    }
  }

  // budgetBytes: the most GPU memory the plan may hold (null: no budget); residency: auto,
  // resident or staged.
  async load({ fetchWeight, fetchShader, onProgress, budgetBytes = null, residency = "auto" }) {
    const d = this.device;
    const plan = this.plan;
    PlanRunner.check(plan, d.features, d.limits);
    this.memory = planMemory(plan);
    this.residency = chooseResidency(this.memory, budgetBytes, residency);
    const peak = this.residency === "resident" ? this.memory.residentBytes : this.memory.stagedBytes;
    if (budgetBytes != null && peak > budgetBytes) {
      throw new PlanError("over-budget", `peak GPU memory ${peak.toLocaleString("en-US")} bytes (${this.residency}) ` +
        `> the budget of ${budgetBytes.toLocaleString("en-US")}`);
    }
    const t0 = performance.now();
    const storage = GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST;
    // shaders and pipelines: compiled once a device (another plan of the model, another size
    // or step count, reuses them: a software adapter spends seconds a plan compiling)
    const compiled = compiledOf(d);
    const modules = new Map();
    const header = plan.shader_header;
    for (const p of plan.pipelines) {
      const key = `${p.shader}/${p.dtype}`;
      if (modules.has(key)) continue;
      const source = header[p.dtype] + (await fetchShader(plan.shaders[p.shader].path, plan.shaders[p.shader].sha256));
      let module = compiled.modules.get(source);
      if (!module) {
        d.pushErrorScope("validation");
        module = d.createShaderModule({ code: source, label: key });
        const info = await module.getCompilationInfo();
        const errors = info.messages.filter((m) => m.type === "error");
        await d.popErrorScope();
        if (errors.length) {
          throw new PlanError("shader-compile", `${plan.shaders[p.shader].path} (${p.dtype}): ` +
            errors.map((m) => `${m.lineNum}:${m.linePos} ${m.message}`).join("; "));
        }
        compiled.modules.set(source, module);
      }
      modules.set(key, module);
    }
    this.pipelines = [];
    for (const p of plan.pipelines) {
      const module = modules.get(`${p.shader}/${p.dtype}`);
      const constants = Object.keys(p.constants).sort().map((k) => [k, p.constants[k]]);
      const key = JSON.stringify([p.entry, constants]);
      const made = compiled.pipelines.get(module) || compiled.pipelines.set(module, new Map()).get(module);
      if (!made.has(key)) {
        const compute = { module, entryPoint: p.entry };
        if (constants.length) compute.constants = p.constants;
        try {
          made.set(key, await d.createComputePipelineAsync({ layout: "auto", compute, label: p.shader }));
        } catch (e) {
          throw new PlanError("pipeline", `${p.shader}:${p.entry} ${JSON.stringify(p.constants)}: ${e.message}`);
        }
      }
      this.pipelines.push(made.get(key));
    }
    // buffers: weights from the cache or by range, constants written, the rest empty; all of
    // them now (resident), or the plan's now and each stage's before it runs (staged)
    this.buffers = plan.buffers.map(() => null);
    this.bytes = 0;
    for (const b of plan.buffers) if (b.kind !== "weight") this.bytes += b.size;
    this.weightBytes = 0;
    this.liveBytes = 0;
    this.peakBytes = 0;
    this.uploadMs = 0;
    this.fetchWeight = fetchWeight;
    this.fetched = { bytes: 0, cached: 0, fetched: 0, shared: 0 };
    this.storage = storage;
    for (const b of plan.buffers) {
      if (b.kind === "weight" && !b.file) throw new PlanError("input", `plan weight ${b.component}/${b.name} names no file`);
    }
    d.pushErrorScope("out-of-memory");
    this.uniforms = plan.uniforms.map((u) => {
      const data = b64ToBytes(u);
      const buf = d.createBuffer({ size: data.byteLength, usage: GPUBufferUsage.UNIFORM | GPUBufferUsage.COPY_DST });
      d.queue.writeBuffer(buf, 0, data);
      return buf;
    });
    const oom = await d.popErrorScope();
    if (oom) throw new PlanError("out-of-memory", `allocating the plan's uniforms: ${oom.message}`);
    this.hold(this.memory.uniformBytes);
    await this.allocate(this.residency === "resident" ? plan.buffers.map((b) => b.id) : this.memory.persistent, onProgress);
    this.stages = {};
    if (this.residency === "resident") {
      for (const name of Object.keys(plan.stages)) await this.stage(name);
    }
    d.pushErrorScope("validation");
    this.program = this.prepare(plan.generate);
    const invalid = await d.popErrorScope();
    if (invalid) throw new PlanError("validation", `preparing the plan's bind groups: ${invalid.message}`);
    this.timestamps = d.features.has("timestamp-query");
    return { load_ms: performance.now() - t0, weight_bytes_fetched: this.fetched.bytes, weights_fetched: this.fetched.fetched,
      weights_cached: this.fetched.cached, weights_shared: this.fetched.shared, buffer_bytes: this.bytes,
      weight_bytes: this.weightBytes, page_weight_bytes: this.weights.bytes, residency: this.residency,
      peak_bytes: this.peakBytes, live_bytes: this.liveBytes };
  }

  hold(bytes) {
    this.liveBytes += bytes;
    this.peakBytes = Math.max(this.peakBytes, this.liveBytes);
  }

  // Create the buffers `ids` that are not on the GPU: weights fetched (from the cache or by
  // range) and uploaded, constants written, the rest empty.
  async allocate(ids, onProgress) {
    const d = this.device;
    const todo = ids.filter((id) => !this.buffers[id]);
    const weights = todo.filter((id) => this.plan.buffers[id].kind === "weight").length;
    if (weights && !this.fetchWeight) throw new PlanError("input", "the plan's weights have no source to load them from");
    d.pushErrorScope("out-of-memory");
    let done = 0;
    for (const id of todo) {
      const b = this.plan.buffers[id];
      let buf;
      if (b.kind === "weight") {
        const got = await this.weights.acquire(b, this.fetchWeight, this.storage);
        buf = got.buffer;
        this.fetched.bytes += got.fetchedBytes;
        this.fetched[got.how]++;
        this.weightBytes += b.size;
        done++;
        if (onProgress && done % 16 === 0) onProgress(done, weights);
      } else {
        buf = d.createBuffer({ size: b.size, usage: this.storage, label: `${b.kind} ${b.name || b.id}` });
        if (b.kind === "constant") d.queue.writeBuffer(buf, 0, pad4(b64ToBytes(b.data)));
      }
      this.buffers[id] = buf;
      this.hold(b.size);
    }
    const oom = await d.popErrorScope();
    if (oom) throw new PlanError("out-of-memory", `allocating the plan's buffers: ${oom.message}`);
  }

  release(ids) {
    for (const id of ids) {
      const buf = this.buffers[id];
      if (!buf) continue;
      const b = this.plan.buffers[id];
      if (b.kind === "weight") {
        this.weights.release(b);
        this.weightBytes -= b.size;
      } else {
        buf.destroy();
      }
      this.buffers[id] = null;
      this.liveBytes -= b.size;
    }
  }

  // A stage's commands, ready to run: under staged residency what it owns (its weights and
  // scratch) is allocated and uploaded first, after what the other stages own is released.
  async stage(name) {
    if (this.stages[name]) return this.stages[name];
    const spec = this.plan.stages[name];
    if (!spec) throw new PlanError("input", `the plan has no stage ${name}`);
    if (this.residency === "staged") {
      await this.sync(); // the GPU is done with what is released
      const t0 = performance.now();
      for (const [other, ids] of Object.entries(this.memory.stageBuffers)) {
        if (other === name) continue;
        delete this.stages[other]; // its bind groups name buffers released here
        this.release(ids);
      }
      await this.allocate(this.memory.stageBuffers[name]);
      this.uploadMs += performance.now() - t0;
    }
    this.device.pushErrorScope("validation");
    const prepared = this.prepare(spec.commands);
    const invalid = await this.device.popErrorScope();
    if (invalid) throw new PlanError("validation", `preparing stage ${name}'s bind groups: ${invalid.message}`);
    this.stages[name] = prepared;
    return prepared;
  }

  prepare(commands) {
    const d = this.device;
    return commands.map((c) => {
      if (c.op === "dispatch") {
        const pipeline = this.pipelines[c.pipeline];
        const entries = [{ binding: 0, resource: { buffer: this.uniforms[c.uniform] } }];
        for (const [binding, id, size] of c.bindings) entries.push({ binding, resource: { buffer: this.buffers[id], offset: 0, size } });
        const group = d.createBindGroup({ layout: pipeline.getBindGroupLayout(0), entries, label: c.label });
        return { op: "dispatch", pipeline, group, groups: c.groups, label: c.label };
      }
      if (c.op === "write") return { op: "write", buffer: this.buffers[c.buffer], data: pad4(b64ToBytes(c.data)) };
      if (c.op === "copy") return { op: "copy", src: this.buffers[c.src], dst: this.buffers[c.dst], size: c.size };
      if (["run", "input", "step"].includes(c.op)) return c;
      throw new PlanError("schema", `the plan has a command ${c.op} this executor does not know`);
    });
  }

  // ---- running ---------------------------------------------------------------------------

  flush() {
    if (!this.encoder) return;
    if (this.pass) { this.pass.end(); this.pass = null; }
    if (this.profile && this.profile.used) this.resolveTimestamps();
    this.device.queue.submit([this.encoder.finish()]);
    this.encoder = null;
    this.recorded = 0;
  }

  async sync() {
    this.flush();
    await this.device.queue.onSubmittedWorkDone();
    if (this.lost) throw new PlanError("device-lost", `the GPU device was lost: ${this.lost.reason} ${this.lost.message}`);
  }

  encoderNow() {
    if (!this.encoder) this.encoder = this.device.createCommandEncoder();
    return this.encoder;
  }

  async walk(commands, inputs) {
    for (const c of commands) {
      if (c.op === "dispatch") {
        const enc = this.encoderNow();
        let pass;
        if (this.profile) {
          if (this.profile.used + 2 > this.profile.capacity) this.flush();
          const index = this.profile.used;
          this.profile.labels.push(c.label);
          this.profile.used += 2;
          pass = this.encoderNow().beginComputePass({ timestampWrites: { querySet: this.profile.querySet,
            beginningOfPassWriteIndex: index, endOfPassWriteIndex: index + 1 } });
        } else {
          if (!this.pass) this.pass = enc.beginComputePass();
          pass = this.pass;
        }
        pass.setPipeline(c.pipeline);
        pass.setBindGroup(0, c.group);
        pass.dispatchWorkgroups(c.groups[0], c.groups[1], c.groups[2]);
        if (this.profile) pass.end();
        if (++this.recorded >= SUBMIT_EVERY && !this.profile) this.flush();
      } else if (c.op === "write") {
        this.flush();
        this.device.queue.writeBuffer(c.buffer, 0, c.data);
      } else if (c.op === "copy") {
        const enc = this.encoderNow();
        if (this.pass) { this.pass.end(); this.pass = null; }
        enc.copyBufferToBuffer(c.src, 0, c.dst, 0, c.size);
      } else if (c.op === "run") {
        if (this.loopT0 !== null && c.stage === "unet_step") {  // inside the loop: no wait
          await this.walk(await this.stage(c.stage), inputs);
          continue;
        }
        await this.sync();
        if (this.loopT0 !== null) {  // the loop is done: the stage after it starts
          this.stageMs.unet_step = performance.now() - this.loopT0;
          this.loopT0 = null;
        }
        const prepared = await this.stage(c.stage); // staged weights go up outside the stage's time
        const t0 = performance.now();
        await this.walk(prepared, inputs);
        await this.sync();
        this.stageMs[c.stage] = (this.stageMs[c.stage] || 0) + performance.now() - t0;
      } else if (c.op === "input") {
        let value = inputs[c.name];
        if (c.name === "noise") value = value[c.index];
        if (!value) throw new PlanError("input", `the generation needs input ${c.name}${c.name === "noise" ? ` #${c.index}` : ""}`);
        this.flush();
        this.device.queue.writeBuffer(this.buffers[c.buffer], 0, pad4(value));
      } else if (c.op === "step") {  // the loop runs back to back and is timed whole
        if (this.loopT0 === null) {
          if (this.plan.stages.unet_step) await this.stage("unet_step"); // its weights go up before the clock
          await this.sync();
          this.loopT0 = performance.now();
        }
        this.loopSteps += 1;
      }
    }
  }

  async read(io) {
    const bytesPer = BYTES_PER[io.dtype];
    const n = io.shape.reduce((a, b) => a * b, 1);
    const size = Math.ceil((n * bytesPer) / 4) * 4;
    const staging = this.device.createBuffer({ size, usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST });
    this.encoderNow().copyBufferToBuffer(this.buffers[io.buffer], 0, staging, 0, size);
    await this.sync();
    await staging.mapAsync(GPUMapMode.READ);
    const bytes = new Uint8Array(staging.getMappedRange().slice(0, n * bytesPer));
    staging.unmap();
    staging.destroy();
    return { dtype: io.dtype, shape: io.shape, bytes };
  }

  begin() {
    this.stageMs = {};
    this.loopSteps = 0;
    this.loopT0 = null;
    this.uploadMs = 0;
    this.device.pushErrorScope("validation");
  }

  async end() {
    await this.sync();
    const err = await this.device.popErrorScope();
    if (err) throw new PlanError("validation", err.message);
  }

  // One stage alone: inputs {name: Uint8Array of the input's element type}.
  async run(stage, inputs) {
    const spec = this.plan.stages[stage];
    if (!spec) throw new PlanError("input", `the plan has no stage ${stage}`);
    const prepared = await this.stage(stage); // staged: its buffers exist from here
    this.begin();
    for (const [name, io] of Object.entries(spec.inputs)) {
      if (!inputs[name]) throw new PlanError("input", `stage ${stage} needs input ${name}`);
      this.device.queue.writeBuffer(this.buffers[io.buffer], 0, pad4(inputs[name]));
    }
    const t0 = performance.now();
    await this.walk(prepared, {});
    await this.end();
    const outputs = {};
    for (const [name, io] of Object.entries(spec.outputs)) outputs[name] = await this.read(io);
    return { outputs, timings: { [`${stage}_ms`]: performance.now() - t0 } };
  }

  // The whole generation: inputs {input_ids, latents, noise: [..]} as Uint8Arrays.
  async generate(inputs) {
    this.begin();
    const t0 = performance.now();
    try {
      await this.walk(this.program, inputs);
      await this.end();
      if (this.loopT0 !== null) this.stageMs.unet_step = performance.now() - this.loopT0;  // no stage after it
    } finally {
      this.loopT0 = null;
    }
    const outputs = {};
    for (const [name, io] of Object.entries(this.plan.outputs)) outputs[name] = await this.read(io);
    const timings = {};
    for (const [k, v] of Object.entries(this.stageMs)) timings[`${k}_ms`] = v;
    timings.total_ms = performance.now() - t0;
    if (this.uploadMs) timings.weight_upload_ms = this.uploadMs;
    return { outputs, timings, loop_steps: this.loopSteps };
  }

  // Wall times (ms, to GPU completion) of replays of one stage, its inputs as they are (the
  // page fills them with small pseudo-random values first, as a latency job's would be).
  async timeStage(stage, repetitions, warmup) {
    const spec = this.plan.stages[stage];
    if (!spec) throw new PlanError("input", `the plan has no stage ${stage}`);
    const prepared = await this.stage(stage); // staged: its buffers exist from here
    let seed = 12345;
    for (const io of Object.values(spec.inputs)) {
      const n = io.shape.reduce((a, b) => a * b, 1);
      const bytes = new Uint8Array(Math.ceil((n * BYTES_PER[io.dtype]) / 4) * 4);
      const view = io.dtype === "f32" ? new Float32Array(bytes.buffer) : io.dtype === "u32" ? new Uint32Array(bytes.buffer) : new Uint16Array(bytes.buffer);
      for (let i = 0; i < n; i++) {
        seed = (seed * 1103515245 + 12345) >>> 0;
        const u = seed / 4294967296;
        view[i] = io.dtype === "u32" ? Math.floor(u * 100) : HALVES.has(io.dtype) ? floatToHalf(u - 0.5) : u - 0.5;
      }
      this.device.queue.writeBuffer(this.buffers[io.buffer], 0, bytes);
    }
    const times = [];
    this.begin();
    for (let r = 0; r < warmup + repetitions; r++) {
      await this.sync();
      const t0 = performance.now();
      await this.walk(prepared, {});
      await this.sync();
      if (r >= warmup) times.push(performance.now() - t0);
    }
    await this.end();
    return times;
  }

  // Per-kernel GPU times of one stage (timestamp queries, one pass per dispatch), summed by
  // kernel label over `repetitions` runs.
  async kernelTimes(stage, repetitions) {
    if (!this.timestamps) return null;
    const capacity = 4096;
    this.profile = {
      querySet: this.device.createQuerySet({ type: "timestamp", count: capacity }), capacity, used: 0, labels: [],
      pending: [], totals: {},
    };
    try {
      const prepared = await this.stage(stage);
      this.begin();
      for (let r = 0; r < repetitions; r++) await this.walk(prepared, {});
      this.flush();
      await this.end();
      for (const p of this.profile.pending) {
        await p.buffer.mapAsync(GPUMapMode.READ);
        const ticks = new BigUint64Array(p.buffer.getMappedRange());
        p.labels.forEach((label, i) => {
          const ns = Number(ticks[2 * i + 1] - ticks[2 * i]);
          const t = this.profile.totals[label] || (this.profile.totals[label] = { calls: 0, total_ms: 0 });
          t.calls += 1;
          t.total_ms += Math.max(ns, 0) / 1e6;
        });
        p.buffer.unmap();
        p.buffer.destroy();
      }
      return this.profile.totals;
    } finally {
      this.profile.querySet.destroy();
      this.profile = null;
    }
  }

  resolveTimestamps() {
    const p = this.profile;
    const n = p.used;
    const resolve = this.device.createBuffer({ size: n * 8, usage: GPUBufferUsage.QUERY_RESOLVE | GPUBufferUsage.COPY_SRC });
    const read = this.device.createBuffer({ size: n * 8, usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST });
    this.encoder.resolveQuerySet(p.querySet, 0, n, resolve, 0);
    this.encoder.copyBufferToBuffer(resolve, 0, read, 0, n * 8);
    p.pending.push({ buffer: read, labels: p.labels });
    p.labels = [];
    p.used = 0;
  }

  destroy() {
    if (this.buffers) this.release(this.plan.buffers.map((b) => b.id));
    for (const u of this.uniforms || []) u.destroy();
    this.buffers = this.uniforms = null;
  }
}

// ---- the weight cache ----------------------------------------------------------------------

// A weight's stored bytes: from Cache Storage by sha256, or fetched by byte range from
// `baseUrl + buffer.file`, checked against the plan's sha256, then cached.
export function weightFetcher(baseUrl) {
  return async (b) => {
    const key = new Request(new URL(`/weights/${b.sha256}`, location.href));
    let cache = null;
    try {
      cache = await caches.open(WEIGHT_CACHE);
      const hit = await cache.match(key);
      if (hit) {
        const bytes = new Uint8Array(await hit.arrayBuffer());
        if (bytes.byteLength === b.length && (await sha256Hex(bytes)) === b.sha256) return { bytes, fetchedBytes: 0 };
        await cache.delete(key); // damaged entry: fetch again
      }
    } catch (e) {
      cache = null; // no Cache Storage here (an opaque origin): fetch every time
    }
    let response;
    try {
      response = await fetch(new URL(b.file, baseUrl), { headers: { Range: `bytes=${b.offset}-${b.offset + b.length - 1}` } });
    } catch (e) {
      throw new PlanError("weight-fetch", `fetching ${b.file} bytes ${b.offset}+${b.length}: ${e.message}`);
    }
    if (response.status !== 206 && response.status !== 200) {
      throw new PlanError("weight-fetch", `fetching ${b.file} bytes ${b.offset}+${b.length}: HTTP ${response.status}`);
    }
    let bytes = new Uint8Array(await response.arrayBuffer());
    if (response.status === 200) bytes = bytes.subarray(b.offset, b.offset + b.length); // server ignored Range
    const digest = await sha256Hex(bytes);
    if (bytes.byteLength !== b.length || digest !== b.sha256) {
      throw new PlanError("hash-mismatch", `weight ${b.component}/${b.name}: bytes ${b.offset}-${b.offset + b.length} of ${b.file} ` +
        `hash to ${digest.slice(0, 16)}..., the plan says ${b.sha256.slice(0, 16)}...`);
    }
    if (cache) await cache.put(key, new Response(bytes));
    return { bytes, fetchedBytes: bytes.byteLength };
  };
}
