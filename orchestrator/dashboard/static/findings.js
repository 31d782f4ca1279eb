/* What the analysis found, drawn the same way on every page: a series' newest verdict as a
   badge (regression, improvement, inconclusive, no change, not enough data, not analysed: only
   a settled verdict is ever green or red, an unsettled one amber or grey), with its ratio and
   interval ("0.744x (0.564-0.982) inconclusive"); and the kernels that moved between two builds
   as bars and a table, biggest change first (an alert's attribution, a series' kernels that
   moved). Reads nothing itself: the overview, device, series and alert pages hand it what the
   API gave them (latest_verdict; detail.attribution or /v1/series/{id}/kernels' moves). */
(function () {
  "use strict";
  const { el, num, table, fmt } = window.farm;

  const LABELS = { regression: "regression", improvement: "improvement", inconclusive: "inconclusive",
    no_change: "no change", not_enough_data: "not enough data", not_analysed: "not analysed" };

  // "0.744x (0.564-0.982)": the ratio of medians and its interval, as far as they are known.
  function ratioText(v) {
    if (v.ratio === null || v.ratio === undefined) return "";
    const interval = v.ci_low === null || v.ci_low === undefined ? "no interval"
      : `${v.ci_low.toFixed(3)}-${v.ci_high.toFixed(3)}`;
    return `${v.ratio.toFixed(3)}x (${interval}) `;
  }

  // A series' newest verdict (the API's latest_verdict); `withBuild` names the builds compared
  // when the verdict is not about the series' newest build.
  function verdictBadge(v, { withBuild = true } = {}) {
    const label = LABELS[v.verdict] || v.verdict;
    const where = withBuild && v.build && !v.on_latest ? ` (${v.build} vs ${v.baseline_build})` : "";
    const title = [v.build ? `${v.build} vs ${v.baseline_build}` : "", v.reason].filter(Boolean).join(": ");
    return el("span", { class: `series-verdict verdict-${v.verdict}`, title,
                        dataset: { verdict: v.verdict, settled: String(v.settled), ratio: v.ratio ?? "" } },
      `${ratioText(v)}${label}${where}`);
  }

  // The kernels that moved (rows: {kernel, baseline_ms, candidate_ms, delta_ms, share}, biggest
  // change first): [chart container, table] and a function that draws the chart once the
  // container is in the page. Element ids: `${id}-chart` and `${id}`.
  function kernelMoves(rows, { id, title, baseline = "baseline", candidate = "new" }) {
    rows = (rows || []).filter((r) => r.delta_ms !== null && r.delta_ms !== undefined);
    const chart = el("div", { id: `${id}-chart`, class: "chart" });
    const tableRows = rows.map((r) => el("tr", { dataset: { kernel: r.kernel } }, el("td", {}, r.kernel),
      el("td", { class: "num" }, num(r.baseline_ms, "ms")), el("td", { class: "num" }, num(r.candidate_ms, "ms")),
      el("td", { class: "num delta" }, num(r.delta_ms, "ms")),
      el("td", { class: "num" }, r.share === null || r.share === undefined ? "—" : fmt.decimals(100 * r.share, 1) + " %")));
    return {
      rows,
      parts: [chart, table(id, ["kernel", baseline, candidate, "change", "share of the change"], tableRows)],
      draw: () => window.farm.chart.bars(chart, { title, names: rows.map((r) => r.kernel),
        values: rows.map((r) => r.delta_ms), unit: "ms" }),
    };
  }

  Object.assign(window.farm, { verdictBadge, verdictLabels: LABELS, kernelMoves });
})();
