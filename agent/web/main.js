// The farm's page: the engine's page (engine/web/page.js, served beside this by the hub) for a
// device enrolled with a token (farm.js keeps it), with the farm's own command, deploy (a
// signed build into the page's cache), and plans loaded from deployed builds: their shaders
// and weights come from the page's verified copy, and up to MAX_KEPT of them stay loaded
// between jobs (a job uses one to three).
import { buildFetchers, deploy, enrol, enrolled } from "./farm.js";
import { runPage } from "./page.js";

const MAX_KEPT = 3;
let farm = { device: "", token: "" };
let enrolError = null;
try {
  farm = enrol();
} catch (e) {
  enrolError = e;
}
// Every request to the hub carries the device's token, when the page has one.
const headers = farm.token ? { Authorization: `Bearer ${farm.token}` } : {};
const hostFetch = (url, init = {}) => fetch(url, farm.token
  ? { ...init, headers: { ...(init.headers || {}), ...headers } } : init);

// ?emulate=<base64url of an adapter description>: a virtual phone's page behaves as that adapter
// (its limits and features requested, its memory budget kept), as the engine's page does
const emulate = new URLSearchParams(location.search).get("emulate");

runPage({
  query: { device: farm.device },
  emulate: emulate ? JSON.parse(atob(emulate.replace(/-/g, "+").replace(/_/g, "/"))) : null,
  hostFetch,
  headers,
  hello: () => {
    if (enrolError) throw enrolError;
    return enrolled();
  },
  ops: {
    // range: bytes [start, end) of the blob, as an HTTP Range (whose end is inclusive)
    deploy: (cmd, ui) => deploy(cmd, (sha, range) => hostFetch(new URL(`/blobs/${sha}`, location.href),
      range ? { headers: { Range: `bytes=${range[0]}-${range[1] - 1}` } } : {}),
      (done, total, bytes) => ui.state(`deploying ${cmd.build}: ${done}/${total} files, ${bytes} bytes`)),
  },
  sources: (cmd) => (cmd.build ? buildFetchers(cmd.build, cmd.model_prefix || "") : null),
  keepLoaded: MAX_KEPT,
  refused: (status) => (status === 401
    ? "the farm does not know this page's token: open the enrolment URL again"
    : "this page's token belongs to another device: open this device's own enrolment URL"),
});
