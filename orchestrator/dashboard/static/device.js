/* One device's health: its GPU and state, when it was last seen and when its last run ended,
   its state history, runs by outcome and the failure rate, its newest runs with their errors,
   data stoppages, and its series with their newest verdicts (static/findings.js); who holds it
   (`farm devices reserve`) and its newest screenshot. Reads /v1/devices/{serial}, its /health,
   its /screenshot and /v1/overview. */
(function () {
  "use strict";
  const { api, el, num, badge, table, href, fmt, pageId, imageSource } = window.farm;

  // The newest screenshot (`farm devices screenshot`), fetched with the token; the offline copy
  // holds none.
  async function screen(device) {
    const shot = device.screenshot;
    if (!shot) return el("p", { class: "muted", id: "screenshot" }, `No screenshot yet: \`farm devices screenshot ${device.serial}\` takes one.`);
    const caption = `${shot.width}×${shot.height}, ${shot.source}, taken ${fmt.when(shot.taken_at)}`;
    if (window.farm.mode === "offline") return el("p", { class: "muted", id: "screenshot" }, `${caption}: not in the offline copy.`);
    try {
      const img = el("img", { class: "gallery-image", id: "screenshot", alt: `${device.serial}'s screen` });
      img.src = await imageSource({ id: "screenshot", url: shot.url });
      return el("figure", {}, img, el("figcaption", {}, caption));
    } catch (err) {
      return el("p", { class: "muted", id: "screenshot" }, `${caption}: could not be read (${err.message}).`);
    }
  }

  window.farm.start(async () => {
    const serial = pageId();
    const path = `/v1/devices/${encodeURIComponent(serial)}`;
    const [device, health, overview] = await Promise.all([api(path), api(`${path}/health`), api("/v1/overview")]);
    document.title = `${device.serial} · devicefarm`;
    const gpu = device.gpu;
    const facts = [["state", el("span", {}, badge(device.state), " ", device.state_reason || "")],
      ["model", [device.manufacturer, device.model].filter(Boolean).join(" ") || "—"],
      ["OS", `${device.os} ${device.os_version}`.trim() || "—"],
      ["GPU", [gpu.vendor, gpu.architecture, gpu.device].filter(Boolean).join(" · ") || "—"],
      ["driver / backend", [gpu.driver, gpu.backend].filter(Boolean).join(" · ") || "—"],
      ["transport", `${device.transport} ${device.address}`], ["engine host", device.engine_host],
      ["last seen", el("span", { id: "last-seen" }, fmt.when(device.last_seen))],
      ["last run ended", el("span", { id: "last-run-ended", title: "by the device's clock" },
        fmt.when(health.last_run_finished))],
      ["runs", el("span", { id: "run-counts" }, Object.entries(health.runs).map(([s, n]) => `${n} ${s}`).join(", "))],
      ["failure rate", el("span", { id: "failure-rate" }, health.failure_rate === null ? "—"
        : num(health.failure_rate, "", (v) => fmt.decimals(100 * v, 1) + " %"))],
      ["infrastructure failures in a row", String(health.infra_failures_in_row)],
      ["failed probes", String(health.probe_failures)]];
    const series = overview.cells.filter((c) => c.device === device.serial);
    document.getElementById("content").replaceChildren(
      el("h1", {}, `${device.serial}`),
      table("device-facts", ["", ""], facts.map(([k, v]) => el("tr", {}, el("th", {}, k), el("td", {}, v)))),
      ...(device.state === "quarantined" ? [el("p", { id: "quarantine" }, badge("quarantined"), ` ${device.state_reason}`)] : []),
      ...(device.reserved_by ? [el("p", { id: "reservation", dataset: { reservedBy: device.reserved_by } },
        el("span", { class: "badge badge-busy" }, "reserved"),
        ` by ${device.reserved_by} until ${fmt.when(device.reserved_until)}`,
        device.reservation_note ? ` (${device.reservation_note})` : "",
        ": schedules skip it, checks are refused it; `farm devices release` ends it")] : []),
      el("h2", {}, "Screen"), await screen(device),
      el("h2", {}, "Series"),
      series.length ? table("device-series", ["metric", "workload", "latest", "build", "verdict", "alert"], series.map((c) =>
        el("tr", { dataset: { seriesId: c.series_id } }, el("td", {}, el("a", { href: href("series", c.series_id) }, c.metric)),
          el("td", {}, c.spec), el("td", { class: "num" }, num(c.latest.median, c.unit)), el("td", {}, c.latest.build),
          el("td", {}, window.farm.verdictBadge(c.latest_verdict)),
          el("td", {}, c.verdict ? el("a", { href: href("alert", c.verdict.id) }, badge(c.verdict.kind, c.verdict.kind),
            " ", badge(c.verdict.state, c.verdict.state)) : el("span", { class: "muted" }, "none")))))
        : el("p", { class: "muted" }, "No series yet."),
      el("h2", {}, "State history"),
      health.history.length ? table("state-history", ["when", "from", "to", "event", "reason"], health.history.map((c) =>
        el("tr", { dataset: { to: c.to_state } }, el("td", {}, fmt.when(c.at)), el("td", {}, badge(c.from_state)),
          el("td", {}, badge(c.to_state)), el("td", {}, c.event), el("td", { class: "values" }, c.reason || ""))))
        : el("p", { class: "muted" }, "No state change recorded."),
      el("h2", {}, `Newest runs (${health.recent.length} of ${health.total_runs})`),
      table("recent-runs", ["run", "kind", "build", "status", "finished", "error"], health.recent.map((r) =>
        el("tr", { dataset: { status: r.status } }, el("td", {}, `#${r.run_id}`), el("td", {}, r.kind), el("td", {}, r.build || "—"),
          el("td", {}, badge(r.status, r.status === "succeeded" ? "ok" : "new")), el("td", {}, fmt.when(r.finished_at)),
          el("td", { class: "values" }, r.error || "")))),
      el("h2", {}, "Data stoppages"),
      health.stoppages.length ? el("ul", {}, health.stoppages.map((a) => el("li", {},
        el("a", { href: href("alert", a.id) }, `#${a.id}`), " ", badge(a.state, a.state), ` ${a.summary}`)))
        : el("p", { class: "muted" }, "None."));
  });
})();
