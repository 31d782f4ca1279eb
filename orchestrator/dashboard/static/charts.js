/* The dashboard's charts, drawn with uPlot (vendor/uplot): a series' trend over builds, lines of
   several values over builds (the kernel trend) and a bar chart of values by name (a kernel
   attribution). Builds are versions, not times, so x is
   the build's index and its axis labels are what people call the builds (a build's label, else
   the distinguishing end of its name: `a` and `b` for demo-20261129T012011Z-a and -b, never a
   cut middle), slanted when they would collide; the legend shows the full name.
   Bytes are charted in MiB or GiB; the axis says which. Each chart is kept in farm.charts by
   its container's id, so a test can read what it plots. */
(function () {
  "use strict";
  const { el, fmt } = window.farm;
  const MIB = 1024 * 1024;
  const GIB = 1024 * MIB;
  const ALERT_COLORS = { regression: "#d62728", improvement: "#2ca02c", fidelity: "#9467bd", data_stoppage: "#7f7f7f" };
  const ANNOTATION_COLORS = { deploy: "#8c8c8c", change_point: "#ff7f0e", environment: "#9467bd" };

  // How a unit is charted: values divided by `scale`, the axis labelled `label`.
  function display(unit, values) {
    if (unit === "bytes") {
      const top = Math.max(0, ...values.map(Math.abs));
      return top >= GIB ? { scale: GIB, label: "GiB" } : { scale: MIB, label: "MiB" };
    }
    return { scale: 1, label: unit };
  }

  function tick(v) {
    const a = Math.abs(v);
    return fmt.decimals(v, a >= 1000 ? 0 : a >= 100 ? 1 : a >= 1 ? 2 : 3);
  }

  // The distinguishing end of each of `names` among them: the shortest end (whole parts split
  // after - _ . +) no other name ends with and not all digits (it would read as an id); a name
  // alone, or with no such end, whole. The same rule as the store's short_names.
  function shortNames(names) {
    const distinct = [...new Set(names)];
    if (distinct.length < 2) return names.slice();
    return names.map((name) => {
      const parts = name.split(/(?<=[-_.+])/);
      for (let k = 1; k < parts.length; k++) {
        const end = parts.slice(-k).join("");
        if (/^\d+$/.test(end) || !/[^-_.+]/.test(end)) continue;
        if (!distinct.some((other) => other !== name && other.endsWith(end))) return end;
      }
      return name;
    });
  }

  // What the x axis calls each build: `display[i]` where the API gave one (its label, else its
  // distinguishing end among the series' builds), else its distinguishing end here.
  function axisNames(names, display = []) {
    const derived = shortNames(names);
    return names.map((name, i) => display[i] || derived[i]);
  }

  function xAxis(names) {
    const longest = Math.max(1, ...names.map((n) => n.length));
    const slant = names.length > 4 || longest > 10;
    return {
      splits: () => names.map((_, i) => i),
      values: (u, splits) => splits.map((i) => names[i] ?? ""),
      rotate: slant ? -35 : 0,
      size: slant ? Math.min(220, 24 + Math.ceil(longest * 6.2 * 0.6)) : 40,
      gap: 6,
      grid: { show: false },
    };
  }

  function width(container) {
    return Math.max(360, container.clientWidth || 800);
  }

  // A series' trend: per build the median (a line through points) and the lowest to highest
  // sample (a band); alerts as markers above their build that link to the alert's page;
  // annotations (deploys, change points, environment changes) as dashed rules.
  function trend(container, { title, metric, unit, points, alerts = [], annotations = [], height = 320 }) {
    const names = points.map((p) => p.build);
    const shown = axisNames(names, points.map((p) => p.display));
    const all = points.flatMap((p) => [p.min, p.max]);
    const d = display(unit, all);
    const xs = points.map((_, i) => i);
    const data = [xs, points.map((p) => p.median / d.scale), points.map((p) => p.min / d.scale),
      points.map((p) => p.max / d.scale)];
    const index = Object.fromEntries(names.map((n, i) => [n, i]));
    const legendValue = (u, v) => (v === null || v === undefined ? "—" : fmt.value(v * d.scale, unit));
    const opts = {
      title, width: width(container), height,
      scales: { x: { time: false, range: [-0.5, Math.max(0.5, names.length - 0.5)] } },
      series: [
        { label: "build", value: (u, i) => (i === null || i === undefined ? "—" : names[i] ?? "") },
        { label: "median", stroke: "#1f77b4", width: 2, points: { show: true, size: 8, fill: "#1f77b4" },
          value: legendValue },
        { label: "lowest", stroke: "rgba(31,119,180,0.45)", width: 1, dash: [4, 4], points: { show: false },
          value: legendValue },
        { label: "highest", stroke: "rgba(31,119,180,0.45)", width: 1, dash: [4, 4], points: { show: false },
          value: legendValue },
      ],
      bands: [{ series: [3, 2], fill: "rgba(31,119,180,0.13)" }],
      axes: [xAxis(shown), { label: `${metric} (${d.label})`, values: (u, splits) => splits.map(tick), size: 70 }],
      hooks: {
        draw: [(u) => drawAnnotations(u, annotations, index)],
        ready: [(u) => placeMarkers(u, alerts, index)],
        setSize: [(u) => placeMarkers(u, alerts, index)],
      },
    };
    container.replaceChildren();
    const chart = new uPlot(opts, data, container);
    window.farm.charts[container.id] = chart;
    new ResizeObserver(() => chart.setSize({ width: width(container), height })).observe(container);
    return chart;
  }

  function drawAnnotations(u, annotations, index) {
    const ctx = u.ctx;
    ctx.save();
    ctx.lineWidth = 1.5 * devicePixelRatio;
    ctx.setLineDash([5 * devicePixelRatio, 4 * devicePixelRatio]);
    for (const a of annotations) {
      if (!(a.build in index)) continue;
      const x = Math.round(u.valToPos(index[a.build], "x", true)) + (a.kind === "deploy" ? -3 : 3) * devicePixelRatio;
      ctx.strokeStyle = ANNOTATION_COLORS[a.kind] || "#888";
      ctx.beginPath();
      ctx.moveTo(x, u.bbox.top);
      ctx.lineTo(x, u.bbox.top + u.bbox.height);
      ctx.stroke();
    }
    ctx.restore();
  }

  // Alert markers are links laid over the plot (uPlot's `over` element), so they can be clicked.
  function placeMarkers(u, alerts, index) {
    u.over.querySelectorAll("a.alert-marker").forEach((m) => m.remove());
    const stacked = {};
    for (const a of alerts) {
      if (!(a.build in index)) continue;
      const level = (stacked[a.build] = (stacked[a.build] ?? -1) + 1);
      const marker = el("a", {
        class: `alert-marker alert-${a.kind}`, href: window.farm.href("alert", a.id),
        title: `alert #${a.id} ${a.kind} (${a.state}): ${a.summary}`, dataset: { alertId: a.id, build: a.build },
        style: { left: `${u.valToPos(index[a.build], "x") - 7 + 15 * level}px`, top: "2px",
                 borderTopColor: ALERT_COLORS[a.kind] || "#000" },
      });
      u.over.append(marker);
    }
  }

  // Bars of `values` (one per name, in the order given) on a zero line.
  function bars(container, { title, names, values, unit, height = 280 }) {
    const xs = names.map((_, i) => i);
    const opts = {
      title, width: width(container), height,
      scales: {
        x: { time: false, range: [-0.5, Math.max(0.5, names.length - 0.5)] },
        y: { range: (u, lo, hi) => {
          const a = Math.min(0, lo), b = Math.max(0, hi), pad = (b - a) * 0.08 || 1;
          return [a < 0 ? a - pad : 0, b + pad];
        } },
      },
      series: [
        { label: "kernel", value: (u, i) => (i === null || i === undefined ? "—" : names[i] ?? "") },
        { label: `change (${unit})`, fill: "rgba(214,39,40,0.55)", stroke: "#d62728",
          paths: uPlot.paths.bars({ size: [0.6, 80] }), points: { show: false },
          value: (u, v) => (v === null || v === undefined ? "—" : fmt.value(v, unit)) },
      ],
      axes: [xAxis(names), { label: unit, values: (u, splits) => splits.map(tick), size: 60 }],
    };
    container.replaceChildren();
    const chart = new uPlot(opts, [xs, values], container);
    window.farm.charts[container.id] = chart;
    new ResizeObserver(() => chart.setSize({ width: width(container), height })).observe(container);
    return chart;
  }

  const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f"];

  // One line per entry of `lines` ({label, values}: one value per build, null where none) over
  // the builds `names` (`display`: what the axis calls them, as axisNames).
  function lines(container, { title, names, display = [], lines: entries, unit, height = 320 }) {
    const xs = names.map((_, i) => i);
    const opts = {
      title, width: width(container), height,
      scales: { x: { time: false, range: [-0.5, Math.max(0.5, names.length - 0.5)] } },
      series: [
        { label: "build", value: (u, i) => (i === null || i === undefined ? "—" : names[i] ?? "") },
        ...entries.map((line, i) => ({
          label: line.label, stroke: PALETTE[i % PALETTE.length], width: 2,
          points: { show: true, size: 6, fill: PALETTE[i % PALETTE.length] },
          value: (u, v) => (v === null || v === undefined ? "—" : fmt.value(v, unit)),
        })),
      ],
      axes: [xAxis(axisNames(names, display)), { label: unit, values: (u, splits) => splits.map(tick), size: 60 }],
    };
    container.replaceChildren();
    const chart = new uPlot(opts, [xs, ...entries.map((line) => line.values)], container);
    window.farm.charts[container.id] = chart;
    new ResizeObserver(() => chart.setSize({ width: width(container), height })).observe(container);
    return chart;
  }

  window.farm.chart = { trend, lines, bars, display, shortNames, axisNames };
})();
