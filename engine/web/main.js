// The engine's own page (engine/browser.py's BrowserSession): the session it belongs to is in
// its URL; the host serves it the plans, the shaders and the model files.
import { runPage } from "./page.js";

// ?emulate=<base64url of an adapter description>: the page behaves as that adapter (BrowserSession(emulate=))
const params = new URLSearchParams(location.search);
const emulate = params.get("emulate");
runPage({ query: { session: params.get("session") || "" },
  emulate: emulate ? JSON.parse(atob(emulate.replace(/-/g, "+").replace(/_/g, "/"))) : null });
