// The page's heartbeat while a command runs, in a dedicated Worker of page.js. The host declares
// a page lost after 15 s of silence (engine/pagehost.py PAGE_LOST_S), and the main thread cannot
// promise a beat that often: a hidden or background page's timers are throttled (Chrome: to once
// a minute after 5 minutes), and a command in a busy GPU loop holds the thread for as long as it
// runs. A worker's timers are neither. The page says what to post, where, and when to stop:
//   {start: {url, headers, id, hidden, ms}}   beat now and every ms until told otherwise
//   {hidden: bool}                            what the next beats say of the page
//   {state: text}                             what the command is doing, said by the next beats
//   {stop: true}                              the command ended
// It says {ready: true} once it runs.
let timer = null;
let beat = null;

function send() {
  if (!beat) return;
  fetch(beat.url, { method: "POST", headers: beat.headers, body: JSON.stringify({ id: beat.id, hidden: beat.hidden, state: beat.state }),
    cache: "no-store" }).catch(() => {}); // a host briefly unreachable hears the next one
}

onmessage = (ev) => {
  const m = ev.data || {};
  if (m.start) {
    clearInterval(timer);
    beat = { ...m.start };
    send();
    timer = setInterval(send, m.start.ms);
  } else if (typeof m.hidden === "boolean" && beat) {
    beat.hidden = m.hidden;
  } else if (typeof m.state === "string" && beat) {
    beat.state = m.state;
  } else if (m.stop) {
    clearInterval(timer);
    timer = null;
    beat = null;
  }
};
postMessage({ ready: true });
