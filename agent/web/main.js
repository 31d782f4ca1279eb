// The page's side of the host protocol (engine/browser.py): fetch the next command from
// /api/next, run it, post the answer to /api/done, forever. Commands: hello (the adapter),
// load (a plan, its shaders and weights), run (one stage), generate (the whole generation),
// kernels (per-kernel GPU times of a stage), unload. Arrays travel as {dtype, shape, b64}.
import { PlanError, PlanRunner, b64ToBytes, bytesToB64, describeAdapter, openDevice, requestAdapter,
  sha256Hex, weightFetcher } from "./plan.js";

const params = new URLSearchParams(location.search);
const session = params.get("session") || "";
const api = (path) => new URL(`/api/${path}?session=${encodeURIComponent(session)}`, location.href);
const state = document.getElementById("state");
const logEl = document.getElementById("log");

function log(text) {
  logEl.textContent = `${new Date().toISOString().slice(11, 23)} ${text}\n` + logEl.textContent.slice(0, 20000);
}

let adapter = null;
let device = null;
const runners = new Map(); // plan sha256 -> PlanRunner

async function gpu() {
  if (!device) {
    adapter = await requestAdapter();
    device = await openDevice(adapter);
    device.lost.then((info) => { log(`device lost: ${info.reason} ${info.message}`); device = null; runners.clear(); });
  }
  return device;
}

function arrayOut(a) {
  return { dtype: a.dtype, shape: a.shape, b64: bytesToB64(a.bytes) };
}

async function handle(cmd) {
  if (cmd.op === "hello") {
    const ad = await requestAdapter();
    return { adapter: describeAdapter(ad), secure: isSecureContext };
  }
  if (cmd.op === "load") {
    const d = await gpu();
    const response = await fetch(cmd.plan_url);
    if (!response.ok) throw new PlanError("input", `fetching the plan: HTTP ${response.status}`);
    const raw = new Uint8Array(await response.arrayBuffer());
    const digest = await sha256Hex(raw);
    if (digest !== cmd.plan_file_sha256) throw new PlanError("plan-hash", `the plan file hashes to ${digest}, not ${cmd.plan_file_sha256}`);
    const plan = JSON.parse(new TextDecoder().decode(raw));
    const runner = new PlanRunner(d, plan);
    const fetchShader = async (path) => {
      const r = await fetch(new URL(path, cmd.shader_base));
      if (!r.ok) throw new PlanError("input", `fetching ${path}: HTTP ${r.status}`);
      return r.text();
    };
    const report = await runner.load({ fetchWeight: weightFetcher(cmd.model_base), fetchShader,
      onProgress: (done, total) => { state.textContent = `loading weights ${done}/${total}`; } });
    runners.get(plan.sha256)?.destroy();
    runners.set(plan.sha256, runner);
    return report;
  }
  const runner = runners.get(cmd.plan);
  if (!runner) throw new PlanError("input", `no plan ${cmd.plan} is loaded`);
  const inputs = {};
  for (const [name, v] of Object.entries(cmd.inputs || {})) {
    inputs[name] = Array.isArray(v) ? v.map((x) => b64ToBytes(x.b64)) : b64ToBytes(v.b64);
  }
  if (cmd.op === "run") {
    const out = await runner.run(cmd.stage, inputs);
    return { outputs: Object.fromEntries(Object.entries(out.outputs).map(([k, a]) => [k, arrayOut(a)])), timings: out.timings };
  }
  if (cmd.op === "generate") {
    const out = await runner.generate(inputs);
    return { outputs: Object.fromEntries(Object.entries(out.outputs).map(([k, a]) => [k, arrayOut(a)])),
      timings: out.timings, step_ms: out.step_ms, buffer_bytes: runner.bytes, weight_bytes: runner.weightBytes };
  }
  if (cmd.op === "time") {
    return { ms: await runner.timeStage(cmd.stage, cmd.repetitions, cmd.warmup || 0) };
  }
  if (cmd.op === "kernels") {
    return { kernels: await runner.kernelTimes(cmd.stage, cmd.repetitions || 1) };
  }
  if (cmd.op === "unload") {
    runner.destroy();
    runners.delete(cmd.plan);
    return {};
  }
  throw new PlanError("input", `unknown command ${cmd.op}`);
}

function errorOf(e) {
  if (e instanceof PlanError) return { kind: e.kind, message: e.message };
  if (e && e.name === "OperationError") return { kind: "device-lost", message: e.message };
  return { kind: "internal", message: `${e && e.name}: ${e && e.message}` };
}

async function loop() {
  state.textContent = "waiting for the host";
  for (;;) {
    let cmd;
    try {
      const r = await fetch(api("next"), { cache: "no-store" });
      if (r.status === 204) continue;
      if (r.status === 410) { state.textContent = "the host ended this session"; return; }
      if (!r.ok) throw new Error(`HTTP ${r.status}`);
      cmd = await r.json();
    } catch (e) {
      state.textContent = `host unreachable (${e.message}); retrying`;
      await new Promise((res) => setTimeout(res, 1000));
      continue;
    }
    state.textContent = `running ${cmd.op}`;
    log(`${cmd.id} ${cmd.op}${cmd.stage ? " " + cmd.stage : ""}`);
    let reply;
    try {
      reply = { id: cmd.id, ok: true, result: await handle(cmd) };
    } catch (e) {
      reply = { id: cmd.id, ok: false, error: errorOf(e) };
      log(`${cmd.id} failed: ${reply.error.kind}: ${reply.error.message}`);
    }
    await fetch(api("done"), { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(reply) });
    state.textContent = "waiting for the host";
  }
}

window.addEventListener("error", (ev) => {
  fetch(api("log"), { method: "POST", body: JSON.stringify({ level: "error", message: String(ev.message) }) });
});
window.addEventListener("unhandledrejection", (ev) => {
  fetch(api("log"), { method: "POST", body: JSON.stringify({ level: "error", message: String(ev.reason) }) });
});
loop();
