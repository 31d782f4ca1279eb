/* The overview: a grid of devices by headline metric, each cell a series (keyed as the
   analysis keys it) with its latest build's median, its newest verdict (static/findings.js: an
   unsettled one is never green) and the alert on it, linking to the series' page; then the
   open alerts. Reads /v1/overview and /v1/alerts. */
(function () {
  "use strict";
  const { api, el, num, badge, table, href, fmt } = window.farm;

  // The series' newest verdict as the analysis made it (never green unless settled), then the
  // alert on it, if any: its kind and triage state.
  function verdict(cell) {
    const v = cell.verdict;
    const alert = v ? el("span", { class: "verdict", dataset: { alertId: v.id, kind: v.kind, state: v.state } },
      badge(v.kind, v.kind), " ", badge(v.state, v.state), ` ${fmt.change(v.ratio)}${cell.verdict_on_latest ? "" : ` (${v.build})`}`) : null;
    return el("span", { class: "verdicts" }, window.farm.verdictBadge(cell.latest_verdict), alert ? [" ", alert] : null);
  }

  function cellLink(cell) {
    return el("a", { class: "cell", href: href("series", cell.series_id),
                     dataset: { seriesId: cell.series_id, device: cell.device, metric: cell.metric } },
      el("div", { class: "latest" }, num(cell.latest.median, cell.unit)),
      el("div", { class: "muted" }, `${cell.latest.build}, n=${cell.latest.n}, ${cell.builds} builds`),
      el("div", {}, verdict(cell)),
      el("div", { class: "spec" }, `${cell.spec} · ${cell.environment || "environment not recorded"}`));
  }

  // A device a person holds (`farm devices reserve`): schedules skip it, checks are refused it.
  function reserved(d) {
    const note = d.reservation_note ? ` (${d.reservation_note})` : "";
    return el("span", { class: "badge badge-busy reserved", dataset: { reservedBy: d.reserved_by },
                        title: `reserved by ${d.reserved_by} until ${fmt.when(d.reserved_until)}${note}` },
      `reserved by ${d.reserved_by}`);
  }

  function grid(overview) {
    const headers = ["device", ...overview.metrics.map((m) => `${m.metric} (${m.unit === "bytes" ? "MiB/GiB" : m.unit})`)];
    const rows = overview.devices.map((d) => el("tr", { dataset: { device: d.serial } },
      el("th", {}, el("a", { href: href("device", d.serial) }, d.serial), el("br"),
        el("span", { class: "muted" }, [d.model, d.gpu].filter(Boolean).join(" · ")), " ", badge(d.state),
        d.reserved_by ? [" ", reserved(d)] : null),
      overview.metrics.map((m) => {
        const cells = overview.cells.filter((c) => c.device === d.serial && c.metric === m.metric);
        return el("td", { class: "metric-cell", dataset: { device: d.serial, metric: m.metric } },
          cells.length ? cells.map(cellLink) : el("span", { class: "muted" }, "no runs"));
      })));
    return table("grid", headers, rows);
  }

  function alertRows(alerts) {
    return alerts.map((a) => el("tr", { dataset: { alertId: a.id } },
      el("td", {}, el("a", { class: "alert-link", href: href("alert", a.id) }, `#${a.id}`)),
      el("td", {}, badge(a.kind, a.kind)), el("td", {}, badge(a.state, a.state)),
      el("td", {}, a.device || "—"), el("td", {}, a.metric || "—"), el("td", {}, a.build || "—"),
      el("td", { class: "num" }, num(a.ratio, "", fmt.ratio)), el("td", {}, fmt.change(a.ratio)),
      el("td", {}, a.summary), el("td", {}, fmt.when(a.created_at))));
  }

  window.farm.start(async () => {
    const [overview, alerts] = await Promise.all([api("/v1/overview"), api("/v1/alerts")]);
    const content = document.getElementById("content");
    content.replaceChildren(
      el("h1", {}, "Devices by metric"),
      el("p", { class: "muted" }, "Each cell is one series as the analysis keys it (job kind latency, model, " +
        "resolution, steps, precision, profile, environment): the latest build's median and the newest verdict on it, " +
        "new / baseline median with its 95% interval: regression and improvement (settled), no change (settled), " +
        "inconclusive (not settled: more runs may decide it), not enough data; then the alert, if one was raised."),
      overview.devices.length ? grid(overview) : el("p", { class: "muted" }, "No devices yet."),
      el("h2", { id: "alerts" }, `Open alerts (${alerts.length})`),
      alerts.length ? table("open-alerts", ["alert", "kind", "state", "device", "metric", "build", "ratio", "change",
        "summary", "created"], alertRows(alerts)) : el("p", { class: "muted" }, "No open alerts."));
  });
})();
