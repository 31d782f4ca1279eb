// The page's side of the host protocol: fetch the next command from /api/next, run it, post the
// answer to /api/done, forever. The host is engine/browser.py (a session named in the query) or
// a farm's hub (orchestrator/browser_hub.py: a device enrolled with a token, agent/web/farm.js).
// Commands: hello (the adapter), deploy (a signed build into the page's cache), load (a plan,
// its shaders and weights, from the host or from a deployed build), run (one stage), generate
// (the whole generation), time, kernels (per-kernel GPU times of a stage), unload. Arrays travel
// as {dtype, shape, b64}. While a command runs, the page tells the host it is alive every few
// seconds, so a host can tell a long job from a page that is gone.
import { buildFetchers, deploy, enrol, enrolled } from "./farm.js";
import { PlanError, PlanRunner, b64ToBytes, bytesToB64, describeAdapter, openDevice, requestAdapter,
  sha256Hex, weightFetcher } from "./plan.js";

const BEAT_MS = 3000;
const MAX_KEPT = 3; // a farm's plans kept loaded between jobs: a job uses one to three
const params = new URLSearchParams(location.search);
const session = params.get("session") || "";
const pageId = crypto.randomUUID();
const state = document.getElementById("state");
const logEl = document.getElementById("log");
let farm = { device: "", token: "" };
let enrolError = null;
try {
  farm = enrol();
} catch (e) {
  enrolError = e;
}
const api = (path) => new URL(`/api/${path}?session=${encodeURIComponent(session)}&page=${pageId}` +
  `&device=${encodeURIComponent(farm.device)}`, location.href);
// Every request to the host carries the device's token, when the page has one.
const hostFetch = (url, init = {}) => fetch(url, farm.token
  ? { ...init, headers: { ...(init.headers || {}), Authorization: `Bearer ${farm.token}` } } : init);

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
    if (enrolError) throw enrolError;
    const ad = await requestAdapter();
    return { adapter: describeAdapter(ad), secure: isSecureContext, page: pageId, ...enrolled() };
  }
  if (cmd.op === "deploy") {
    return await deploy(cmd, (sha) => hostFetch(new URL(`/blobs/${sha}`, location.href)),
      (done, total, bytes) => { state.textContent = `deploying ${cmd.build}: ${done}/${total} files, ${bytes} bytes`; });
  }
  if (cmd.op === "load") {
    const d = await gpu();
    const response = await hostFetch(new URL(cmd.plan_url, location.href));
    if (!response.ok) throw new PlanError("input", `fetching the plan: HTTP ${response.status}`);
    const raw = new Uint8Array(await response.arrayBuffer());
    const digest = await sha256Hex(raw);
    if (digest !== cmd.plan_file_sha256) throw new PlanError("plan-hash", `the plan file hashes to ${digest}, not ${cmd.plan_file_sha256}`);
    const plan = JSON.parse(new TextDecoder().decode(raw));
    if (cmd.build && runners.has(plan.sha256)) {
      // A farm's jobs load the same plans again and again: the runner is kept (its pipelines
      // compiled, its weights on the GPU) while the build it came from still verifies.
      await buildFetchers(cmd.build, cmd.model_prefix || "");
      const kept = runners.get(plan.sha256);
      runners.delete(plan.sha256);
      runners.set(plan.sha256, kept); // most recently used last
      return { ...kept.report, reused: true };
    }
    const runner = new PlanRunner(d, plan);
    let fetchShader = async (path) => {
      const r = await fetch(new URL(path, cmd.shader_base));
      if (!r.ok) throw new PlanError("input", `fetching ${path}: HTTP ${r.status}`);
      return r.text();
    };
    let fetchWeight = cmd.model_base ? weightFetcher(cmd.model_base) : null;
    if (cmd.build) ({ fetchShader, fetchWeight } = await buildFetchers(cmd.build, cmd.model_prefix || ""));
    const report = await runner.load({ fetchWeight, fetchShader,
      onProgress: (done, total) => { state.textContent = `loading weights ${done}/${total}`; } });
    runners.get(plan.sha256)?.destroy();
    runners.delete(plan.sha256);
    runner.report = report;
    runner.kept = !!cmd.build;
    runners.set(plan.sha256, runner);
    // A farm's plans stay loaded between its jobs, the least recently used given up beyond
    // MAX_KEPT (each holds its own copy of the weights); a host session unloads its own.
    const kept = [...runners.entries()].filter(([, r]) => r.kept);
    for (const [sha, r] of kept.slice(0, Math.max(0, kept.length - MAX_KEPT))) {
      r.destroy();
      runners.delete(sha);
    }
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
      timings: out.timings, loop_steps: out.loop_steps, buffer_bytes: runner.bytes, weight_bytes: runner.weightBytes };
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

const pause = (ms) => new Promise((res) => setTimeout(res, ms));

async function post(path, body) {
  return hostFetch(api(path), { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
}

async function loop() {
  state.textContent = "waiting for the host";
  for (;;) {
    let cmd;
    try {
      const r = await hostFetch(api("next"), { cache: "no-store" });
      if (r.status === 204) continue;
      if (r.status === 410) { state.textContent = "the host ended this session"; return; }
      if (r.status === 401 || r.status === 403) {
        state.textContent = r.status === 401 ? "the farm does not know this page's token: open the enrolment URL again"
          : "this page's token belongs to another device: open this device's own enrolment URL";
        await pause(5000);
        continue;
      }
      if (!r.ok) throw new Error(`HTTP ${r.status}`);
      cmd = await r.json();
    } catch (e) {
      state.textContent = `host unreachable (${e.message}); retrying`;
      await pause(1000);
      continue;
    }
    state.textContent = `running ${cmd.op}`;
    log(`${cmd.id} ${cmd.op}${cmd.stage ? " " + cmd.stage : ""}`);
    const beat = setInterval(() => { post("beat", { id: cmd.id }).catch(() => {}); }, BEAT_MS);
    let reply;
    try {
      reply = { id: cmd.id, ok: true, result: await handle(cmd) };
    } catch (e) {
      reply = { id: cmd.id, ok: false, error: errorOf(e) };
      log(`${cmd.id} failed: ${reply.error.kind}: ${reply.error.message}`);
    } finally {
      clearInterval(beat);
    }
    // The answer must arrive: a host that was briefly unreachable gets it when it is back.
    for (let attempt = 0; ; attempt++) {
      try {
        const r = await post("done", reply);
        if (r.ok || r.status === 410 || r.status === 401 || attempt >= 30) break;
      } catch (e) {
        if (attempt >= 30) break;
      }
      await pause(1000);
    }
    state.textContent = "waiting for the host";
  }
}

window.addEventListener("error", (ev) => {
  post("log", { level: "error", message: String(ev.message) }).catch(() => {});
});
window.addEventListener("unhandledrejection", (ev) => {
  post("log", { level: "error", message: String(ev.reason) }).catch(() => {});
});
loop();
