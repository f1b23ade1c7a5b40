// The models page of a multi-model server: its models, their state and memory, polled every 2 s.
(function () {
  "use strict";
  const $ = (id) => document.getElementById(id);
  const mib = (n) => (n / 1048576).toFixed(0) + " MiB";

  function cell(row, text) {
    const td = document.createElement("td");
    td.textContent = text;
    row.appendChild(td);
    return td;
  }

  function render(snap) {
    const body = $("models").querySelector("tbody");
    body.replaceChildren();
    const errors = [];
    for (const m of snap.models) {
      const row = document.createElement("tr");
      row.className = "state-" + m.state;
      cell(row, m.name);
      cell(row, m.state);
      cell(row, m.pinned ? "yes" : "");
      cell(row, m.memory_bytes ? mib(m.memory_bytes) : "");
      cell(row, mib(m.footprint_bytes));
      cell(row, String(m.in_flight));
      cell(row, String(m.waiting));
      cell(row, String(m.loads));
      cell(row, m.last_load_seconds === null ? "" : m.last_load_seconds.toFixed(1) + " s");
      cell(row, Object.entries(m.unloads).filter((e) => e[1]).map((e) => e[0] + " " + e[1]).join(", "));
      const live = cell(row, "");
      if (m.state === "loaded" && m.dashboard) {
        const a = document.createElement("a");
        a.href = "models/" + encodeURIComponent(m.name) + "/dashboard";
        a.textContent = "open";
        live.appendChild(a);
      }
      if (m.error) errors.push(m.name + ": " + m.error);
      body.appendChild(row);
    }
    $("loaded-count").textContent = snap.models.filter((m) => m.state === "loaded").length + " loaded";
    $("memory").textContent = mib(snap.memory_bytes) + " held now, peak " + mib(snap.memory_peak_bytes) +
      ", budget " + mib(snap.memory_budget_bytes);
    $("errors").textContent = errors.join(" · ");
    $("status").textContent = "live";
    $("status").className = "status ready";
    document.body.dataset.updated = String(snap.time);
  }

  function poll() {
    fetch("dashboard/api/models", {credentials: "same-origin", cache: "no-store"})
      .then((r) => { if (!r.ok) throw new Error("HTTP " + r.status); return r.json(); })
      .then(render)
      .catch((e) => { $("status").textContent = "offline (" + e.message + ")"; $("status").className = "status offline"; })
      .finally(() => setTimeout(poll, 2000));
  }

  poll();
})();
