// The page's side of a farm device (orchestrator/browser_hub.py): its enrolment (device token and
// the farm's Ed25519 public key, given once in the URL's fragment and kept in localStorage), and
// the builds deployed to it. A deploy hands the page a build's signed manifest; the page verifies
// the signature with WebCrypto against the key it is enrolled with before it takes anything, then
// keeps each file it runs (shaders, weights) in Cache Storage under the file's sha256, fetching
// only those it does not hold. A plan later runs only shaders and weights of a verified build:
// each shader by the manifest's path and sha256, each weight as a byte range of a manifest file,
// checked against the tensor's sha256 in the plan. Nothing is taken from the network at run time.
import { PlanError, b64ToBytes, sha256Hex } from "./plan.js";

const BUILD_CACHE = "devicefarm-builds-v1";
const TOKEN_ITEM = "devicefarm.token";
const DEVICE_ITEM = "devicefarm.device";
const KEY_ITEM = "devicefarm.farmKey";
const CURRENT_ITEM = "devicefarm.currentBuild";
const VIRTUAL_ITEM = "devicefarm.virtual";

// ---- enrolment -----------------------------------------------------------------------------

// What this page was enrolled with, kept for its life: a browser may delete the site's storage
// under a page that runs (Safari: after 7 days without a person's interaction), and enrolled()
// puts it back. A page loaded after such a deletion has nothing: the farm opens its enrolment
// URL again (over ADB), or says to (a web device).
const held = {};

// Takes device, token and key (base64url) from the URL's fragment (never sent to a server); a
// key other than the one this page is enrolled with is refused: the lab must clear the site's
// data to move a phone to another farm.
export function enrol() {
  const frag = new URLSearchParams(location.hash.slice(1));
  const key = frag.get("key");
  const pinned = localStorage.getItem(KEY_ITEM);
  if (key && pinned && key !== pinned) {
    throw new PlanError("enrolment", "this page is enrolled with another farm's key; clear this site's data " +
      "on the device to enrol it with this farm");
  }
  if (key) localStorage.setItem(KEY_ITEM, key);
  if (frag.get("token")) localStorage.setItem(TOKEN_ITEM, frag.get("token"));
  if (frag.get("device")) localStorage.setItem(DEVICE_ITEM, frag.get("device"));
  // A virtual device (a test or demo browser on the farm's own host) says so once, so the farm
  // never times it beside the host's other work.
  if (frag.get("virtual")) localStorage.setItem(VIRTUAL_ITEM, frag.get("virtual") === "1" ? "1" : "");
  if (frag.size) history.replaceState(null, "", location.pathname + location.search); // out of sight
  for (const item of [DEVICE_ITEM, TOKEN_ITEM, KEY_ITEM, VIRTUAL_ITEM]) {
    if (localStorage.getItem(item) !== null) held[item] = localStorage.getItem(item);
  }
  return { device: localStorage.getItem(DEVICE_ITEM) || "", token: localStorage.getItem(TOKEN_ITEM) || "" };
}

// The page's enrolment as the farm's hello reads it; `restored` names what the browser had
// deleted while the page ran and was written back from what the page still held.
export function enrolled() {
  const restored = [];
  for (const [item, value] of Object.entries(held)) {
    if (localStorage.getItem(item) === null) {
      localStorage.setItem(item, value);
      restored.push(item.replace("devicefarm.", ""));
    }
  }
  return { device: localStorage.getItem(DEVICE_ITEM) || "", key: !!localStorage.getItem(KEY_ITEM),
    current: localStorage.getItem(CURRENT_ITEM) || "", virtual: localStorage.getItem(VIRTUAL_ITEM) === "1", restored };
}

// base64url (the URL's form of the key) -> bytes
function b64urlToBytes(text) {
  const b64 = text.replace(/-/g, "+").replace(/_/g, "/");
  return b64ToBytes(b64 + "=".repeat((4 - (b64.length % 4)) % 4));
}

async function farmKey() {
  const raw = localStorage.getItem(KEY_ITEM);
  if (!raw) throw new PlanError("not-enrolled", "this page holds no farm key: open the enrolment URL the farm printed");
  try {
    return await crypto.subtle.importKey("raw", b64urlToBytes(raw), { name: "Ed25519" }, false, ["verify"]);
  } catch (e) {
    throw new PlanError("signature", `this browser's WebCrypto cannot use an Ed25519 key (${e.name}: ${e.message}); ` +
      "it needs Chrome 137+ or Safari 17+");
  }
}

// The manifest, parsed from exactly the bytes whose signature verified.
async function verifiedManifest(manifestBytes, signature) {
  const ok = await crypto.subtle.verify({ name: "Ed25519" }, await farmKey(), signature, manifestBytes);
  if (!ok) {
    throw new PlanError("signature", "the build's manifest signature does not verify against the farm key " +
      "this page is enrolled with: refused");
  }
  return JSON.parse(new TextDecoder().decode(manifestBytes));
}

// ---- the build cache -------------------------------------------------------------------------

const blobKey = (sha256) => new Request(new URL(`/blob-cache/${sha256}`, location.href));
const buildKey = (build, what) => new Request(new URL(`/build-cache/${encodeURIComponent(build)}/${what}`, location.href));

// The cached blob of a manifest entry, or null. Runs check what they read (each shader whole,
// each weight's byte range against the plan's sha256); a deploy asks for `whole`: the blob
// counts as held only when all of it still hashes to the signed manifest's sha256, so a
// damaged one (same size, other bytes) is fetched again instead of failing every run.
async function cachedBlob(cache, entry, whole = false) {
  const hit = await cache.match(blobKey(entry.sha256));
  if (!hit) return null;
  const blob = await hit.blob();
  if (blob.size !== entry.size) return null;
  if (whole && (await sha256Hex(new Uint8Array(await blob.arrayBuffer()))) !== entry.sha256) return null;
  return blob;
}

// cmd: {build, manifest_b64 (the signed canonical bytes), signature_b64, files: [paths to hold]}.
// fetchBlob(sha256) -> Response for the blob. Returns what was fetched and what was held.
export async function deploy(cmd, fetchBlob, onProgress) {
  const manifestBytes = b64ToBytes(cmd.manifest_b64);
  const signature = b64ToBytes(cmd.signature_b64);
  const manifest = await verifiedManifest(manifestBytes, signature);
  if (manifest.build !== cmd.build) {
    throw new PlanError("input", `the signed manifest is of build ${manifest.build}, not ${cmd.build}`);
  }
  const byPath = new Map(manifest.files.map((f) => [f.path, f]));
  const cache = await caches.open(BUILD_CACHE);
  const report = { build: manifest.build, fetched_files: 0, fetched_bytes: 0, held_files: 0 };
  const wanted = [...new Set(cmd.files)];
  for (const [i, path] of wanted.entries()) {
    const entry = byPath.get(path);
    if (!entry) throw new PlanError("input", `${path} is not a file of build ${manifest.build}`);
    if (await cachedBlob(cache, entry, true)) {
      report.held_files++;
      continue;
    }
    let response;
    try {
      response = await fetchBlob(entry.sha256);
    } catch (e) {
      throw new PlanError("weight-fetch", `fetching ${path}: ${e.message}`);
    }
    if (!response.ok) throw new PlanError("weight-fetch", `fetching ${path}: HTTP ${response.status}`);
    const bytes = new Uint8Array(await response.arrayBuffer());
    const digest = await sha256Hex(bytes);
    if (bytes.byteLength !== entry.size || digest !== entry.sha256) {
      throw new PlanError("hash-mismatch", `${path} arrived as ${bytes.byteLength} bytes hashing to ` +
        `${digest.slice(0, 16)}..., the signed manifest says ${entry.size} bytes, ${entry.sha256.slice(0, 16)}...`);
    }
    await cache.put(blobKey(entry.sha256), new Response(bytes));
    report.fetched_files++;
    report.fetched_bytes += bytes.byteLength;
    if (onProgress) onProgress(i + 1, wanted.length, report.fetched_bytes);
  }
  await cache.put(buildKey(manifest.build, "manifest"), new Response(manifestBytes));
  await cache.put(buildKey(manifest.build, "signature"), new Response(signature));
  localStorage.setItem(CURRENT_ITEM, manifest.build);
  verified.delete(manifest.build);
  return report;
}

const verified = new Map(); // build -> manifest, verified in this page's life

async function buildManifest(build) {
  if (verified.has(build)) return verified.get(build);
  const cache = await caches.open(BUILD_CACHE);
  const m = await cache.match(buildKey(build, "manifest"));
  const s = await cache.match(buildKey(build, "signature"));
  if (!m || !s) throw new PlanError("not-deployed", `build ${build} is not deployed to this page: deploy it first`);
  const manifest = await verifiedManifest(new Uint8Array(await m.arrayBuffer()), new Uint8Array(await s.arrayBuffer()));
  verified.set(build, manifest);
  return manifest;
}

// PlanRunner.load's fetchShader and fetchWeight over a deployed build; `modelPrefix` is the
// model's folder in the build ("models/tiny/").
export async function buildFetchers(build, modelPrefix) {
  const manifest = await buildManifest(build);
  const byPath = new Map(manifest.files.map((f) => [f.path, f]));
  const cache = await caches.open(BUILD_CACHE);
  const blobOf = async (path, what) => {
    const entry = byPath.get(path);
    if (!entry) throw new PlanError("not-in-build", `${what} ${path} is not a file of build ${build}`);
    const blob = await cachedBlob(cache, entry);
    if (!blob) throw new PlanError("not-deployed", `${path} of build ${build} is not in this page's cache: deploy again`);
    return { entry, blob };
  };
  const fetchShader = async (path, sha256) => {
    const { entry, blob } = await blobOf(path, "shader");
    const bytes = new Uint8Array(await blob.arrayBuffer());
    if (sha256 && sha256 !== entry.sha256) {
      throw new PlanError("not-in-build", `the plan's ${path} (${sha256.slice(0, 16)}...) is not build ${build}'s`);
    }
    if ((await sha256Hex(bytes)) !== entry.sha256) throw new PlanError("hash-mismatch", `the cached ${path} is damaged`);
    return new TextDecoder().decode(bytes);
  };
  const fetchWeight = async (b) => {
    const { blob } = await blobOf(modelPrefix + b.file, "weight file");
    const bytes = new Uint8Array(await blob.slice(b.offset, b.offset + b.length).arrayBuffer());
    if (bytes.byteLength !== b.length || (await sha256Hex(bytes)) !== b.sha256) {
      throw new PlanError("hash-mismatch", `weight ${b.component}/${b.name}: bytes ${b.offset}+${b.length} of the ` +
        `cached ${b.file} do not hash to the plan's sha256`);
    }
    return { bytes, fetchedBytes: 0 };
  };
  return { fetchShader, fetchWeight };
}
