/* The dashboard's client, shared by every page: where its JSON comes from, the token, number
   formats and the page's status line.

   A page is live (served by `farm api serve`: JSON from the API's /v1 routes, with the token kept
   in localStorage and sent as `Authorization: Bearer`) or offline (written by `farm dashboard
   build`: the same JSON as data/<path>.js files, each calling farm.offline(path, data)). Offline
   data are scripts rather than .json files, and these are classic scripts rather than ES modules,
   because Chromium refuses both fetch() and module scripts from file://.

   Every failure becomes an ApiError {status, detail, path} that the page shows in #status; a 401
   shows the token form again with why. Nothing waits silently. */
(function () {
  "use strict";

  const TOKEN_KEY = "farm.api.token";
  const modeMeta = document.querySelector('meta[name="farm-mode"]');
  const mode = modeMeta ? modeMeta.content : "live";
  const offlineData = {};

  class ApiError extends Error {
    constructor(status, detail, path) {
      super(`${path}: ${status ? status + " " : ""}${detail}`);
      this.status = status;
      this.detail = detail;
      this.path = path;
    }
  }

  // ---- where JSON comes from ----------------------------------------------------------------

  function utf8Hex(text) {
    return Array.from(new TextEncoder().encode(text), (b) => b.toString(16).padStart(2, "0")).join("");
  }

  // "/v1/devices/pixel%208" -> "data/v1/devices/x706978656c2038.js"; the Python side
  // (orchestrator/api/offline.py, file_of) names the files the same way.
  function fileOf(path) {
    const segments = path.split("/").filter((s) => s !== "").map((s) => {
      const raw = decodeURIComponent(s);
      return /^[A-Za-z0-9._-]+$/.test(raw) ? raw : "x" + utf8Hex(raw);
    });
    return "data/" + segments.join("/") + ".js";
  }

  function loadOffline(path) {
    return new Promise((resolve, reject) => {
      if (path in offlineData) return resolve(offlineData[path]);
      const script = document.createElement("script");
      script.src = fileOf(path);
      script.onload = () => (path in offlineData ? resolve(offlineData[path])
        : reject(new ApiError(404, `${script.src} does not hold ${path}`, path)));
      script.onerror = () => reject(new ApiError(404, "not in this offline copy of the dashboard", path));
      document.head.appendChild(script);
    });
  }

  async function api(path, { method = "GET", body } = {}) {
    if (mode === "offline") {
      if (method !== "GET") {
        throw new ApiError(0, "this is an offline copy: triage on the live dashboard (`farm api serve`)", path);
      }
      return loadOffline(path);
    }
    const token = localStorage.getItem(TOKEN_KEY);
    if (!token) throw new ApiError(401, "no token yet", path);
    const headers = { Authorization: "Bearer " + token };
    if (body !== undefined) headers["Content-Type"] = "application/json";
    let response;
    try {
      response = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
    } catch (err) {
      throw new ApiError(0, `the farm API did not answer (${err.message})`, path);
    }
    if (!response.ok) {
      let detail = response.statusText;
      try {
        const problem = await response.json();
        detail = typeof problem.detail === "string" ? problem.detail : JSON.stringify(problem.detail);
      } catch (_) { /* not JSON: keep the status text */ }
      throw new ApiError(response.status, detail, path);
    }
    return response.json();
  }

  // An <img> source for an image the API serves: a file beside the pages offline, else the
  // bytes fetched with the token (an <img> cannot send it) as an object URL.
  async function imageSource(ref) {
    if (mode === "offline") return "data/images/" + ref.file;
    const token = localStorage.getItem(TOKEN_KEY);
    const response = await fetch(ref.url, { headers: { Authorization: "Bearer " + token } });
    if (!response.ok) throw new ApiError(response.status, `image ${ref.id} could not be read`, ref.url);
    return URL.createObjectURL(await response.blob());
  }

  // ---- links between pages ------------------------------------------------------------------

  const PAGE_FILES = { series: "series.html", alert: "alert.html", device: "device.html", gallery: "gallery.html" };
  const PAGE_ROUTES = { series: "/series/", alert: "/alerts/", device: "/devices/", gallery: "/builds/" };

  function href(page, id) {
    if (page === "overview") return mode === "offline" ? "index.html" : "/";
    const ident = encodeURIComponent(String(id));
    return mode === "offline" ? `${PAGE_FILES[page]}?id=${ident}` : PAGE_ROUTES[page] + ident;
  }

  function pageId() {
    if (mode === "offline") return new URLSearchParams(location.search).get("id") || "";
    const parts = location.pathname.split("/").filter((p) => p !== "");
    return decodeURIComponent(parts[parts.length - 1] || "");
  }

  // ---- numbers ------------------------------------------------------------------------------

  const MIB = 1024 * 1024;
  const GIB = 1024 * MIB;

  function decimals(v, digits) {
    return v.toLocaleString("en-US", { minimumFractionDigits: digits, maximumFractionDigits: digits });
  }

  function ms(v) {
    const a = Math.abs(v);
    return decimals(v, a >= 100 ? 1 : a >= 10 ? 2 : 3) + " ms";
  }

  function bytes(v) {
    const a = Math.abs(v);
    if (a >= GIB) return decimals(v / GIB, 2) + " GiB";
    if (a >= MIB) return decimals(v / MIB, 1) + " MiB";
    if (a >= 1024) return decimals(v / 1024, 1) + " KiB";
    return decimals(v, 0) + " B";
  }

  function seconds(v) {
    const a = Math.abs(v);
    if (a === 0) return "0 s";
    if (a >= 1) return decimals(v, 2) + " s";
    if (a >= 1e-3) return decimals(v * 1e3, 1) + " ms";
    if (a >= 1e-6) return decimals(v * 1e6, 1) + " µs";
    return decimals(v * 1e9, 0) + " ns";
  }

  function value(v, unit) {
    if (v === null || v === undefined) return "—";
    if (unit === "ms") return ms(v);
    if (unit === "bytes") return bytes(v);
    if (unit === "s") return seconds(v);
    if (unit === "dB") return decimals(v, 1) + " dB";
    return decimals(v, Math.abs(v) >= 100 ? 1 : 3) + (unit ? " " + unit : "");
  }

  function ratio(v) {
    return v === null || v === undefined ? "—" : v.toFixed(3);
  }

  function change(r) {
    if (r === null || r === undefined) return "—";
    const pct = (r - 1) * 100;
    return (pct >= 0 ? "+" : "−") + decimals(Math.abs(pct), 1) + " %";
  }

  function pValue(p) {
    if (p === null || p === undefined) return "—";
    return p >= 0.001 ? p.toFixed(3) : p.toExponential(1);
  }

  function when(iso) {
    return iso ? iso.replace("T", " ").slice(0, 16) + " UTC" : "—";
  }

  // ---- the DOM ------------------------------------------------------------------------------

  // el("td", {class: "num"}, "text", child, ...): an element with attributes and children.
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "dataset") Object.assign(node.dataset, v);
      else if (k === "style") Object.assign(node.style, v);  // CSSOM: the page's CSP allows no style attributes
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, v === true ? "" : String(v));
    }
    for (const child of children.flat()) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : String(child));
    }
    return node;
  }

  // A number as it reads, with the exact value in data-value (what tests compare).
  function num(v, unit, format) {
    const text = format ? format(v) : value(v, unit);
    return el("span", { class: "num", dataset: v === null || v === undefined ? {} : { value: String(v) } }, text);
  }

  function badge(text, kind) {
    return el("span", { class: `badge badge-${kind || text}` }, text);
  }

  function table(id, headers, rows) {
    return el("table", { id },
      el("thead", {}, el("tr", {}, headers.map((h) => el("th", {}, h)))),
      el("tbody", {}, rows));
  }

  function unitOf(metric) {
    return metric.endsWith("_ms") ? "ms" : metric.endsWith("_bytes") ? "bytes" : metric.endsWith("_db") ? "dB" : "";
  }

  function annotationList(annotations) {
    if (!annotations.length) {
      return el("p", { class: "muted" }, "No deploys, change points or environment changes recorded.");
    }
    return el("ul", { class: "annotations" }, annotations.map((a) => el("li", { dataset: { kind: a.kind, build: a.build } },
      `${a.build}: ${a.text}`,
      a.series_id ? [" (", el("a", { href: href("series", a.series_id) }, "the series before"), ")"] : "")));
  }

  function setStatus(state, text) {
    const status = document.getElementById("status");
    status.dataset.state = state;
    status.textContent = text;
    status.hidden = !text;
  }

  function showTokenForm(message) {
    const form = document.getElementById("token-form");
    document.getElementById("token-message").textContent = message;
    form.hidden = false;
    document.getElementById("token-input").focus();
  }

  function explain(err) {
    if (err instanceof ApiError) return err.message;
    return `the page failed: ${err && err.message ? err.message : err}`;
  }

  // Run the page's loader; show what it ended in. A 401 asks for a token.
  function start(load) {
    document.body.dataset.mode = mode;
    document.getElementById("home").setAttribute("href", href("overview"));
    const form = document.getElementById("token-form");
    const signOut = document.getElementById("sign-out");
    if (mode === "offline") {
      signOut.hidden = true;
      document.getElementById("mode-note").textContent = "Offline copy, written by `farm dashboard build`.";
    }
    signOut.addEventListener("click", (event) => {
      event.preventDefault();
      localStorage.removeItem(TOKEN_KEY);
      showTokenForm("Signed out. Enter an API token to read the farm.");
      setStatus("token", "");
    });
    async function run() {
      setStatus("loading", "Loading…");
      try {
        await load();
        setStatus("ready", "");
      } catch (err) {
        if (err instanceof ApiError && err.status === 401) {
          const why = err.detail === "no token yet" ? "Enter an API token to read the farm."
            : `The farm API refused the token (${err.detail}). Enter another.`;
          showTokenForm(why);
          setStatus("token", why);
        } else {
          setStatus("error", explain(err));
        }
      }
    }
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      const token = document.getElementById("token-input").value.trim();
      if (!token) return;
      localStorage.setItem(TOKEN_KEY, token);
      document.getElementById("token-input").value = "";
      form.hidden = true;
      run();
    });
    run();
  }

  window.farm = {
    mode, ApiError, api, imageSource, href, pageId, fileOf,
    offline(path, data) { offlineData[path] = data; },
    fmt: { value, ms, bytes, seconds, ratio, change, pValue, when, decimals },
    el, num, badge, table, setStatus, start, explain, unitOf, annotationList, charts: {},
  };
})();
