// gpu-arbiter dashboard: plain JavaScript, no build step, no external requests.
// Snapshots come from the /v1 API; the event stream (/v1/events, Server-Sent
// Events read through fetch so that the token can travel in a header) says when
// to refresh them. A slow periodic refresh catches what no event announces
// (the memory a probe observes).
"use strict";

const TOKEN_KEY = "gpu-arbiter-token";
const HELD = ["loading", "active", "revoking"];
const EVENTS_SHOWN = 50;
const PERIODIC_REFRESH_MS = 5000;
const state = {
  token: sessionStorage.getItem(TOKEN_KEY) || "",
  generation: 0, // bumped when the token changes: older answers and streams are dropped
  stream: null,
  refreshTimer: null,
  refreshing: false,
  refreshAgain: false,
};
const $ = (id) => document.getElementById(id);

// ---------------------------------------------------------------- helpers

function mib(mb) {
  if (mb === null || mb === undefined) return "?";
  return Math.abs(mb) >= 1024 ? (mb / 1024).toFixed(1) + " GiB" : mb + " MiB";
}

function clock(at) {
  return new Date((at || Date.now() / 1000) * 1000).toLocaleTimeString([], { hour12: false });
}

function ago(at) {
  if (!at) return "";
  const s = Math.max(0, Date.now() / 1000 - at);
  return s < 90 ? `${Math.round(s)}s` : s < 5400 ? `${Math.round(s / 60)}m` : `${(s / 3600).toFixed(1)}h`;
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "width") node.style.width = value;
    else if (key.startsWith("data-") || key.startsWith("aria-") || key === "title" || key === "role") {
      node.setAttribute(key, value);
    }
    else node[key] = value;
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function headers(extra) {
  const h = Object.assign({ "Accept": "application/json" }, extra || {});
  if (state.token) h["Authorization"] = "Bearer " + state.token;
  return h;
}

class ApiError extends Error {
  constructor(status, code, message) {
    super(`${status} ${code}: ${message}`);
    this.status = status;
  }
}

async function api(method, path, body) {
  // Every change says JSON, with a body or not: the controller refuses changes without it.
  const init = { method, headers: headers(method !== "GET" ? { "Content-Type": "application/json" } : {}) };
  if (body) init.body = JSON.stringify(body);
  const response = await fetch(path, init);
  const text = await response.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch (e) { data = null; }
  if (!response.ok) {
    const err = (data && data.error) || {};
    throw new ApiError(response.status, err.code || "error", err.message || response.statusText);
  }
  return data;
}

// ---------------------------------------------------------------- messages

// The notice says why there is nothing to show (no token, token refused, no controller);
// the toast says what an admin action did. A refusal stays until dismissed.
function setNotice(message) {
  $("notice").textContent = message || "";
  $("notice").hidden = !message;
}

function toast(message, kind) {
  const box = $("toast");
  $("toast-text").textContent = message;
  box.className = kind;
  box.hidden = !message;
  if (kind === "ok") setTimeout(() => { if ($("toast-text").textContent === message) box.hidden = true; }, 4000);
}

function setLive(live) {
  $("conn").textContent = live ? "live" : "offline";
  $("conn").className = "pill " + (live ? "on" : "off");
}

// ---------------------------------------------------------------- rendering

function gpuRow(gpu) {
  const total = Math.max(gpu.total_mb || 0, 1);
  const pct = (mb) => Math.max(0, Math.min(100, (100 * (mb || 0)) / total)).toFixed(1) + "%";
  const used = gpu.used_mb === null ? "not observed" : mib(gpu.used_mb);
  const figures = `committed ${mib(gpu.committed_mb)} · used ${used} · free ${mib(gpu.free_mb)} of ${mib(gpu.total_mb)}`;
  return el("div", {
    class: "gpu" + (gpu.stale ? " stale" : ""), "data-gpu": gpu.id, "data-total-mb": gpu.total_mb,
    "data-committed-mb": gpu.committed_mb, "data-free-mb": gpu.free_mb, "data-loading": gpu.loading,
  },
  el("span", { class: "gpu-name" }, gpu.id, " ", el("span", { class: "count" }, gpu.model || gpu.arch || "")),
  el("div", { class: "bar", title: figures, role: "img", "aria-label": figures },
    el("span", { class: "committed", width: pct(gpu.committed_mb) }),
    el("span", { class: "used", width: pct(gpu.used_mb) }),
    gpu.loading ? el("span", { class: "loading-mark", title: `${gpu.loading} lease(s) loading` }) : null),
  el("span", { class: "figures" }, figures,
    gpu.loading ? el("span", { class: "loading" }, ` · loading ${gpu.loading}`) : null,
    gpu.stale ? el("span", { class: "stale-mark" }, " · probe stale") : null));
}

function renderWorkers(workers) {
  const root = $("workers");
  const legend = el("div", { class: "legend" },
    el("i", { class: "committed" }), "committed",
    el("i", { class: "used" }), "used (probe)",
    el("i", { class: "free" }), "free",
    el("i", { class: "loading-mark" }), "loading");
  const rows = workers.map((worker) => {
    const draining = worker.state === "draining" || worker.state === "drained";
    const head = el("div", { class: "worker-head" },
      el("span", { class: "name" }, worker.name),
      el("span", { class: "state " + worker.state, "data-state": worker.state }, worker.state),
      worker.simulated ? el("span", { class: "count" }, "simulated") : null,
      worker.agent_version ? el("span", { class: "count" }, "agent " + worker.agent_version) : null,
      worker.update ? el("span", { class: "count updating", "data-operation": worker.update.operation },
        `updating: waits on ${worker.update.waiting_on}`) : null,
      el("span", { class: "count" }, worker.last_heartbeat_at ? `heartbeat ${ago(worker.last_heartbeat_at)} ago` : ""),
      el("span", { class: "admin" },
        draining ? null : el("button", { "data-action": "drain", "data-worker": worker.name }, "Drain"),
        draining ? el("button", { "data-action": "cancel-drain", "data-worker": worker.name }, "Cancel drain") : null));
    return el("div", { class: "worker", "data-worker": worker.name }, head, (worker.gpus || []).map(gpuRow));
  });
  root.replaceChildren(legend, ...(rows.length ? rows : [el("p", { class: "empty" }, "No worker registered yet.")]));
}

function table(columns, rows, empty) {
  if (!rows.length) return el("p", { class: "empty" }, empty);
  return el("div", { class: "table-wrap" }, el("table", {},
    el("thead", {}, el("tr", {}, columns.map((c) => el("th", {}, c.title)))),
    el("tbody", {}, rows.map((row) => el("tr", { "data-id": row.id },
      columns.map((c) => el("td", { class: c.class || "", "data-label": c.title }, c.value(row))))))));
}

function renderQueue(queue) {
  $("queue-count").textContent = `(${queue.length})`;
  $("queue").replaceChildren(table([
    { title: "#", value: (r) => r.position },
    { title: "request", class: "id", value: (r) => r.id },
    { title: "holder", value: (r) => r.holder || "" },
    { title: "VRAM", value: (r) => mib(r.vram_mb) + (r.gpu_count > 1 ? ` × ${r.gpu_count}` : "") },
    { title: "priority", value: (r) => `${r.priority_name} (${r.priority})` },
    { title: "waiting", value: (r) => ago(r.submitted_at) },
    { title: "reason", class: "reason", value: (r) => (r.reason && (r.reason.message || r.reason.code)) || "" },
  ], queue, "Nothing is waiting."));
}

function renderLeases(leases) {
  $("lease-count").textContent = `(${leases.length})`;
  $("leases").replaceChildren(table([
    { title: "lease", class: "id", value: (r) => r.id },
    { title: "state", value: (r) => r.state + (r.idle ? " (idle)" : "") },
    { title: "GPUs", value: (r) => (r.gpus || []).join(", ") },
    { title: "VRAM", value: (r) => mib(r.vram_mb) },
    { title: "priority", value: (r) => r.priority_name },
    { title: "holder", value: (r) => r.holder || "" },
    { title: "fencing token", value: (r) => r.token },
    { title: "expires in", value: (r) => (r.expires_at ? `${Math.max(0, Math.round(r.expires_at - Date.now() / 1000))}s` : "") },
    { title: "", value: (r) => el("button", { "data-action": "release", "data-lease": r.id }, "Release") },
  ], leases, "No lease is held."));
}

function renderSummary(status) {
  $("paused").hidden = !status.paused;
  $("standby").hidden = status.role !== "standby";
  $("leader-at").hidden = !status.leader;
  if (status.leader) {
    $("leader").href = `${status.leader}/`;
    $("leader").textContent = status.leader;
  }
  const counters = status.counters || {};
  const parts = [`${status.pending || 0} pending`];
  for (const [state, n] of Object.entries(status.leases_by_state || {})) {
    if (HELD.includes(state)) parts.push(`${n} ${state}`);
  }
  for (const [key, n] of Object.entries(counters)) parts.push(`${n} ${key}`);
  if (status.paused) parts.push("paused: nothing is granted until resume");
  $("summary").textContent = parts.join(" · ");
}

function clearViews() {
  for (const id of ["summary", "workers", "queue", "leases", "events", "queue-count", "lease-count"]) {
    $(id).replaceChildren();
  }
  $("paused").hidden = true;
  $("standby").hidden = true;
  delete document.body.dataset.loaded;
}

// ---------------------------------------------------------------- refreshing

async function refresh() {
  state.refreshTimer = null;
  if (state.refreshing) { state.refreshAgain = true; return; }
  state.refreshing = true;
  const generation = state.generation;
  try {
    if (!state.token) {
      clearViews();
      setNotice("Enter a token to see this controller (an admin token for the actions).");
      return;
    }
    const [status, workers, queue, leases] = await Promise.all([
      api("GET", "/v1/status"), api("GET", "/v1/workers"),
      api("GET", "/v1/queue"), api("GET", "/v1/leases"),
    ]);
    if (generation !== state.generation) return;
    renderSummary(status);
    renderWorkers(workers);
    renderQueue(queue);
    renderLeases(leases.filter((l) => HELD.includes(l.state)));
    setNotice("");
    document.body.dataset.loaded = "true";
  } catch (err) {
    if (generation !== state.generation) return;
    if (err.status === 401) {
      clearViews();
      setNotice(`The controller refused this token (${err.message}). Enter another one.`);
    } else {
      setNotice(`Could not read the controller: ${err.message}`);
    }
  } finally {
    state.refreshing = false;
    if (state.refreshAgain) { state.refreshAgain = false; scheduleRefresh(); }
  }
}

function scheduleRefresh() {
  if (state.refreshTimer === null) state.refreshTimer = setTimeout(refresh, 150);
}

// ---------------------------------------------------------------- the event stream

function addEvent(event) {
  const parts = [clock(event.at), event.kind];
  if (event.lease_id) parts.push(event.lease_id);
  if (event.worker) parts.push("worker " + event.worker);
  for (const [key, value] of Object.entries(event.data || {})) {
    if (value !== null && typeof value !== "object") parts.push(`${key}=${value}`);
  }
  const list = $("events");
  list.prepend(el("li", { "data-kind": event.kind, "data-seq": event.seq }, parts.join(" ")));
  while (list.children.length > EVENTS_SHOWN) list.lastChild.remove();
}

function parseBlock(block) {
  let kind = "message", data = "", id = null;
  for (const line of block.split("\n")) {
    if (line.startsWith(":")) continue;
    const cut = line.indexOf(":");
    const field = cut < 0 ? line : line.slice(0, cut);
    const value = cut < 0 ? "" : line.slice(cut + 1).replace(/^ /, "");
    if (field === "event") kind = value;
    else if (field === "data") data += (data ? "\n" : "") + value;
    else if (field === "id") id = value;
  }
  return { kind, data, id };
}

async function readStream(response, generation, onId) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done || generation !== state.generation) return;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const { kind, data, id } = parseBlock(buffer.slice(0, cut));
      buffer = buffer.slice(cut + 2);
      if (id !== null) onId(id);
      if (!data) continue;
      let event;
      try { event = JSON.parse(data); } catch (e) { event = { kind, data: { text: data } }; }
      addEvent(event.kind ? event : { kind, data: event });
      scheduleRefresh();
    }
  }
}

async function follow(generation) {
  // The latest events first (from a little before the current one), then live ones;
  // after a break it resumes with Last-Event-ID.
  let lastId = null;
  while (generation === state.generation) {
    const controller = new AbortController();
    state.stream = controller;
    try {
      if (lastId === null) {
        const status = await api("GET", "/v1/status");
        lastId = String(Math.max(0, (status.last_event || 0) - 20));
      }
      const response = await fetch("/v1/events", {
        headers: headers({ "Accept": "text/event-stream", "Last-Event-ID": lastId }),
        signal: controller.signal,
      });
      if (!response.ok) throw new ApiError(response.status, "events", response.statusText);
      setLive(true);
      scheduleRefresh();
      await readStream(response, generation, (id) => { lastId = id; });
    } catch (err) {
      if (controller.signal.aborted || generation !== state.generation) return;
      if (err.status === 401) { setLive(false); return; } // refresh() says why
    }
    setLive(false);
    await new Promise((resolve) => setTimeout(resolve, 2000));
  }
}

// ---------------------------------------------------------------- admin actions

function request(action, data) {
  const worker = encodeURIComponent(data.worker || "");
  switch (action) {
    case "pause": return ["POST", "/v1/pause"];
    case "resume": return ["POST", "/v1/resume"];
    case "drain": return ["POST", `/v1/workers/${worker}/drain`, { mode: "graceful" }];
    case "cancel-drain": return ["POST", `/v1/workers/${worker}/cancel-drain`];
    case "release": return ["DELETE", `/v1/leases/${encodeURIComponent(data.lease)}`];
    default: return null;
  }
}

async function act(button) {
  const { action } = button.dataset;
  const call = request(action, button.dataset);
  if (call === null) return;
  if (action === "release" && !window.confirm(`Release lease ${button.dataset.lease}?`)) return;
  const target = button.dataset.worker || button.dataset.lease;
  const label = target ? `${action} ${target}` : action;
  button.disabled = true;
  try {
    await api(...call);
    toast(`${label}: done`, "ok");
    scheduleRefresh();
  } catch (err) {
    const hint = err.status === 401 ? " (enter the admin token)" : err.status === 403 ? " (an admin token is needed)" : "";
    toast(`${label} refused: ${err.message}${hint}`, "error");
  } finally {
    button.disabled = false;
  }
}

// ---------------------------------------------------------------- wiring

function useToken(token) {
  state.token = token;
  if (token) sessionStorage.setItem(TOKEN_KEY, token);
  else sessionStorage.removeItem(TOKEN_KEY);
  state.generation += 1;
  if (state.stream) state.stream.abort();
  $("logout").hidden = !token;
  clearViews();
  setLive(false);
  toast("", "");
  if (token) follow(state.generation);
  scheduleRefresh();
}

document.addEventListener("click", (event) => {
  const button = event.target.closest("button[data-action]");
  if (button) act(button);
});
$("toast-close").addEventListener("click", () => { $("toast").hidden = true; });
$("login").addEventListener("submit", (event) => {
  event.preventDefault();
  const token = $("token").value.trim();
  $("token").value = "";
  useToken(token);
});
$("logout").addEventListener("click", () => useToken(""));
setInterval(() => { if (state.token && !document.hidden) scheduleRefresh(); }, PERIODIC_REFRESH_MS);
useToken(state.token);
