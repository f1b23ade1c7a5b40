// The /dashboard page: renders /dashboard/events snapshots (server-sent events), or polls
// /dashboard/api/state once a second when the event stream is unavailable.
"use strict";
(function () {
  const COLORS = ["#eef0f3", "#9ec5fe", "#2f9e44", "#e8590c"]; // free, cached, in use, shared
  const $ = (id) => document.getElementById(id);
  let pollTimer = null;

  function fmtAge(s) {
    if (s < 1) return (s * 1000).toFixed(0) + " ms";
    if (s < 120) return s.toFixed(1) + " s";
    return (s / 60).toFixed(1) + " min";
  }
  function pct(x) { return x === null || x === undefined ? "n/a" : (100 * x).toFixed(1) + "%"; }
  function cell(tr, text, cls) {
    const td = document.createElement("td");
    td.textContent = text;
    if (cls) td.className = cls;
    tr.appendChild(td);
  }

  function renderRequests(snap) {
    const body = $("requests").tBodies[0];
    body.replaceChildren();
    for (const r of snap.requests) {
      const tr = document.createElement("tr");
      tr.dataset.state = r.state;
      tr.dataset.id = r.id;
      cell(tr, r.id); cell(tr, r.state); cell(tr, fmtAge(r.age_s), "num");
      cell(tr, r.prompt_tokens, "num"); cell(tr, r.output_tokens + " / " + r.max_tokens, "num");
      cell(tr, r.cached_tokens, "num"); cell(tr, r.blocks, "num");
      body.appendChild(tr);
    }
    $("no-requests").style.display = snap.requests.length ? "none" : "";
    const fin = $("finished").tBodies[0];
    fin.replaceChildren();
    for (const f of snap.finished) {
      const tr = document.createElement("tr");
      tr.dataset.state = "finished";
      tr.dataset.id = f.id;
      cell(tr, f.id); cell(tr, "finished (" + f.finish_reason + ")"); cell(tr, fmtAge(f.age_s) + " ago", "num");
      cell(tr, f.latency_s === null ? "–" : fmtAge(f.latency_s), "num");
      cell(tr, f.prompt_tokens, "num"); cell(tr, f.output_tokens, "num");
      fin.appendChild(tr);
    }
  }

  function renderBlocks(kv) {
    const canvas = $("block-map");
    if (!kv) { $("kv-summary").textContent = "engine not ready"; return; }
    const c = kv.counts;
    $("kv-summary").textContent = "utilization " + pct(kv.utilization) + " · prefix cache hit rate " +
      (kv.prefix_caching ? pct(kv.prefix_cache_hit_rate) : "off") + " · " + kv.num_blocks + " blocks of " +
      kv.block_size + " tokens";
    $("kv-free").textContent = c.free + " free";
    $("kv-in-use").textContent = c.in_use + " in use";
    $("kv-cached").textContent = c.cached + " cached (evictable)";
    $("kv-shared").textContent = c.shared + " shared";
    $("block-map-note").textContent = kv.blocks_per_cell > 1 ?
      "each cell is " + kv.blocks_per_cell + " blocks (drawn as the busiest of them)" : "one cell per block";
    if (canvas.dataset.cells === kv.cells) return;
    canvas.dataset.cells = kv.cells;
    const n = kv.cells.length, width = canvas.width;
    const size = Math.max(3, Math.min(14, Math.floor(Math.sqrt(width * 200 / Math.max(1, n)))));
    const perRow = Math.max(1, Math.floor(width / size));
    canvas.height = Math.max(size, Math.ceil(n / perRow) * size);
    const ctx = canvas.getContext("2d");
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    for (let i = 0; i < n; i++) {
      ctx.fillStyle = COLORS[kv.cells.charCodeAt(i) - 48] || "#000";
      ctx.fillRect((i % perRow) * size, Math.floor(i / perRow) * size, size - 1, size - 1);
    }
  }

  function sparkline(svg, points, key, now, windowS) {
    svg.replaceChildren();
    const ns = "http://www.w3.org/2000/svg";
    if (!points.length) return;
    const max = Math.max(...points.map((p) => p[key])) || 1;
    const line = document.createElementNS(ns, "polyline");
    line.setAttribute("points", points.map((p) =>
      (300 * (1 - (now - p.t) / windowS)).toFixed(1) + "," + (76 - 70 * p[key] / max).toFixed(1)).join(" "));
    svg.appendChild(line);
    const label = document.createElementNS(ns, "text");
    label.setAttribute("x", "3"); label.setAttribute("y", "10");
    label.textContent = "max " + (max >= 100 ? max.toFixed(0) : max.toFixed(2));
    svg.appendChild(label);
  }

  function renderSteps(steps, now) {
    if (!steps) return;
    const s = steps.series;
    sparkline($("chart-step-ms"), s, "step_ms", now, steps.window_s);
    sparkline($("chart-batch"), s, "batch_size", now, steps.window_s);
    sparkline($("chart-tokens"), s, "tokens_per_step", now, steps.window_s);
    const last = s[s.length - 1];
    $("last-step-ms").textContent = last ? last.step_ms.toFixed(1) + " ms" : "–";
    $("last-batch").textContent = last ? last.batch_size.toFixed(1) : "–";
    $("last-tokens").textContent = last ? last.tokens_per_step.toFixed(1) : "–";
    $("steps-summary").textContent = steps.total + " steps since start · " + steps.preemptions + " preemptions";
  }

  function render(snap) {
    $("status").textContent = snap.status;
    $("status").className = "status " + snap.status;
    $("running-count").textContent = snap.num_running + " running";
    $("waiting-count").textContent = snap.num_waiting + " waiting";
    $("finished-count").textContent = snap.finished.length ? snap.finished.length + " recently finished" : "";
    renderRequests(snap);
    renderBlocks(snap.kv_cache);
    renderSteps(snap.steps, snap.time);
    document.body.dataset.updated = String(snap.time);
  }

  function poll() {
    $("transport").textContent = "polling";
    fetch("dashboard/api/state", {credentials: "same-origin", cache: "no-store"})
      .then((r) => { if (!r.ok) throw new Error("HTTP " + r.status); return r.json(); })
      .then(render)
      .catch((e) => { $("status").textContent = "offline (" + e.message + ")"; $("status").className = "status offline"; })
      .finally(() => { pollTimer = setTimeout(poll, 1000); });
  }

  function stream() {
    if (!window.EventSource) return poll();
    const es = new EventSource("dashboard/events");
    es.onopen = () => { $("transport").textContent = "live (server-sent events)"; };
    es.onmessage = (ev) => render(JSON.parse(ev.data));
    es.onerror = () => { es.close(); if (pollTimer === null) poll(); };
  }

  stream();
})();
