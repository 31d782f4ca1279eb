// The engine's own page (engine/browser.py's BrowserSession): the session it belongs to is in
// its URL; the host serves it the plans, the shaders and the model files.
import { runPage } from "./page.js";

runPage({ query: { session: new URLSearchParams(location.search).get("session") || "" } });
