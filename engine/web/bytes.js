// Bytes for the browser executor: base64 both ways, sha256, 4-byte padding, and weights
// converted from how a safetensors file stores them to the element type a plan's buffer holds.

import { PlanError } from "./errors.js";

export function b64ToBytes(text) {
  const bin = atob(text);
  const out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}

export function bytesToB64(bytes) {
  let bin = "";
  const step = 0x8000;
  for (let i = 0; i < bytes.length; i += step) {
    bin += String.fromCharCode.apply(null, bytes.subarray(i, i + step));
  }
  return btoa(bin);
}

export async function sha256Hex(bytes) {
  const digest = new Uint8Array(await crypto.subtle.digest("SHA-256", bytes));
  return Array.from(digest, (b) => b.toString(16).padStart(2, "0")).join("");
}

export function pad4(bytes) {
  if (bytes.byteLength % 4 === 0) return bytes;
  const out = new Uint8Array(bytes.byteLength + (4 - (bytes.byteLength % 4)));
  out.set(bytes);
  return out;
}

// IEEE half <-> single, for weights stored in one and run in the other.
function halfToFloat(h) {
  const s = (h & 0x8000) ? -1 : 1;
  const e = (h >> 10) & 0x1f;
  const f = h & 0x3ff;
  if (e === 0) return s * Math.pow(2, -14) * (f / 1024);
  if (e === 31) return f ? NaN : s * Infinity;
  return s * Math.pow(2, e - 15) * (1 + f / 1024);
}

const f32buf = new Float32Array(1);
const u32view = new Uint32Array(f32buf.buffer);
export function floatToHalf(v) {
  // round to nearest even, as numpy's float32 -> float16 cast does
  f32buf[0] = v;
  const x = u32view[0];
  const sign = (x >>> 16) & 0x8000;
  let e = (x >>> 23) & 0xff;
  let m = x & 0x7fffff;
  if (e === 0xff) return sign | 0x7c00 | (m ? 0x200 : 0);
  e = e - 127 + 15;
  if (e >= 31) return sign | 0x7c00;
  if (e <= 0) {
    if (e < -10) return sign;
    m |= 0x800000;
    const shift = 14 - e;
    let half = m >>> shift;
    const rest = m & ((1 << shift) - 1);
    const mid = 1 << (shift - 1);
    if (rest > mid || (rest === mid && (half & 1))) half++;
    return sign | half;
  }
  let half = sign | (e << 10) | (m >>> 13);
  const rest = m & 0x1fff;
  if (rest > 0x1000 || (rest === 0x1000 && (half & 1))) half++;
  return half;
}

// Element types held as halves: f16 (shader-f16) and f16s (f16-storage: the same bytes, packed
// two to a u32 by kernels that compute in f32; shaders/packed/).
export const HALVES = new Set(["f16", "f16s"]);
export const BYTES_PER = { f32: 4, f16: 2, f16s: 2, u32: 4, i32: 4 };

// stored safetensors bytes -> the plan's GPU element type
export function convertWeight(bytes, stored, dtype) {
  const aligned = new Uint8Array(bytes).buffer; // a copy: typed views need alignment
  if ((stored === "F32" && dtype === "f32") || (stored === "F16" && HALVES.has(dtype))) return new Uint8Array(aligned);
  let values;
  if (stored === "F32") values = new Float32Array(aligned);
  else if (stored === "F16") values = Float32Array.from(new Uint16Array(aligned), halfToFloat);
  else if (stored === "BF16") {
    const u = new Uint16Array(aligned);
    const w = new Uint32Array(u.length);
    for (let i = 0; i < u.length; i++) w[i] = u[i] << 16;
    values = new Float32Array(w.buffer);
  } else throw new PlanError("input", `weights stored as ${stored} cannot be read`);
  if (dtype === "f32") return new Uint8Array(values.buffer);
  return new Uint8Array(Uint16Array.from(values, floatToHalf).buffer);
}
