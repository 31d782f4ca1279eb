/* One series' page: its key, its trend (per build the median and the lowest to highest
   sample, alert markers, annotations), its events and a table of its points. Reads
   /v1/series/{id} and /v1/series/{id}/events. */
(function () {
  "use strict";
  const { api, el, num, badge, table, href, fmt, pageId, unitOf, annotationList } = window.farm;

  const KEY_FIELDS = [["job kind", () => "latency"], ["device", (k) => k.device], ["model", (k) => k.model],
    ["resolution", (k) => k.resolution], ["steps", (k) => k.steps], ["precision", (k) => k.precision],
    ["profile", (k) => k.profile], ["OS / driver", (k) => k.os_driver], ["environment", (k) => k.environment || "—"]];

  window.farm.start(async () => {
    const id = pageId();
    const [series, events] = await Promise.all([api(`/v1/series/${encodeURIComponent(id)}`),
      api(`/v1/series/${encodeURIComponent(id)}/events`)]);
    const key = series.key;
    const unit = unitOf(key.metric);
    const title = `${key.metric} on ${key.device}: ${key.model} ${key.resolution}, ${key.steps} steps, ${key.precision}`;
    document.title = `${key.metric} on ${key.device} · devicefarm`;
    const chart = el("div", { id: "trend", class: "chart" });
    const byBuild = Object.fromEntries(events.alerts.map((a) => [a.build, a]));
    const rows = series.points.map((p) => el("tr", { dataset: { build: p.build } },
      el("td", {}, p.build), el("td", { class: "num" }, String(p.n)),
      el("td", { class: "num median" }, num(p.median, unit)), el("td", { class: "num min" }, num(p.min, unit)),
      el("td", { class: "num max" }, num(p.max, unit)),
      el("td", {}, byBuild[p.build] ? el("a", { href: href("alert", byBuild[p.build].id) },
        badge(byBuild[p.build].kind, byBuild[p.build].kind), ` #${byBuild[p.build].id} ${fmt.change(byBuild[p.build].ratio)}`) : "")));
    document.getElementById("content").replaceChildren(
      el("h1", { id: "series-title" }, title),
      table("series-key", ["", ""], KEY_FIELDS.map(([name, get]) => el("tr", {}, el("th", {}, name), el("td", {}, String(get(key)))))),
      el("h2", {}, "Trend over builds"),
      el("p", { class: "muted" }, `Line: each build's median; band: its lowest to highest sample; triangles: alerts ` +
        `(click one); dashed rules: deploys (grey), change points (orange), environment changes (purple). ` +
        `${series.runs} succeeded latency runs.`),
      chart,
      annotationList(events.annotations),
      el("h2", {}, "Builds"),
      table("points", ["build", "samples", "median", "lowest", "highest", "alert"], rows));
    window.farm.chart.trend(chart, { title, metric: key.metric, unit, points: series.points, alerts: events.alerts,
      annotations: events.annotations });
  });
})();
