// gpu-arbiter dashboard: plain JavaScript, no build step, no external requests.
// Snapshots come from the /v1 API; the event stream (/v1/events, Server-Sent
// Events read through fetch so that the token can travel in a header) says when
// to refresh them.
"use strict";

const state = { token: sessionStorage.getItem("gpu-arbiter-token") || "", lastEventId: null,
  events: [], refreshTimer: null, stream: null };
const $ = (id) => document.getElementById(id);

function mib(mb) {
  if (mb === null || mb === undefined) return "?";
  return Math.abs(mb) >= 1024 ? (mb / 1024).toFixed(1) + " GiB" : mb + " MiB";
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === "class") node.className = value;
    else if (key === "style") node.style.cssText = value;
    else if (key.startsWith("data-")) node.setAttribute(key, value);
    else node[key] = value;
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function headers(extra) {
  const h = Object.assign({ "Accept": "application/json" }, extra || {});
  if (state.token) h["Authorization"] = "Bearer " + state.token;
  return h;
}

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = !message;
  if (message) setTimeout(() => { if (box.textContent === message) box.hidden = true; }, 6000);
}

async function api(method, path, body) {
  const init = { method, headers: headers(body ? { "Content-Type": "application/json" } : {}) };
  if (body) init.body = JSON.stringify(body);
  const response = await fetch(path, init);
  const text = await response.text();
  const data = text ? JSON.parse(text) : null;
  if (!response.ok) {
    const err = (data && data.error) || {};
    throw new Error(`${response.status} ${err.code || ""}: ${err.message || response.statusText}`);
  }
  return data;
}

function renderWorkers(workers) {
  const root = $("workers");
  root.replaceChildren();
  root.append(el("div", { class: "legend" },
    el("i", { style: "background:var(--committed)" }), "committed",
    el("i", { style: "background:var(--used)" }), "used (probe)",
    el("i", { style: "background:#e9ecf1" }), "free"));
  if (!workers.length) root.append(el("p", { class: "empty" }, "No worker registered yet."));
  for (const worker of workers) {
    const head = el("div", { class: "worker-head" },
      el("span", { class: "name" }, worker.name),
      el("span", { class: "state " + worker.state, "data-state": worker.state }, worker.state),
      worker.agent_version ? el("span", { class: "hide-narrow count" }, "agent " + worker.agent_version) : null,
      el("span", { class: "admin" },
        el("button", { "data-action": "drain", "data-worker": worker.name }, "Drain"),
        el("button", { "data-action": "cancel-drain", "data-worker": worker.name }, "Cancel drain")));
    const gpus = (worker.gpus || []).map((gpu) => {
      const total = gpu.total_mb || 1;
      const pct = (mb) => Math.max(0, Math.min(100, 100 * (mb || 0) / total)).toFixed(1) + "%";
      return el("div", { class: "gpu", "data-gpu": gpu.id },
        el("span", {}, gpu.id, " ", el("span", { class: "count hide-narrow" }, gpu.model || gpu.arch || "")),
        el("div", { class: "bar", title: `committed ${mib(gpu.committed_mb)}, used ${mib(gpu.used_mb)}, free ${mib(gpu.free_mb)}` },
          el("span", { class: "committed", style: "width:" + pct(gpu.committed_mb) }),
          el("span", { class: "used", style: "width:" + pct(gpu.used_mb) })),
        el("span", {}, `${mib(gpu.free_mb)} free of ${mib(gpu.total_mb)}`,
          gpu.loading ? el("span", { class: "loading" }, ` · loading ${gpu.loading}`) : null));
    });
    root.append(el("div", { class: "worker", "data-worker": worker.name }, head, gpus));
  }
}

function table(columns, rows, empty) {
  if (!rows.length) return el("p", { class: "empty" }, empty);
  return el("table", {},
    el("thead", {}, el("tr", {}, columns.map((c) => el("th", { class: c.narrow ? "hide-narrow" : "" }, c.title)))),
    el("tbody", {}, rows.map((row) => el("tr", { "data-id": row.id },
      columns.map((c) => el("td", { class: (c.class || "") + (c.narrow ? " hide-narrow" : "") }, c.value(row)))))));
}

function renderQueue(queue) {
  $("queue-count").textContent = `(${queue.length})`;
  $("queue").replaceChildren(table([
    { title: "#", value: (r) => r.position },
    { title: "request", value: (r) => r.id },
    { title: "holder", value: (r) => r.holder || "", narrow: true },
    { title: "VRAM", value: (r) => mib(r.vram_mb) + (r.gpus > 1 ? ` × ${r.gpus}` : "") },
    { title: "priority", value: (r) => r.priority },
    { title: "reason", class: "reason", value: (r) => (r.reason && (r.reason.message || r.reason.code)) || "" },
  ], queue, "Nothing is waiting."));
}

function renderLeases(leases) {
  $("lease-count").textContent = `(${leases.length})`;
  $("leases").replaceChildren(table([
    { title: "lease", value: (r) => r.id },
    { title: "state", value: (r) => r.state },
    { title: "GPUs", value: (r) => (r.gpus || []).join(", ") },
    { title: "VRAM", value: (r) => mib(r.vram_mb) },
    { title: "priority", value: (r) => r.priority, narrow: true },
    { title: "holder", value: (r) => r.holder || "", narrow: true },
    { title: "token", value: (r) => r.token, narrow: true },
    { title: "", value: (r) => el("button", { "data-action": "release", "data-lease": r.id }, "Release") },
  ], leases, "No lease is held."));
}

function renderSummary(status) {
  $("paused").hidden = !status.paused;
  const parts = [];
  const counters = status.counters || {};
  if (status.queue_depth !== undefined) parts.push(`${status.queue_depth} pending`);
  for (const key of ["granted", "preemptions", "expired"]) {
    if (counters[key] !== undefined) parts.push(`${counters[key]} ${key}`);
  }
  $("summary").textContent = parts.join(" · ") || "";
}

async function refresh() {
  state.refreshTimer = null;
  try {
    const [status, workers, queue, leases] = await Promise.all([
      api("GET", "/v1/status"), api("GET", "/v1/workers"),
      api("GET", "/v1/queue"), api("GET", "/v1/leases"),
    ]);
    renderSummary(status);
    renderWorkers(workers);
    renderQueue(queue);
    renderLeases(leases.filter((l) => ["loading", "active", "revoking"].includes(l.state)));
    document.body.dataset.loaded = "true";
  } catch (err) {
    showError(err.message.startsWith("401") ? "Enter a token to see this controller." : err.message);
  }
}

function scheduleRefresh() {
  if (state.refreshTimer === null) state.refreshTimer = setTimeout(refresh, 150);
}

function addEvent(type, data) {
  const text = `${new Date().toLocaleTimeString()} ${type} ${data.lease_id || data.worker || ""} ${data.reason || ""}`;
  const list = $("events");
  list.prepend(el("li", { "data-type": type }, text.trim()));
  while (list.children.length > 200) list.lastChild.remove();
}

async function follow() {
  // Reads the SSE stream with fetch; reconnects with Last-Event-ID after a break.
  for (;;) {
    const controller = new AbortController();
    state.stream = controller;
    try {
      const extra = { "Accept": "text/event-stream" };
      if (state.lastEventId !== null) extra["Last-Event-ID"] = state.lastEventId;
      const response = await fetch("/v1/events", { headers: headers(extra), signal: controller.signal });
      if (!response.ok) throw new Error(`events: ${response.status}`);
      $("conn").textContent = "live"; $("conn").className = "pill on";
      scheduleRefresh();
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const block = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          let type = "message", data = "", id = null;
          for (const line of block.split("\n")) {
            if (line.startsWith("event:")) type = line.slice(6).trim();
            else if (line.startsWith("data:")) data += line.slice(5).trim();
            else if (line.startsWith("id:")) id = line.slice(3).trim();
          }
          if (id !== null) state.lastEventId = id;
          if (!data) continue;
          let parsed = {};
          try { parsed = JSON.parse(data); } catch (e) { parsed = { text: data }; }
          addEvent(parsed.type || type, parsed.data || parsed);
          scheduleRefresh();
        }
      }
    } catch (err) {
      if (controller.signal.aborted) return;
    }
    $("conn").textContent = "offline"; $("conn").className = "pill off";
    await new Promise((resolve) => setTimeout(resolve, 2000));
  }
}

async function act(button) {
  const action = button.dataset.action;
  if (!state.token) { showError("Enter the admin token first."); return; }
  try {
    if (action === "pause" || action === "resume") await api("POST", `/v1/${action}`);
    else if (action === "drain") await api("POST", `/v1/workers/${encodeURIComponent(button.dataset.worker)}/drain`, { mode: "graceful" });
    else if (action === "cancel-drain") await api("POST", `/v1/workers/${encodeURIComponent(button.dataset.worker)}/cancel-drain`);
    else if (action === "release") await api("DELETE", `/v1/leases/${encodeURIComponent(button.dataset.lease)}`);
    showError("");
    scheduleRefresh();
  } catch (err) {
    showError(`${action} refused: ${err.message}`);
  }
}

function restart() {
  if (state.stream) state.stream.abort();
  state.lastEventId = null;
  $("logout").hidden = !state.token;
  follow();
  scheduleRefresh();
}

document.addEventListener("click", (event) => {
  const button = event.target.closest("button[data-action]");
  if (button) act(button);
});
$("login").addEventListener("submit", (event) => {
  event.preventDefault();
  state.token = $("token").value.trim();
  $("token").value = "";
  sessionStorage.setItem("gpu-arbiter-token", state.token);
  restart();
});
$("logout").addEventListener("click", () => {
  state.token = "";
  sessionStorage.removeItem("gpu-arbiter-token");
  restart();
});
restart();
