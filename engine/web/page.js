// The page's side of the page-host protocol (engine/pagehost.py): fetch the next command from
// /api/next, run it, post the answer to /api/done, forever. While a command runs, the page
// tells the host it is alive every few seconds, so a host can tell a long job from a page that
// is gone: from a dedicated Worker (beat.js), whose timers neither a busy command nor a
// browser's throttling of background pages holds back. A GPU device lost while a command runs
// ends that command with the error kind "device-lost" (its reason and message); the next
// command gets a new device. Arrays travel as {dtype, shape, b64}.
//
// Commands: hello (the adapter), load (a plan, its shaders and weights), run (one stage),
// generate (the whole generation), time, kernels (per-kernel GPU times of a stage), unload.
// A host page adds its own commands, sources and rules through runPage's options (the engine's
// standalone page: engine/web/main.js; the farm's: agent/web/main.js).
import { b64ToBytes, bytesToB64, sha256Hex } from "./bytes.js";
import { PlanError } from "./errors.js";
import { PlanRunner, WeightStore, chooseResidency, describeAdapter, emulatedAdapter, openDevice, requestAdapter, weightFetcher } from "./plan.js";

const BEAT_MS = 3000;

const pause = (ms) => new Promise((res) => setTimeout(res, ms));

// The screen stays on while a command runs, where the browser grants it (Screen Wake Lock; a
// headless or older browser does not, and the command runs anyway).
async function wakeLock() {
  try {
    if (!navigator.wakeLock) return null;
    return await Promise.race([navigator.wakeLock.request("screen"), pause(1000).then(() => null)]);
  } catch (e) {
    return null;
  }
}

// The beats of the running command, posted to `url` by a dedicated Worker (beat.js: its timers
// are not throttled with the page's, and a busy command does not hold them); where no worker
// can be started, by this thread's timer through post(). `ready` settles once the worker runs
// (or is given up): a command that takes the main thread at once must not keep its script from
// loading.
function heartbeat(url, headers, post) {
  let worker = null;
  let timer = null;
  let running = null;
  let doing = "";
  let isReady = () => {};
  const ready = new Promise((res) => { isReady = res; });
  const fallback = () => {
    clearInterval(timer);
    timer = setInterval(() => {
      post("beat", { id: running, hidden: document.hidden, state: doing }).catch(() => {});
    }, BEAT_MS);
  };
  try {
    worker = new Worker(new URL("./beat.js", import.meta.url));
    worker.onmessage = (ev) => { if (ev.data && ev.data.ready) isReady(); };
    worker.onerror = () => { // its script did not load: this thread beats instead
      worker = null;
      isReady();
      if (running !== null) fallback();
    };
  } catch (e) {
    worker = null;
  }
  if (!worker) isReady();
  setTimeout(isReady, 5000); // a worker that never says so: commands run anyway
  return {
    ready,
    start(id) {
      running = id;
      if (!worker) return fallback();
      worker.postMessage({ start: { url: url.href, headers: { ...headers, "Content-Type": "application/json" }, id,
        hidden: document.hidden, state: doing, ms: BEAT_MS } });
    },
    hidden(hidden) {
      if (worker) worker.postMessage({ hidden });
    },
    // what the running command is doing: the beats carry it, so a host waiting on a long
    // command can say where it is
    state(text) {
      doing = text;
      if (worker && running !== null) worker.postMessage({ state: text });
    },
    stop() {
      running = null;
      clearInterval(timer);
      timer = null;
      if (worker) worker.postMessage({ stop: true });
    },
  };
}

function arrayOut(a) {
  return { dtype: a.dtype, shape: a.shape, b64: bytesToB64(a.bytes) };
}

function errorOf(e) {
  if (e instanceof PlanError) return { kind: e.kind, message: e.message };
  if (e && e.name === "OperationError") return { kind: "device-lost", message: e.message };
  return { kind: "internal", message: `${e && e.name}: ${e && e.message}` };
}

// Run the page. Options:
//   query         fields every /api request carries besides page (e.g. {session} or {device})
//   hostFetch     fetch() for requests to the host (adds the host's credentials)
//   hello()       fields the hello answer carries besides the adapter (may throw)
//   ops           {name: async (cmd, ui) => result}: the host page's own commands
//   sources(cmd)  async: {fetchShader, fetchWeight} for a load from elsewhere than the host's
//                 shader_base/model_base, or null; a plan loaded from such a source is kept
//                 loaded between commands (its weights stay on the GPU) and reused while
//                 sources() still accepts it
//   keepLoaded    how many such plans stay loaded, the least recently used unloaded beyond it
//   refused(status)  what to show for a 401/403 from the host (the page retries)
//   emulate      an adapter description (engine/adapters/*.json) the page behaves as: its
//                limits and features requested, its memory budget kept (tests of phones' pages)
//   headers      what hostFetch adds to a request (credentials): the heartbeat's worker sends
//                them itself, as a function cannot be handed to a worker
// An op is given ui: {state(text), log(text), gpu()}, gpu() the page's GPU device (made on first
// use, made again after a loss).
export function runPage({ query = {}, hostFetch = fetch, hello = () => ({}), ops = {}, sources = null,
  keepLoaded = 0, refused = (status) => `the host refused this page (HTTP ${status})`, emulate = null,
  headers = {} } = {}) {
  const emulating = emulatedAdapter(emulate);
  const pageId = crypto.randomUUID();
  const state = document.getElementById("state");
  const logEl = document.getElementById("log");
  let beatState = () => {}; // the heartbeat's, once it exists
  const ui = {
    state: (text) => {
      state.textContent = text;
      beatState(text);
    },
    log: (text) => {
      logEl.textContent = `${new Date().toISOString().slice(11, 23)} ${text}\n` + logEl.textContent.slice(0, 20000);
    },
  };
  const api = (path) => {
    const url = new URL(`/api/${path}`, location.href);
    for (const [k, v] of Object.entries({ ...query, page: pageId })) url.searchParams.set(k, v);
    return url;
  };

  let device = null;
  let weights = null; // the page's one copy of each weight, shared by its runners
  const runners = new Map(); // plan sha256 -> PlanRunner
  let onLost = null; // ends the running command when its device is lost

  async function gpu() {
    if (!device) {
      const adapter = await requestAdapter();
      const d = await openDevice(adapter, emulating);
      device = d;
      weights = new WeightStore(d);
      d.lost.then((info) => {
        ui.log(`device lost: ${info.reason} ${info.message}`);
        if (device !== d) return; // an older device's loss: its runners are gone already
        device = null; // the next command asks for a new one
        runners.clear();
        if (onLost) onLost(info);
      });
    }
    return device;
  }
  ui.gpu = gpu;

  async function load(cmd) {
    const d = await gpu();
    const response = await hostFetch(new URL(cmd.plan_url, location.href));
    if (!response.ok) throw new PlanError("input", `fetching the plan: HTTP ${response.status}`);
    const raw = new Uint8Array(await response.arrayBuffer());
    const digest = await sha256Hex(raw);
    if (digest !== cmd.plan_file_sha256) throw new PlanError("plan-hash", `the plan file hashes to ${digest}, not ${cmd.plan_file_sha256}`);
    const plan = JSON.parse(new TextDecoder().decode(raw));
    const source = sources ? await sources(cmd) : null;
    const own = emulating ? emulating.memoryBudgetBytes : null; // a budget is at most the device's own
    const budget = [cmd.budget_bytes, own].filter((b) => b != null).reduce((a, b) => Math.min(a, b), Infinity);
    const budgetBytes = budget === Infinity ? null : budget;
    if (source && runners.has(plan.sha256)) {
      // The same plans load again and again: the runner is kept (its pipelines compiled, its
      // weights on the GPU) while its source still accepts it and it holds what this load would:
      // the same residency, within this load's budget. Otherwise it goes, and the plan loads
      // afresh under this budget (or is refused with the reasons).
      const kept = runners.get(plan.sha256);
      const peak = kept.residency === "resident" ? kept.memory.residentBytes : kept.memory.stagedBytes;
      runners.delete(plan.sha256);
      if (chooseResidency(kept.memory, budgetBytes, cmd.residency || "auto") === kept.residency &&
          (budgetBytes == null || peak <= budgetBytes)) {
        runners.set(plan.sha256, kept); // most recently used last
        return { ...kept.report, reused: true };
      }
      kept.destroy();
    }
    const runner = new PlanRunner(d, plan, weights);
    const fetchShader = source ? source.fetchShader : async (path) => {
      const r = await fetch(new URL(path, cmd.shader_base));
      if (!r.ok) throw new PlanError("input", `fetching ${path}: HTTP ${r.status}`);
      return r.text();
    };
    const fetchWeight = source ? source.fetchWeight : (cmd.model_base ? weightFetcher(cmd.model_base) : null);
    let report;
    try {
      report = await runner.load({ fetchWeight, fetchShader, budgetBytes,
        residency: cmd.residency || "auto", onProgress: (done, total) => ui.state(`loading weights ${done}/${total}`) });
    } catch (e) {
      runner.destroy(); // gives back the weights it took from the page's store
      throw e;
    }
    runners.get(plan.sha256)?.destroy();
    runners.delete(plan.sha256);
    runner.report = report;
    runner.kept = !!source;
    runners.set(plan.sha256, runner);
    // Kept plans beyond keepLoaded are unloaded, the least recently used first (the weights
    // they share stay while any plan holds them); a host that loads plans itself unloads its own.
    const kept = [...runners.entries()].filter(([, r]) => r.kept);
    for (const [sha, r] of kept.slice(0, Math.max(0, kept.length - keepLoaded))) {
      r.destroy();
      runners.delete(sha);
    }
    return report;
  }

  async function handle(cmd) {
    if (cmd.op === "hello") {
      const ad = await requestAdapter();
      return { adapter: describeAdapter(ad, emulating), secure: isSecureContext, page: pageId, ...hello() };
    }
    if (ops[cmd.op]) return await ops[cmd.op](cmd, ui);
    if (cmd.op === "load") return await load(cmd);
    const runner = runners.get(cmd.plan);
    if (!runner) throw new PlanError("input", `no plan ${cmd.plan} is loaded`);
    const inputs = {};
    for (const [name, v] of Object.entries(cmd.inputs || {})) {
      inputs[name] = Array.isArray(v) ? v.map((x) => b64ToBytes(x.b64)) : b64ToBytes(v.b64);
    }
    if (cmd.op === "run") {
      const out = await runner.run(cmd.stage, inputs);
      return { outputs: Object.fromEntries(Object.entries(out.outputs).map(([k, a]) => [k, arrayOut(a)])), timings: out.timings,
        peak_bytes: runner.peakBytes };
    }
    if (cmd.op === "generate") {
      const out = await runner.generate(inputs);
      return { outputs: Object.fromEntries(Object.entries(out.outputs).map(([k, a]) => [k, arrayOut(a)])),
        timings: out.timings, loop_steps: out.loop_steps, buffer_bytes: runner.bytes, weight_bytes: runner.weightBytes,
        residency: runner.residency, peak_bytes: runner.peakBytes };
    }
    if (cmd.op === "time") {
      return { ms: await runner.timeStage(cmd.stage, cmd.repetitions, cmd.warmup || 0), peak_bytes: runner.peakBytes };
    }
    if (cmd.op === "kernels") {
      return { kernels: await runner.kernelTimes(cmd.stage, cmd.repetitions || 1), peak_bytes: runner.peakBytes };
    }
    if (cmd.op === "unload") {
      runner.destroy();
      runners.delete(cmd.plan);
      return {};
    }
    throw new PlanError("input", `unknown command ${cmd.op}`);
  }

  const post = (path, body) => hostFetch(api(path), { method: "POST", headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body) });
  const beats = heartbeat(api("beat"), headers, post);
  beatState = (text) => beats.state(text);

  async function loop() {
    ui.state("starting the heartbeat");
    await beats.ready;
    ui.state("waiting for the host");
    for (;;) {
      let cmd;
      try {
        const r = await hostFetch(api("next"), { cache: "no-store" });
        if (r.status === 204) continue;
        if (r.status === 410) { ui.state("the host ended this session"); return; }
        if (r.status === 401 || r.status === 403) {
          ui.state(refused(r.status));
          await pause(5000);
          continue;
        }
        if (!r.ok) throw new Error(`HTTP ${r.status}`);
        cmd = await r.json();
      } catch (e) {
        ui.state(`host unreachable (${e.message}); retrying`);
        await pause(1000);
        continue;
      }
      ui.state(`running ${cmd.op}`);
      ui.log(`${cmd.id} ${cmd.op}${cmd.stage ? " " + cmd.stage : ""}`);
      running = cmd.id;
      beats.start(cmd.id);
      const lock = await wakeLock();
      // A device lost mid-command (the driver reset, the browser took the GPU back) ends the
      // command at once: its promises may never settle.
      const lost = new Promise((resolve, reject) => {
        onLost = (info) => reject(new PlanError("device-lost", `the GPU device was lost while ${cmd.op} ran ` +
          `(${info.reason || "unknown"}): ${info.message || "no message"}`));
      });
      lost.catch(() => {});
      let reply;
      try {
        if (document.hidden) throw new PlanError("page-hidden", "the page is hidden (screen off, or another tab or app in front)");
        reply = { id: cmd.id, ok: true, result: await Promise.race([handle(cmd), lost]) };
      } catch (e) {
        reply = { id: cmd.id, ok: false, error: errorOf(e) };
        ui.log(`${cmd.id} failed: ${reply.error.kind}: ${reply.error.message}`);
      } finally {
        onLost = null;
        beats.stop();
        running = null;
        if (lock) lock.release().catch(() => {});
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
      ui.state("waiting for the host");
    }
  }

  // A hidden page is throttled and may be stopped: the host hears it at once, and ends the
  // command it runs as an infrastructure failure (page-hidden) rather than waiting it out.
  let running = null;
  document.addEventListener("visibilitychange", () => {
    beats.hidden(document.hidden);
    post("beat", { id: running, hidden: document.hidden }).catch(() => {});
  });
  window.addEventListener("error", (ev) => {
    post("log", { level: "error", message: String(ev.message) }).catch(() => {});
  });
  window.addEventListener("unhandledrejection", (ev) => {
    post("log", { level: "error", message: String(ev.reason) }).catch(() => {});
  });
  return loop();
}
