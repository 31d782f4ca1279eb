/* One series' page: its key, its newest verdict (static/findings.js), its trend (per build the
   median and the lowest to highest sample, alert markers, annotations), its events, a table of
   its points, the kernels that moved between the two builds its verdict compares (drawn as an
   alert page draws them) and its kernel trend (each kernel's time per timed repetition, build by
   build). Reads /v1/series/{id}, /v1/series/{id}/events and /v1/series/{id}/kernels. */
(function () {
  "use strict";
  const { api, el, num, badge, table, href, fmt, pageId, unitOf, annotationList } = window.farm;

  const KEY_FIELDS = [["job kind", () => "latency"], ["device", (k) => k.device], ["model", (k) => k.model],
    ["resolution", (k) => k.resolution], ["steps", (k) => k.steps], ["precision", (k) => k.precision],
    ["profile", (k) => k.profile], ["OS / driver", (k) => k.os_driver], ["environment", (k) => k.environment || "—"]];

  // The series' newest verdict: what the analysis found comparing its newest analysed build
  // with that build's baseline, settled or not.
  function verdictSection(v) {
    const compared = v.build ? `${v.build} against ${v.baseline_build}` : "nothing compared yet";
    return el("div", { id: "latest-verdict" }, el("h2", {}, "Newest verdict"),
      el("p", {}, window.farm.verdictBadge(v, { withBuild: false }), " ", el("span", { id: "verdict-builds" }, compared),
        v.build && !v.on_latest ? el("span", { class: "muted" }, " (not the newest build: its analysis is not recorded yet)") : null),
      el("p", { class: "muted", id: "verdict-reason" }, v.reason));
  }

  // The kernels that moved between the two builds compared (static/findings.js, as an alert
  // page draws them): [parts, draw] or nothing without two builds of kernel timings.
  function movesSection(kernels) {
    if (!kernels.compared || !kernels.moves.length) return { parts: [], draw: () => {} };
    const { build, baseline_build: baseline } = kernels.compared;
    const moves = window.farm.kernelMoves(kernels.moves, { id: "moves", baseline, candidate: build,
      title: `Change of each kernel's time per repetition (${build} − ${baseline})` });
    return { parts: [el("h2", {}, `Kernels that moved: ${build} against ${baseline}`),
      el("p", { class: "muted" }, "Biggest change first; each is named in the kernel trend below, never summed into “other”."),
      ...moves.parts], draw: moves.draw };
  }

  // The kernel trend's heading, chart container and table (each kernel's ms per build).
  function kernelSection(kernels) {
    if (!kernels.builds.length) return [el("h2", {}, "Kernels over builds"), el("p", { class: "muted" }, "No kernel timings in this series.")];
    const rows = kernels.kernels.map((k) => el("tr", { dataset: { kernel: k.kernel } }, el("td", {}, k.kernel),
      ...k.ms.map((v) => el("td", { class: "num" }, v === null ? "—" : num(v, kernels.unit)))));
    return [el("h2", {}, "Kernels over builds"),
      el("p", { class: "muted" }, "Each kernel's time in one timed repetition (its calls summed), averaged over the " +
        "repetitions of this series' runs of each build; the kernels slowest in the newest build and those that moved, " +
        "the rest summed."),
      el("div", { id: "kernel-trend", class: "chart" }),
      table("kernels", ["kernel", ...kernels.builds], rows)];
  }

  window.farm.start(async () => {
    const id = pageId();
    const [series, events, kernels] = await Promise.all([api(`/v1/series/${encodeURIComponent(id)}`),
      api(`/v1/series/${encodeURIComponent(id)}/events`), api(`/v1/series/${encodeURIComponent(id)}/kernels`)]);
    const key = series.key;
    const unit = unitOf(key.metric);
    const title = `${key.metric} on ${key.device}: ${key.model} ${key.resolution}, ${key.steps} steps, ${key.precision}`;
    document.title = `${key.metric} on ${key.device} · devicefarm`;
    const chart = el("div", { id: "trend", class: "chart" });
    const byBuild = Object.fromEntries(events.alerts.map((a) => [a.build, a]));
    const rows = series.points.map((p) => el("tr", { dataset: { build: p.build } },
      el("td", {}, el("a", { class: "build-link", href: href("gallery", p.build), title: "this build's images" }, p.build)),
      el("td", { class: "num" }, String(p.n)),
      el("td", { class: "num median" }, num(p.median, unit)), el("td", { class: "num min" }, num(p.min, unit)),
      el("td", { class: "num max" }, num(p.max, unit)),
      el("td", {}, byBuild[p.build] ? el("a", { href: href("alert", byBuild[p.build].id) },
        badge(byBuild[p.build].kind, byBuild[p.build].kind), ` #${byBuild[p.build].id} ${fmt.change(byBuild[p.build].ratio)}`) : "")));
    const moves = movesSection(kernels);
    document.getElementById("content").replaceChildren(
      el("h1", { id: "series-title" }, title),
      table("series-key", ["", ""], KEY_FIELDS.map(([name, get]) => el("tr", {}, el("th", {}, name), el("td", {}, String(get(key)))))),
      verdictSection(series.latest_verdict),
      el("h2", {}, "Trend over builds"),
      el("p", { class: "muted" }, `Line: each build's median; band: its lowest to highest sample; triangles: alerts ` +
        `(click one); dashed rules: deploys (grey), change points (orange), environment changes (purple). ` +
        `${series.runs} succeeded latency runs.`),
      chart,
      annotationList(events.annotations),
      el("h2", {}, "Builds"),
      table("points", ["build", "samples", "median", "lowest", "highest", "alert"], rows),
      ...moves.parts,
      ...kernelSection(kernels));
    moves.draw();
    window.farm.chart.trend(chart, { title, metric: key.metric, unit, points: series.points, alerts: events.alerts,
      annotations: events.annotations });
    if (kernels.builds.length) {
      window.farm.chart.lines(document.getElementById("kernel-trend"), {
        title: `Kernels over builds on ${key.device}`, names: kernels.builds, unit: kernels.unit,
        display: kernels.builds.map((b) => series.points.find((p) => p.build === b)?.display),
        lines: kernels.kernels.map((k) => ({ label: k.kernel, values: k.ms })) });
    }
  });
})();
