// The page's side of a farm device (orchestrator/transports/hub.py): its enrolment (device token and
// the farm's Ed25519 public key, given once in the URL's fragment and kept in localStorage), and
// the builds deployed to it. A deploy hands the page a build's signed manifest; the page verifies
// the signature with WebCrypto against the key it is enrolled with before it takes anything, then
// keeps each file it runs (shaders, weights) in Cache Storage, fetching only what it does not hold:
// a chunk at a time where the manifest lists chunks (each chunk checked against its signed sha256
// and stored as its own entry, so a cut deploy resumes from its last whole chunk), else whole under
// the file's sha256. It keeps the current build and the one before it and deletes what no kept
// build lists. A plan later runs only shaders and weights of a verified build:
// each shader by the manifest's path and sha256, each weight as a byte range of a manifest file,
// checked against the tensor's sha256 in the plan. Nothing is taken from the network at run time.
import { b64ToBytes, sha256Hex } from "./bytes.js";
import { PlanError } from "./errors.js";

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
// Chunk i of a file, for the manifest's chunk size (the same file in a build of another chunk
// size has other chunks).
const chunkKey = (entry, chunkSize, i) =>
  new Request(new URL(`/chunk-cache/${entry.sha256}/${chunkSize}/${i}`, location.href));
const KEPT_ITEM = "devicefarm.keptBuilds";
const KEPT_BUILDS = 2; // the current build and the one before it: a rollback fetches nothing

// [start, end) of chunk i of a manifest entry
const chunkSpan = (entry, chunkSize, i) => [i * chunkSize, Math.min(entry.size, (i + 1) * chunkSize)];

// Every buffer the build cache fills goes through here, so a deploy can say how large the largest
// was: a chunk, never a whole multi-chunk file.
let largestBuffer = 0;
const allocated = (bytes) => {
  largestBuffer = Math.max(largestBuffer, bytes.byteLength);
  return bytes;
};
async function bytesOf(body) {
  return allocated(new Uint8Array(await body.arrayBuffer()));
}

// A chunk is read into one buffer the deploy reuses (`scratch`), through a BYOB reader where the
// browser offers one: a fresh buffer per chunk left dead buffers in the page's memory until its
// collector ran (renderer peak +79 MB over 160 MiB in 1 MiB chunks, against +33 MB this way,
// the same for 16 MiB: Chromium 156 on SwiftShader).
let scratch = new Uint8Array(0);
let chunkReader = ""; // "byob" or "default": how the last chunk was read

// The bytes of `stream` (a body of exactly `length` bytes expected), in `scratch`: a view valid
// until the next read. A stream that ends early or runs past `length` is an error.
async function readChunk(stream, length) {
  if (scratch.byteLength < length) scratch = allocated(new Uint8Array(length));
  let reader;
  try {
    reader = stream.getReader({ mode: "byob" });
  } catch {
    reader = null; // not a byte stream here: copy what the default reader hands over
  }
  chunkReader = reader ? "byob" : "default";
  let n = 0;
  if (reader) {
    for (;;) {
      const room = n < length ? new Uint8Array(scratch.buffer, n, length - n) : new Uint8Array(1);
      const { value, done } = await reader.read(room);
      if (n < length && value) scratch = new Uint8Array(value.buffer); // the same memory, moved back to us
      if (done) break;
      if (n >= length) {
        await reader.cancel();
        throw new Error(`more than the ${length} bytes expected`);
      }
      n += value.byteLength;
    }
  } else {
    const plain = stream.getReader();
    for (;;) {
      const { value, done } = await plain.read();
      if (done) break;
      allocated(value);
      if (n + value.byteLength > length) {
        await plain.cancel();
        throw new Error(`more than the ${length} bytes expected`);
      }
      scratch.set(value, n);
      n += value.byteLength;
    }
  }
  if (n !== length) throw new Error(`${n} bytes, not the ${length} expected`);
  return scratch.subarray(0, length);
}

// The cached blob of a manifest entry, or null. Runs check what they read (each shader whole,
// each weight's byte range against the plan's sha256); a deploy asks for `whole`: the blob
// counts as held only when all of it still hashes to the signed manifest's sha256, so a
// damaged one (same size, other bytes) is fetched again instead of failing every run.
async function cachedBlob(cache, entry, whole = false) {
  const hit = await cache.match(blobKey(entry.sha256));
  if (!hit) return null;
  const blob = await hit.blob();
  if (blob.size !== entry.size) return null;
  if (whole && (await sha256Hex(await bytesOf(blob))) !== entry.sha256) return null;
  return blob;
}

// The sha256 a chunk was checked against when it was stored, kept on its cache entry.
const DIGEST_HEADER = "x-devicefarm-sha256";

// Whether chunk i is held: an entry of its size stored after its bytes hashed to the signed
// list's sha256 (the digest kept on the entry), so a re-deploy reads no chunk. Hashing every
// held chunk again took a re-deploy of a 2.1 GB build past 20 minutes on SwiftShader in CI. A
// chunk damaged since is found by the run that reads it (every weight's byte range is checked
// against the plan's sha256), which drops it, and the next deploy fetches it again; `verify`
// (a deploy's `verify: true`) hashes each held chunk again now.
async function heldChunk(cache, entry, chunkSize, i, verify) {
  const hit = await cache.match(chunkKey(entry, chunkSize, i));
  if (!hit) return false;
  const [start, end] = chunkSpan(entry, chunkSize, i);
  if (hit.headers.get(DIGEST_HEADER) !== entry.chunks[i]) return false;
  const blob = await hit.blob();
  if (blob.size !== end - start) return false;
  if (!verify) return true;
  try {
    return (await sha256Hex(await readChunk(blob.stream(), end - start))) === entry.chunks[i];
  } catch {
    return false; // an entry that cannot be read whole: fetched again
  }
}

// The body of the blob of `entry`, or of bytes [range[0], range[1]) of it: in `scratch` for a
// range (a chunk), a buffer of its own for a whole file (an older manifest).
async function fetched(fetchBlob, entry, path, range) {
  let response;
  try {
    response = await fetchBlob(entry.sha256, range);
  } catch (e) {
    throw new PlanError("weight-fetch", `fetching ${path}: ${e.message}`);
  }
  if (!response.ok) throw new PlanError("weight-fetch", `fetching ${path}: HTTP ${response.status}`);
  if (range && response.status !== 206 && !(range[0] === 0 && range[1] === entry.size)) {
    await response.body?.cancel();
    throw new PlanError("weight-fetch", `fetching bytes ${range[0]}-${range[1] - 1} of ${path}: the farm answered ` +
      `HTTP ${response.status} with the whole file, not the range`);
  }
  try {
    return range ? await readChunk(response.body, range[1] - range[0]) : await bytesOf(response);
  } catch (e) { // the connection was cut mid-body
    throw new PlanError("weight-fetch", `fetching ${path}: ${e.message}`);
  }
}

// A file of a manifest with chunks: each chunk not held is fetched as a byte range, checked
// against its signed sha256 and stored as its own entry, so a cut costs at most the chunk in
// flight and memory never holds more than one chunk.
async function deployChunks(cache, manifest, entry, path, fetchBlob, report, progress, verify) {
  const size = manifest.chunk_size;
  let fetchedAny = false;
  for (let i = 0; i < entry.chunks.length; i++) {
    if (await heldChunk(cache, entry, size, i, verify)) continue;
    const [start, end] = chunkSpan(entry, size, i);
    const bytes = await fetched(fetchBlob, entry, path, [start, end]);
    const digest = await sha256Hex(bytes);
    if (bytes.byteLength !== end - start || digest !== entry.chunks[i]) {
      throw new PlanError("hash-mismatch", `chunk ${i} of ${path} arrived as ${bytes.byteLength} bytes hashing to ` +
        `${digest.slice(0, 16)}..., the signed manifest says ${end - start} bytes, ${entry.chunks[i].slice(0, 16)}...`);
    }
    // a copy: `scratch` is read again
    await cache.put(chunkKey(entry, size, i), new Response(bytes, { headers: { [DIGEST_HEADER]: digest } }));
    fetchedAny = true;
    report.fetched_chunks++;
    report.fetched_bytes += bytes.byteLength;
    progress();
  }
  return fetchedAny;
}

// A file of an older manifest (no chunks listed): fetched, checked and stored whole.
async function deployWhole(cache, entry, path, fetchBlob, report, progress) {
  if (await cachedBlob(cache, entry, true)) return false;
  const bytes = await fetched(fetchBlob, entry, path, null);
  const digest = await sha256Hex(bytes);
  if (bytes.byteLength !== entry.size || digest !== entry.sha256) {
    throw new PlanError("hash-mismatch", `${path} arrived as ${bytes.byteLength} bytes hashing to ` +
      `${digest.slice(0, 16)}..., the signed manifest says ${entry.size} bytes, ${entry.sha256.slice(0, 16)}...`);
  }
  await cache.put(blobKey(entry.sha256), new Response(bytes));
  report.fetched_bytes += bytes.byteLength;
  progress();
  return true;
}

// The cache entries (URLs) a manifest's files are held in.
function entryUrls(manifest) {
  const urls = [];
  for (const f of manifest.files) {
    if (!manifest.chunk_size) urls.push(blobKey(f.sha256).url);
    else f.chunks.forEach((_, i) => urls.push(chunkKey(f, manifest.chunk_size, i).url));
  }
  return urls;
}

// Keeps `build` and the build deployed before it; deletes every other build's manifest and every
// chunk or blob no kept build lists. Returns the kept builds and the bytes freed.
async function collect(cache, build) {
  const before = JSON.parse(localStorage.getItem(KEPT_ITEM) || "[]").filter((b) => b !== build);
  const kept = [...before, build].slice(-KEPT_BUILDS);
  localStorage.setItem(KEPT_ITEM, JSON.stringify(kept));
  for (const b of verified.keys()) if (!kept.includes(b)) verified.delete(b); // a dropped build runs no more
  const keep = new Set();
  for (const b of kept) {
    try {
      for (const url of entryUrls(await buildManifest(b))) keep.add(url);
      for (const what of ["manifest", "signature"]) keep.add(buildKey(b, what).url);
    } catch (e) {
      if (!(e instanceof PlanError)) throw e; // a kept build no longer in the cache keeps nothing
    }
  }
  let freed = 0;
  for (const request of await cache.keys()) {
    if (keep.has(request.url)) continue;
    const path = new URL(request.url).pathname;
    if (!/^\/(chunk-cache|blob-cache|build-cache)\//.test(path)) continue;
    const hit = await cache.match(request);
    freed += hit ? (await hit.blob()).size : 0;
    await cache.delete(request);
  }
  return { kept, freed };
}

async function persistStorage() {
  const storage = navigator.storage;
  let persisted = false;
  try {
    persisted = storage?.persist ? await storage.persist() : false;
  } catch {
    persisted = false; // a browser that refuses to say: not persisted
  }
  return persisted;
}

// cmd: {build, manifest_b64 (the signed canonical bytes), signature_b64, files: [paths to hold],
// verify (optional: hash every held chunk again, not only trust the digest it was stored with)}.
// fetchBlob(sha256, range) -> Response for the blob, or for bytes [range[0], range[1]) of it
// (an HTTP Range request). onProgress(files done, files, bytes fetched) as a file starts and after each chunk.
// Returns what was fetched, what was held, what was freed and whether storage is persistent.
export async function deploy(cmd, fetchBlob, onProgress) {
  const manifestBytes = b64ToBytes(cmd.manifest_b64);
  const signature = b64ToBytes(cmd.signature_b64);
  const manifest = await verifiedManifest(manifestBytes, signature);
  if (manifest.build !== cmd.build) {
    throw new PlanError("input", `the signed manifest is of build ${manifest.build}, not ${cmd.build}`);
  }
  // Asked for before anything is stored: without it the browser may evict the build under
  // storage pressure, and the next run finds it gone.
  const persisted = await persistStorage();
  largestBuffer = 0;
  const byPath = new Map(manifest.files.map((f) => [f.path, f]));
  const cache = await caches.open(BUILD_CACHE);
  const report = { build: manifest.build, fetched_files: 0, fetched_bytes: 0, held_files: 0, fetched_chunks: 0,
    chunk_size: manifest.chunk_size || 0, persisted };
  const wanted = [...new Set(cmd.files)];
  for (const [i, path] of wanted.entries()) {
    const entry = byPath.get(path);
    if (!entry) throw new PlanError("input", `${path} is not a file of build ${manifest.build}`);
    const progress = () => onProgress && onProgress(i + 1, wanted.length, report.fetched_bytes);
    if (onProgress) onProgress(i, wanted.length, report.fetched_bytes); // (held files fetch nothing)
    const took = manifest.chunk_size
      ? await deployChunks(cache, manifest, entry, path, fetchBlob, report, progress, Boolean(cmd.verify))
      : await deployWhole(cache, entry, path, fetchBlob, report, progress);
    if (took) report.fetched_files++;
    else report.held_files++;
  }
  await cache.put(buildKey(manifest.build, "manifest"), new Response(manifestBytes));
  await cache.put(buildKey(manifest.build, "signature"), new Response(signature));
  localStorage.setItem(CURRENT_ITEM, manifest.build);
  verified.delete(manifest.build);
  const { kept, freed } = await collect(cache, manifest.build);
  report.kept_builds = kept;
  report.freed_bytes = freed;
  report.largest_buffer = largestBuffer;
  report.chunk_reader = chunkReader;
  const estimate = navigator.storage?.estimate ? await navigator.storage.estimate() : {};
  report.quota_bytes = estimate.quota ?? null;
  report.usage_bytes = estimate.usage ?? null;
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

// Bytes [offset, offset + length) of a manifest entry from its cached chunks (a range may span
// several), or from its cached blob for an older manifest.
async function cachedRange(cache, manifest, entry, offset, length, build) {
  const gone = () => new PlanError("not-deployed", `${entry.path} of build ${build} is not in this page's cache: ` +
    "deploy again");
  if (!manifest.chunk_size) {
    const blob = await cachedBlob(cache, entry);
    if (!blob) throw gone();
    return bytesOf(blob.slice(offset, offset + length));
  }
  const size = manifest.chunk_size;
  const out = new Uint8Array(length);
  for (let i = Math.floor(offset / size); i * size < offset + length && i < entry.chunks.length; i++) {
    const hit = await cache.match(chunkKey(entry, size, i));
    const [start, end] = chunkSpan(entry, size, i);
    const blob = hit ? await hit.blob() : null;
    if (!blob || blob.size !== end - start) throw gone();
    const a = Math.max(offset, start), b = Math.min(offset + length, end);
    out.set(new Uint8Array(await blob.slice(a - start, b - start).arrayBuffer()), a - offset);
  }
  return out;
}

// Bytes of an entry failed a run's check: drops each cached chunk holding bytes [offset, offset +
// length) that no longer hashes to the signed list's sha256 (or the blob, for an older manifest),
// so the next deploy fetches it again instead of every run failing. Returns how many it dropped:
// none means the cache is whole and the plan asked for bytes this build does not have.
async function dropDamaged(cache, manifest, entry, offset, length) {
  if (!manifest.chunk_size) {
    if (await cachedBlob(cache, entry, true)) return 0;
    await cache.delete(blobKey(entry.sha256));
    return 1;
  }
  const size = manifest.chunk_size;
  let dropped = 0;
  for (let i = Math.floor(offset / size); i * size < offset + length && i < entry.chunks.length; i++) {
    if (await heldChunk(cache, entry, size, i, true)) continue;
    await cache.delete(chunkKey(entry, size, i));
    dropped++;
  }
  return dropped;
}

// What a run says when cached bytes fail its check.
async function damaged(cache, manifest, entry, offset, length, build, what) {
  const dropped = await dropDamaged(cache, manifest, entry, offset, length);
  return dropped
    ? new PlanError("hash-mismatch", `${what} of the cached ${entry.path} are damaged: ${dropped} ` +
      `${manifest.chunk_size ? "chunk(s)" : "file"} dropped, deploy build ${build} again`)
    : new PlanError("not-in-build", `${what} of ${entry.path} do not hash to the plan's sha256, and build ` +
      `${build}'s cached copy is whole: the plan is not of this build`);
}

// PlanRunner.load's fetchShader and fetchWeight over a deployed build; `modelPrefix` is the
// model's folder in the build ("models/tiny/").
export async function buildFetchers(build, modelPrefix) {
  const manifest = await buildManifest(build);
  const byPath = new Map(manifest.files.map((f) => [f.path, f]));
  const cache = await caches.open(BUILD_CACHE);
  const entryOf = (path, what) => {
    const entry = byPath.get(path);
    if (!entry) throw new PlanError("not-in-build", `${what} ${path} is not a file of build ${build}`);
    return entry;
  };
  const fetchShader = async (path, sha256) => {
    const entry = entryOf(path, "shader");
    if (sha256 && sha256 !== entry.sha256) {
      throw new PlanError("not-in-build", `the plan's ${path} (${sha256.slice(0, 16)}...) is not build ${build}'s`);
    }
    const bytes = await cachedRange(cache, manifest, entry, 0, entry.size, build);
    if ((await sha256Hex(bytes)) !== entry.sha256) {
      throw await damaged(cache, manifest, entry, 0, entry.size, build, "the bytes");
    }
    return new TextDecoder().decode(bytes);
  };
  const fetchWeight = async (b) => {
    const entry = entryOf(modelPrefix + b.file, "weight file");
    if (b.offset + b.length > entry.size) {
      throw new PlanError("hash-mismatch", `weight ${b.component}/${b.name}: bytes ${b.offset}+${b.length} lie past ` +
        `the end of ${b.file} (${entry.size} bytes)`);
    }
    const bytes = await cachedRange(cache, manifest, entry, b.offset, b.length, build);
    if (bytes.byteLength !== b.length || (await sha256Hex(bytes)) !== b.sha256) {
      throw await damaged(cache, manifest, entry, b.offset, b.length, build,
        `weight ${b.component}/${b.name}: bytes ${b.offset}+${b.length}`);
    }
    return { bytes, fetchedBytes: 0 };
  };
  return { fetchShader, fetchWeight };
}
