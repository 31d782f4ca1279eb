/* One alert's page: what it found (ratio, interval, p), its group, its triage (Acknowledge,
   Invalidate, Mark fixed: POSTs that need a triage token, disabled with why for a token without
   it; a refusal is shown, never swallowed), the trend of its series, the samples before and
   after, the kernel attribution as bars, the images of both builds and the rest of what the
   analysis recorded. Reads /v1/alerts/{id}, its /context, /v1/me and, when it is about a
   series, /v1/series/{id} and its /events. */
(function () {
  "use strict";
  const { api, el, num, badge, table, href, fmt, pageId, unitOf, annotationList, imageSource, ApiError } = window.farm;

  const ACTIONS = [["acknowledge", "Acknowledge"], ["invalidate", "Invalidate"], ["fixed", "Mark fixed"]];

  function facts(alert) {
    const rows = [
      ["kind", badge(alert.kind, alert.kind)],
      ["state", el("span", { id: "alert-state" }, badge(alert.state, alert.state))],
      ["device", alert.device ? el("a", { href: href("device", alert.device) }, alert.device) : "—"],
      ["metric", alert.metric || "—"],
      ["build", alert.build || "—"], ["baseline build", alert.baseline_build || "—"],
      ["ratio (new / baseline median)", el("span", { id: "ratio" }, num(alert.ratio, "", fmt.ratio))],
      ["change", fmt.change(alert.ratio)],
      ["95% interval of the ratio", alert.ci_low === null ? "—" : el("span", { id: "interval" }, "[",
        el("span", { id: "ci-low" }, num(alert.ci_low, "", fmt.ratio)), ", ",
        el("span", { id: "ci-high" }, num(alert.ci_high, "", fmt.ratio)), "]")],
      ["p", el("span", { id: "p-value" }, num(alert.p_value, "", fmt.pValue))],
      ["created", fmt.when(alert.created_at)], ["updated", el("span", { id: "alert-updated" }, fmt.when(alert.updated_at))],
      ["note", el("span", { id: "alert-note" }, alert.note || "—")],
      ["group", alert.group_id === null ? "— (no build: alone)" : el("a", { id: "alert-group", href: `${href("overview")}#alerts`,
        title: "Its regression: every alert of this build against its baseline, triaged together on the overview" },
      `#${alert.group_id}`)],
    ];
    return table("alert-facts", ["", ""], rows.map(([k, v]) => el("tr", {}, el("th", {}, k), el("td", {}, v))));
  }

  // Why this page cannot triage ("" when it can): never offline; live, the token's scope says (/v1/me).
  function refusal(me) {
    if (window.farm.mode === "offline") return "An offline copy cannot triage: open the live dashboard (`farm api serve`).";
    if (me && !me.grants.includes("triage")) {
      return `This token's scope (${me.scope}) does not grant triage: sign in with a triage token ` +
        "(`farm api token create --scope triage`).";
    }
    return "";
  }

  function triage(alert, me) {
    const message = el("p", { id: "triage-message", "aria-live": "polite" });
    const note = el("input", { id: "triage-note", type: "text", placeholder: "note (optional)", size: 40 });
    const buttons = ACTIONS.map(([action, label]) => el("button", {
      type: "button", id: `triage-${action}`, dataset: { action },
      onclick: async () => {
        message.dataset.kind = "working";
        message.textContent = `${label}…`;
        try {
          const body = note.value.trim() ? { note: note.value.trim() } : {};
          const updated = await api(`/v1/alerts/${alert.id}/${action}`, { method: "POST", body });
          document.getElementById("alert-state").replaceChildren(badge(updated.state, updated.state));
          document.getElementById("alert-note").textContent = updated.note || "—";
          document.getElementById("alert-updated").textContent = fmt.when(updated.updated_at);
          message.dataset.kind = "done";
          message.textContent = `Alert #${alert.id} is now ${updated.state}.`;
        } catch (err) {
          message.dataset.kind = err instanceof ApiError && (err.status === 403 || err.status === 401) ? "refused" : "error";
          message.textContent = err instanceof ApiError && err.status === 403
            ? `Not allowed: ${err.detail}. Use a triage token (the form at the top: forget token, then enter it).`
            : err instanceof ApiError && err.status === 401 ? `The token was refused (${err.detail}).`
            : `Triage failed: ${window.farm.explain(err)}`;
        }
      },
    }, label));
    const why = refusal(me);
    [...buttons, note].forEach((b) => { b.disabled = Boolean(why); b.title = why; });
    return el("div", { class: "triage" }, buttons, note, why ? el("p", { class: "muted", id: "triage-refusal" }, why) : null,
      message);
  }

  function side(name, s, analysisMedian, analysisN, unit) {
    if (!s) return el("tr", {}, el("th", {}, name), el("td", { colspan: 4, class: "muted" }, "no samples in the series"));
    return el("tr", { id: `samples-${name}`, dataset: { build: s.build } },
      el("th", {}, name), el("td", {}, s.build), el("td", { class: "num n" }, String(analysisN ?? s.n)),
      el("td", { class: "num median" }, num(analysisMedian ?? s.median, unit)),
      el("td", { class: "values" }, s.values.map((v) => fmt.value(v, unit)).join(", ")));
  }

  // The kernels that moved, drawn as a series page draws them (static/findings.js).
  function attribution(detail) {
    const moves = window.farm.kernelMoves(detail.attribution, { id: "attribution",
      title: "Change of each kernel's time per run (new − baseline)" });
    return moves.rows.length ? [el("h2", {}, "Kernel attribution"), ...moves.parts, moves.draw] : [];
  }

  async function images(context) {
    const figures = [];
    for (const name of ["before", "after"]) {
      const ref = context.images[name];
      if (!ref) {
        figures.push(el("figure", {}, el("figcaption", {}, name), el("p", { class: "muted" }, "no image recorded")));
        continue;
      }
      const img = el("img", { class: "alert-image", id: `image-${name}`, alt: `${name}: ${ref.build}` });
      img.src = await imageSource(ref);
      figures.push(el("figure", {}, el("figcaption", {}, `${name}: ${ref.build} (seed ${ref.seed ?? "—"}) ${ref.prompt}`), img));
    }
    return el("div", { class: "images" }, figures);
  }

  function recorded(detail) {
    const items = [];
    if (detail.reason) items.push(["reason", detail.reason]);
    if (detail.environment) items.push(["environment", detail.environment]);
    if ((detail.environment_change || []).length) items.push(["environment change", detail.environment_change.join("; ")]);
    if (detail.min_effect !== undefined) items.push(["minimum effect", fmt.decimals(100 * detail.min_effect, 1) + " %"]);
    if ((detail.excluded_runs || []).length) items.push(["runs left out", detail.excluded_runs.join(", ")]);
    if (detail.psnr_db !== undefined) items.push(["PSNR", fmt.value(detail.psnr_db, "dB")]);
    for (const cp of detail.change_points || []) {
      items.push([`change point at ${cp.build}`, `ratio ${fmt.ratio(cp.ratio)}, p ${fmt.pValue(cp.p_value)}`]);
    }
    return items.length ? [el("h2", {}, "What the analysis recorded"),
      table("recorded", ["", ""], items.map(([k, v]) => el("tr", {}, el("th", {}, k), el("td", {}, v))))] : [];
  }

  window.farm.start(async () => {
    const id = pageId();
    const [alert, context, me] = await Promise.all([api(`/v1/alerts/${encodeURIComponent(id)}`),
      api(`/v1/alerts/${encodeURIComponent(id)}/context`), window.farm.mode === "offline" ? null : api("/v1/me")]);
    document.title = `Alert #${alert.id} · devicefarm`;
    const detail = alert.detail || {};
    const unit = context.unit;
    const later = [];
    const parts = [el("h1", {}, `Alert #${alert.id}: ${alert.kind} of ${alert.metric || "a device"} on ${alert.device || "—"}`),
      el("p", { id: "alert-summary" }, alert.summary), facts(alert), el("h2", {}, "Triage"), triage(alert, me)];
    if (context.series_id) {
      const [series, events] = await Promise.all([api(`/v1/series/${context.series_id}`),
        api(`/v1/series/${context.series_id}/events`)]);
      const chart = el("div", { id: "trend", class: "chart" });
      const key = series.key;
      const title = `${key.metric} on ${key.device}: ${key.model} ${key.resolution}, ${key.steps} steps, ${key.precision}`;
      parts.push(el("h2", {}, "Trend of its series ", el("a", { id: "series-link", href: href("series", context.series_id) }, "(series page)")),
        chart, annotationList(events.annotations));
      later.push(() => window.farm.chart.trend(chart, { title, metric: key.metric, unit: unitOf(key.metric),
        points: series.points, alerts: events.alerts, annotations: events.annotations }));
    }
    if (context.before || context.after) {
      parts.push(el("h2", {}, "Samples before and after"),
        table("samples", ["", "build", "samples", "median", "values"], [
          side("before", context.before, detail.baseline_median, detail.n_baseline, unit),
          side("after", context.after, detail.candidate_median, detail.n_candidate, unit)]));
    }
    for (const part of attribution(detail)) (typeof part === "function" ? later.push(part) : parts.push(part));
    if (context.images.before || context.images.after) parts.push(el("h2", {}, "Images before and after"), await images(context));
    parts.push(...recorded(detail));
    document.getElementById("content").replaceChildren(...parts);
    later.forEach((draw) => draw());
  });
})();
