/* The overview: a grid of devices by headline metric, each cell a series (keyed as the
   analysis keys it) with its latest build's median, its newest verdict (static/findings.js: an
   unsettled one is never green) and the alert on it, linking to the series' page; then the
   open alerts, a row per regression (alert group) triaged whole, read again while the page is
   open. Reads /v1/overview, /v1/alert-groups, /v1/alerts and /v1/me. */
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
      el("div", { class: "muted", title: cell.latest.build },
        `build ${cell.latest.display || cell.latest.build}, n=${cell.latest.n}, ${cell.builds} builds`),
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

  // ---- the open alerts, a row per regression (alert group) --------------------------------
  // A group is every alert one build raised against one baseline: its row says which builds,
  // how many devices x metrics, the worst change and the alerts by state, and is triaged whole
  // (or the alerts ticked in it); it opens to its alerts and its owner, bug link and note. An
  // alert of no build (a data stoppage) has a row of its own. Live, the list is read again every
  // REFRESH_MS (not while a control has the focus or a triage is on its way; what is typed stays); offline, it is
  // what the copy holds, read-only.

  const GROUP_ACTIONS = [["acknowledge", "Acknowledge", "acknowledged"], ["invalidate", "Invalidate", "invalid"],
    ["fixed", "Mark fixed", "fixed"]];
  const ALL_STATES = ["new", "acknowledged", "invalid", "fixed"];
  // The most a list route gives at once (deps.Limit): a list that comes back this long was cut,
  // and the page says so. An offline copy holds what `farm dashboard build` read, with the
  // routes' default limit (50) and no filters.
  const LIST_LIMIT = 500, OFFLINE_LIMIT = 50;
  const REFRESH_MS = Number(localStorage.getItem("farm.refresh.ms")) || 15000;
  const view = { groups: [], loose: [], cut: { groups: 0, loose: 0 }, me: null, state: "open", sort: "created", device: "", metric: "", kind: "",
    owner: "", expanded: new Set(), chosen: new Set(), drafts: new Map(), busy: false, timer: null };

  // Why this page cannot triage ("" when it can): the offline copy never can; live, the token's scope says.
  function refusal() {
    if (window.farm.mode === "offline") return "An offline copy cannot triage: open the live dashboard (`farm api serve`).";
    if (view.me && !view.me.grants.includes("triage")) {
      return `This token's scope (${view.me.scope}) does not grant triage: sign in with a triage token ` +
        "(`farm api token create --scope triage`).";
    }
    return "";
  }

  function say(kind, text) {
    const message = document.getElementById("groups-message");
    if (!message) return;
    message.dataset.kind = kind;
    message.textContent = text;
  }

  function failed(err, what) {
    const { ApiError } = window.farm;
    const refused = err instanceof ApiError && (err.status === 401 || err.status === 403);
    say(refused ? "refused" : "error", err instanceof ApiError && err.status === 403
      ? `Not allowed: ${err.detail}.` : `${what} failed: ${window.farm.explain(err)}`);
  }

  // The groups, and the alerts of no group (data stoppages: a device's, not a build pair's),
  // both in the state chosen, each asked for by the route's own filters: /v1/alerts unfiltered is
  // the newest 50 open alerts of every kind, where grouped ones crowd an older stoppage out.
  function listPaths() {
    if (window.farm.mode === "offline") {
      return { groups: "/v1/alert-groups", loose: "/v1/alerts", limit: OFFLINE_LIMIT,
        looseOf: "the data stoppages among the newest %n open alerts" };
    }
    const states = view.state === "open" ? [] : view.state === "all" ? ALL_STATES : [view.state];
    const query = (extra) => "?" + new URLSearchParams([...states.map((s) => ["state", s]), ...extra,
      ["limit", String(LIST_LIMIT)]]).toString();
    return { groups: "/v1/alert-groups" + query([]), loose: "/v1/alerts" + query([["kind", "data_stoppage"]]),
      limit: LIST_LIMIT, looseOf: "the newest %n data stoppages" };
  }

  async function fetchGroups() {
    const paths = listPaths();
    const [groups, alerts] = await Promise.all([api(paths.groups), api(paths.loose)]);
    const loose = alerts.filter((a) => a.group_id === null && a.kind === "data_stoppage");
    const cut = { groups: groups.length >= paths.limit ? paths.limit : 0,
      loose: alerts.length >= paths.limit ? paths.limit : 0, looseOf: paths.looseOf };
    const read = JSON.stringify([groups, loose, cut]);
    const changed = read !== view.read;
    [view.groups, view.loose, view.cut, view.read] = [groups, loose, cut, read];
    return changed;
  }

  function severity(g) {
    return g.worst_ratio ? Math.abs(Math.log(g.worst_ratio)) : 0;
  }

  const ORDERS = { created: (a, b) => b.created_at.localeCompare(a.created_at) || b.id - a.id,
    worst: (a, b) => severity(b) - severity(a), size: (a, b) => b.size - a.size };

  function shownGroups() {
    const fits = (a) => (!view.device || a.device === view.device) && (!view.metric || a.metric === view.metric)
      && (!view.kind || a.kind === view.kind);
    const owner = view.owner.trim().toLowerCase();
    return view.groups.filter((g) => g.alerts.some(fits) && (!owner || g.owner.toLowerCase().includes(owner)))
      .sort(ORDERS[view.sort]);
  }

  // A data stoppage has a device but no metric and is no group's kind: a metric or kind chosen hides it.
  function shownLoose() {
    return view.loose.filter((a) => (!view.device || a.device === view.device) && !view.metric && !view.kind);
  }

  function openCount(g) {
    return (g.states.new || 0) + (g.states.acknowledged || 0);
  }

  async function triageGroup(g, action, label, state) {
    const picked = g.alerts.filter((a) => view.chosen.has(a.id)).map((a) => a.id);
    say("working", `${label}: group #${g.id}…`);
    view.busy = true;
    try {
      await api(`/v1/alert-groups/${g.id}/${action}`, { method: "POST", body: picked.length ? { alert_ids: picked } : {} });
      picked.forEach((id) => view.chosen.delete(id));
      const n = picked.length || openCount(g);  // no alert ticked: the group's open alerts, no closed one
      await reload();  // the table shows the new states before the line says done
      say("done", `Group #${g.id}: ${n} alert${n === 1 ? "" : "s"} ${state}.`);
    } catch (err) {
      failed(err, label);
    } finally {
      view.busy = false;
    }
  }

  async function saveGroup(g, fields) {
    say("working", `Saving group #${g.id}…`);
    view.busy = true;
    try {
      await api(`/v1/alert-groups/${g.id}`, { method: "PATCH", body: fields });
      view.drafts.delete(g.id);
      await reload();
      say("done", `Group #${g.id} saved.`);
    } catch (err) {
      failed(err, "Saving");
    } finally {
      view.busy = false;
    }
  }

  function stateCounts(states) {
    return Object.entries(states).filter(([, n]) => n)
      .map(([state, n]) => el("span", { class: "state-count", dataset: { state, count: n } }, badge(`${n} ${state}`, state), " "));
  }

  function groupRows(g, why) {
    const open = view.expanded.has(g.id);
    const toggle = el("button", { type: "button", class: "expand", "aria-expanded": String(open),
      title: open ? "Hide its alerts" : "Show its devices and metrics",
      onclick: () => { (open ? view.expanded.delete(g.id) : view.expanded.add(g.id)); draw(); } }, open ? "▾" : "▸");
    const bug = /^https?:\/\//i.test(g.bug_url)
      ? el("a", { class: "bug-link", href: g.bug_url, rel: "noopener noreferrer", target: "_blank" }, g.bug_url) : "—";
    const actions = GROUP_ACTIONS.map(([action, label, state]) => el("button", { type: "button", class: "group-action",
      dataset: { action, groupId: g.id }, disabled: Boolean(why),
      title: why || `${label} the ticked alerts of this group (whatever their state), else all its ${openCount(g)} ` +
        `open one${openCount(g) === 1 ? "" : "s"} (an invalid or fixed one stays as it is)`,
      onclick: () => triageGroup(g, action, label, state) }, label));
    const head = el("tr", { class: "group-row", dataset: { groupId: g.id, open: String(open) } },
      el("td", {}, toggle, ` #${g.id}`),
      el("td", { class: "builds" }, `${g.baseline_label || "?"} → ${g.build_label || "?"}`),
      el("td", { class: "cells" }, `${g.devices.length} device${g.devices.length === 1 ? "" : "s"} × ` +
        `${g.metrics.length} metric${g.metrics.length === 1 ? "" : "s"}`),
      el("td", { class: "num group-count", dataset: { count: g.size } }, String(g.size)),
      el("td", { class: "num worst" }, num(g.worst_ratio, "", fmt.change)),
      el("td", { class: "states" }, stateCounts(g.states)),
      el("td", { class: "owner" }, g.owner || "—"), el("td", { class: "bug" }, bug),
      el("td", { class: "group-actions" }, actions));
    const alerts = g.alerts.map((a) => el("tr", { class: "group-alert", hidden: !open,
      dataset: { alertId: a.id, groupId: g.id, state: a.state, device: a.device || "", metric: a.metric } },
      el("td", {}, el("input", { type: "checkbox", class: "pick", checked: view.chosen.has(a.id), disabled: Boolean(why),
        title: why || "Triage only the ticked alerts of the group",
        onchange: (e) => { (e.target.checked ? view.chosen.add(a.id) : view.chosen.delete(a.id)); } }),
        " ", el("a", { class: "alert-link", href: href("alert", a.id) }, `#${a.id}`)),
      el("td", {}, badge(a.kind, a.kind)), el("td", {}, a.device || "—"), el("td", {}, a.metric || "—"),
      el("td", { class: "num" }, num(a.ratio, "", fmt.ratio)), el("td", {}, fmt.change(a.ratio)),
      el("td", {}, badge(a.state, a.state)),
      // a regression or improvement sits on a latency series; a fidelity alert's image has no chart
      el("td", { colspan: 2 }, a.series_id && ["regression", "improvement"].includes(a.kind)
        ? el("a", { class: "series-link", href: href("series", a.series_id) }, "series") : "")));
    // What is typed survives the list being read again, until it is saved.
    const draft = view.drafts.get(g.id) || { owner: g.owner, bug_url: g.bug_url, note: g.note };
    const field = (name, key, size) => el("input", { type: "text", class: `edit-${name}`, value: draft[key], size,
      disabled: Boolean(why), title: why || "",
      oninput: (e) => { draft[key] = e.target.value; view.drafts.set(g.id, draft); } });
    const owner = field("owner", "owner", 12), bugUrl = field("bug", "bug_url", 32), note = field("note", "note", 24);
    const edit = el("tr", { class: "group-edit", hidden: !open, dataset: { groupId: g.id } }, el("td", { colspan: 9 },
      el("label", {}, "owner ", owner), " ", el("label", {}, "bug link ", bugUrl), " ", el("label", {}, "note ", note), " ",
      el("button", { type: "button", class: "group-save", disabled: Boolean(why), title: why || "Save owner, bug link and note",
        onclick: () => saveGroup(g, { owner: owner.value.trim(), bug_url: bugUrl.value.trim(), note: note.value }) },
      "Save")));
    return [head, ...alerts, edit];
  }

  function looseRow(a) {
    return el("tr", { class: "loose-alert", dataset: { alertId: a.id, state: a.state, device: a.device || "", metric: a.metric } },
      el("td", {}, el("a", { class: "alert-link", href: href("alert", a.id) }, `#${a.id}`)),
      el("td", {}, badge(a.kind, a.kind)), el("td", { colspan: 3 }, a.device || "—"), el("td", {}, ""),
      el("td", {}, badge(a.state, a.state)), el("td", { colspan: 2 }, a.summary));
  }

  // The table and its heading, from what was read last (the controls stay as they are).
  function draw() {
    const holder = document.getElementById("groups-table");
    if (!holder) return;
    const groups = shownGroups(), loose = shownLoose(), why = refusal();
    const alerts = groups.reduce((n, g) => n + g.size, 0) + loose.length;
    // "+": a list was cut, so there are more than counted
    const [more, moreGroups, moreLoose] = [view.cut.groups || view.cut.loose, view.cut.groups, view.cut.loose]
      .map((cut) => (cut ? "+" : ""));
    document.getElementById("alerts").textContent = `Alerts by regression: ${alerts}${more} in ${groups.length}` +
      `${moreGroups} group${groups.length === 1 ? "" : "s"}${loose.length ? ` and ${loose.length}${moreLoose} alone` : ""}`;
    // A list cut at its limit says so, and where the whole of it is.
    const cut = [view.cut.groups ? el("p", { class: "muted list-cut", dataset: { list: "groups", limit: view.cut.groups } },
      `Showing the newest ${view.cut.groups} groups; \`farm regressions list\` lists every one.`) : "",
    view.cut.loose ? el("p", { class: "muted list-cut", dataset: { list: "loose", limit: view.cut.loose } },
      `Showing ${view.cut.looseOf.replace("%n", view.cut.loose)}; \`farm regressions list --alerts --kind data_stoppage\` ` +
      "lists every one.") : ""].filter(Boolean);
    holder.replaceChildren(...cut, groups.length || loose.length
      ? table("open-alerts", ["group", "builds", "devices × metrics", "alerts", "worst", "states", "owner", "bug",
        "triage"], [...groups.flatMap((g) => groupRows(g, why)), ...loose.map(looseRow)])
      : el("p", { class: "muted" }, "No open alerts."));
  }

  // Read the groups again and draw them; `onlyChanged` (the periodic re-read): draw only when
  // something changed, so an open row, a hovered button or a reader's place stays as it was.
  async function reload(onlyChanged = false) {
    const changed = await fetchGroups();
    if (onlyChanged && !changed) return;
    fillChoices();
    draw();
  }

  function fillChoices() {
    for (const [name, values] of [["device", view.groups.flatMap((g) => g.devices)], ["metric", view.groups.flatMap((g) => g.metrics)]]) {
      const select = document.getElementById(`groups-${name}`);
      if (!select) continue;
      const wanted = ["", ...new Set(values.sort())];
      if (!wanted.includes(view[name])) wanted.push(view[name]);
      select.replaceChildren(...wanted.map((v) => el("option", { value: v, selected: v === view[name] }, v || `every ${name}`)));
    }
  }

  function controls() {
    const offline = window.farm.mode === "offline";
    const select = (name, options, onchange) => el("select", { id: `groups-${name}`,
      onchange: (e) => { view[name] = e.target.value; onchange(); } },
    options.map(([value, text]) => el("option", { value, selected: view[name] === value }, text)));
    const state = select("state", [["open", "open (new, acknowledged)"], ...ALL_STATES.map((s) => [s, s]), ["all", "every state"]],
      () => reload().catch((err) => failed(err, "Reading the groups")));
    if (offline) {
      state.disabled = true;
      state.title = "An offline copy holds the open groups only.";
    }
    const owner = el("input", { id: "groups-owner", type: "search", placeholder: "owner", size: 10,
      oninput: (e) => { view.owner = e.target.value; draw(); } });
    return el("div", { class: "group-controls" },
      el("label", {}, "state ", state), " ",
      el("label", {}, "sort ", select("sort", [["created", "newest first"], ["worst", "worst change first"],
        ["size", "most alerts first"]], draw)), " ",
      el("label", {}, "device ", select("device", [], draw)), " ",
      el("label", {}, "metric ", select("metric", [], draw)), " ",
      el("label", {}, "kind ", select("kind", [["", "every kind"], ["regression", "regression"], ["improvement", "improvement"],
        ["fidelity", "fidelity"]], draw)), " ",
      el("label", {}, "owner ", owner),
      offline ? "" : el("span", { class: "muted" }, ` · read again every ${Math.round(REFRESH_MS / 1000)} s`));
  }

  function keepFresh() {
    if (window.farm.mode === "offline" || view.timer) return;
    view.timer = setInterval(() => {
      const section = document.getElementById("alert-groups");
      const focus = document.activeElement;
      if (!section || view.busy || (section.contains(focus) && focus.matches("input, select, button"))) return;
      reload(true).catch((err) => failed(err, "Reading the groups again"));
    }, REFRESH_MS);
  }

  async function alertSection() {
    [view.me] = await Promise.all([window.farm.mode === "offline" ? null : api("/v1/me"), fetchGroups()]);
    const why = refusal();
    const section = el("section", { id: "alert-groups", dataset: { canTriage: String(!why) } },
      el("h2", { id: "alerts" }, "Open alerts"), controls(),
      why ? el("p", { class: "muted", id: "triage-refusal" }, why) : "",
      el("p", { id: "groups-message", "aria-live": "polite" }), el("div", { id: "groups-table" }));
    window.farm.alertGroups = { reload, view };
    keepFresh();
    return section;
  }

  window.farm.start(async () => {
    const [overview, alerts] = await Promise.all([api("/v1/overview"), alertSection()]);
    const content = document.getElementById("content");
    content.replaceChildren(
      el("h1", {}, "Devices by metric"),
      el("p", { class: "muted" }, "Each cell is one series as the analysis keys it (job kind latency, model, " +
        "resolution, steps, precision, profile, environment): the latest build's median and the newest verdict on it, " +
        "new / baseline median with its 95% interval: regression and improvement (settled), no change (settled), " +
        "inconclusive (not settled: more runs may decide it), not enough data; then the alert, if one was raised."),
      overview.devices.length ? grid(overview) : el("p", { class: "muted" }, "No devices yet."),
      alerts);
    fillChoices();
    draw();
  });
})();
