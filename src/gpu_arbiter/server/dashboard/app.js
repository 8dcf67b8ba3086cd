// gpu-arbiter dashboard: plain JavaScript, no build step, no external requests.
// Snapshots come from the /v1 API; the event stream (/v1/events, Server-Sent
// Events read through fetch so that the token can travel in a header) says when
// to refresh them. A slow periodic refresh catches what no event announces
// (the memory a probe observes). The history strips are polled from
// /v1/history at the controller's sample rate: samples are readings, not events.
// The gateways' models are polled from /v1/gateways (their reports are not events).
"use strict";

const TOKEN_KEY = "gpu-arbiter-token";
const HELD = ["loading", "active", "revoking"];
const EVENTS_SHOWN = 50;
const PERIODIC_REFRESH_MS = 5000;
const GATEWAYS_POLL_MS = 2000;
const LABEL_MIN_PX = 28; // a segment narrower than this shows no name (its title does)
const CLASSES = [["critical", 1000], ["interactive", 800], ["normal", 500], ["background", 300], ["batch", 100]];
const state = {
  token: sessionStorage.getItem(TOKEN_KEY) || "",
  generation: 0, // bumped when the token changes: older answers and streams are dropped
  access: null, // GET /v1/access: whether tokens are needed, this token's role
  live: -1, // the generation whose event stream and history polling run
  stream: null,
  refreshTimer: null,
  refreshing: false,
  refreshAgain: false,
  holders: new Map(), // lease id -> holder, for the words of reasons and events
  history: null,
  lastWorkers: [],
};
const $ = (id) => document.getElementById(id);
// The SVG namespace, from the parser rather than spelled out: the dashboard names no URL.
const SVG_NS = (() => {
  const t = document.createElement("template");
  t.innerHTML = "<svg></svg>";
  return t.content.firstChild.namespaceURI;
})();

// ---------------------------------------------------------------- helpers

function mib(mb) {
  if (mb === null || mb === undefined) return "?";
  return Math.abs(mb) >= 1024 ? (mb / 1024).toFixed(1) + " GiB" : mb + " MiB";
}

function clock(at) {
  return new Date((at || Date.now() / 1000) * 1000).toLocaleTimeString([], { hour12: false });
}

function duration(s) {
  s = Math.max(0, s);
  return s < 90 ? `${Math.round(s)}s` : s < 5400 ? `${Math.round(s / 60)}m` : `${(s / 3600).toFixed(1)}h`;
}

function ago(at) {
  return at ? duration(Date.now() / 1000 - at) : "";
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "style") Object.assign(node.style, value);
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

function svg(tag, attrs, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
  node.append(...children);
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

function priorityClass(priority) {
  for (const [name, floor] of CLASSES) if (priority >= floor) return name;
  return "batch";
}

function holderOf(leaseId) {
  const holder = state.holders.get(leaseId);
  return holder ? `${holder} (${leaseId})` : leaseId;
}

// ---------------------------------------------------------------- words

// What the codes of the API mean, in words. A code not listed here is shown with its
// underscores as spaces, so that a new one still reads.
const WORDS = {
  paused: "the arbiter is paused: nothing is granted until it is resumed",
  no_workers: "no worker is registered yet",
  workers_draining: "the only GPUs that match are on workers that are draining, drained or offline",
  no_matching_gpu: "no GPU matches its constraints",
  too_large: "it is larger than every GPU that matches",
  insufficient_vram: "not enough free memory",
  load_in_progress: "another lease is loading there (loads on a GPU take turns)",
  nominated_for: "the memory is held for a request ahead in the queue",
  preempting: "waiting for the leases it preempts to stop",
  worker_mismatch: "another worker was asked for",
  gpu_mismatch: "other GPUs were asked for",
  vendor_mismatch: "another vendor was asked for",
  arch_mismatch: "another architecture was asked for",
  compute_capability_too_low: "its compute capability is too low",
  model_mismatch: "another model was asked for",
  label_mismatch: "its worker's labels do not match",
  too_small: "too small",
  too_few_gpus_on_worker: "too few GPUs on its worker",
  worker_draining: "its worker is draining",
  worker_drained: "its worker is drained",
  worker_offline: "its worker is offline",
  probe_stale: "its probe has not reported lately",
  preempted: "preempted",
  revoked_by_admin: "revoked by an admin",
  worker_removed: "its worker was removed",
};

function words(code) {
  return WORDS[code] || String(code || "").replace(/_/g, " ");
}

// A field the dashboard does not know yet, shown by the form of its name.
function fieldText(key, value) {
  const name = key.replace(/_(mb|at|s)$/, "").replace(/_/g, " ");
  if (value === null || value === undefined || value === "") return null;
  if (key.endsWith("_mb") && typeof value === "number") return `${name} ${mib(value)}`;
  if (key.endsWith("_at") && typeof value === "number") {
    const left = value - Date.now() / 1000;
    return `${name} ${clock(value)} (${left >= 0 ? "in " + duration(left) : duration(-left) + " ago"})`;
  }
  if (key.endsWith("_s") && typeof value === "number") return `${name} ${duration(value)}`;
  if (typeof value === "string" && state.holders.has(value)) return `${name} ${holderOf(value)}`;
  if (typeof value === "object") return `${name} ${JSON.stringify(value)}`;
  return `${name} ${value}`;
}

const VERDICT_KEYS = ["gpu", "code", "need_mb", "free_mb", "committed_mb", "observed_mb", "held_mb", "count"];
// Shown in words already (the sentence names the blocker and every lease in the way, with
// its countdown and rule; "waits on" names its holder).
const REASON_KEYS = ["code", "message", "gpus", "nominated", "blocked_by", "blocker", "blockers"];

function verdictText(verdict) {
  const parts = [words(verdict.code)];
  if (verdict.code === "insufficient_vram") {
    const observed = verdict.observed_mb ? `, ${mib(verdict.observed_mb)} in use` : "";
    parts.push(`needs ${mib(verdict.need_mb)}, ${mib(Math.max(0, verdict.free_mb))} free ` +
      `(${mib(verdict.committed_mb)} committed${observed})`);
  }
  if (verdict.code === "nominated_for" && verdict.held_mb) parts.push(`${mib(verdict.held_mb)} held`);
  for (const [key, value] of Object.entries(verdict)) {
    if (!VERDICT_KEYS.includes(key)) parts.push(fieldText(key, value));
  }
  return parts.filter(Boolean).join(": ");
}

function listOfGpus(ids) {
  return ids.length > 4 ? `${ids.slice(0, 3).join(", ")} and ${ids.length - 3} more` : ids.join(", ");
}

// Many GPUs that say the same: one line, the GPU nearest to taking the request named, with
// the figure that matters most (the API gives one verdict per code, and how many GPUs give it).
function groupText(verdict) {
  const code = verdict.code;
  if (code === "insufficient_vram") return `${words(code)}: needs ${mib(verdict.need_mb)}, at most ${mib(Math.max(0, verdict.free_mb))} free`;
  if (code === "nominated_for") return `${words(code)}: up to ${mib(verdict.held_mb)} held`;
  return words(code);
}

// The API's sentence (the same words as the CLI), then what the GPUs say in words (one
// line per code: the GPU nearest to taking the request, and how many more say the same),
// then any other field the API gives.
function reasonView(reason) {
  if (!reason) return "";
  const lines = [];
  for (const v of reason.gpus || []) {
    const count = v.count || 1;
    if (count > 1) lines.push(el("li", {}, el("b", {}, `${v.gpu} and ${count - 1} more`), " ", groupText(v)));
    else lines.push(el("li", {}, el("b", {}, v.gpu), " ", verdictText(v)));
  }
  if ((reason.nominated || []).length) lines.push(el("li", {}, `first in line on ${listOfGpus(reason.nominated)}`));
  const blocker = reason.blocked_by || (reason.blocker && reason.blocker.id);
  if (blocker) lines.push(el("li", {}, `waits on ${holderOf(blocker)}`));
  for (const [key, value] of Object.entries(reason)) {
    if (REASON_KEYS.includes(key)) continue;
    const text = fieldText(key, value);
    if (text) lines.push(el("li", {}, text));
  }
  return el("div", { "data-code": reason.code },
    el("div", { class: "reason-text" }, reason.message || words(reason.code)),
    lines.length ? el("ul", { class: "verdicts" }, lines) : null);
}

// ---------------------------------------------------------------- messages

// The notice says why there is nothing to show (no token, token refused, no controller);
// the toast says what an admin action did. A refusal stays until dismissed.
function setNotice(...content) {
  $("notice").replaceChildren(...content);
  $("notice").hidden = !content.length || content.every((c) => !c);
}

function toast(message, kind) {
  const box = $("toast");
  $("toast-text").textContent = message;
  box.className = kind;
  box.hidden = !message;
  if (kind === "ok") setTimeout(() => { if ($("toast-text").textContent === message) box.hidden = true; }, 4000);
}

// The badge: "live" while the event stream runs; "token needed" while the controller
// answers but shows nothing without a valid token (a 401 says it is up); "offline" only
// when it could not be reached; "connecting" until the first answer.
const CONN = {
  live: ["live", "on"], token: ["token needed", "token"], offline: ["offline", "off"],
  connecting: ["connecting", "wait"],
};

function setConn(kind) {
  const [text, style] = CONN[kind];
  $("conn").textContent = text;
  $("conn").className = "pill " + style;
  $("conn").dataset.conn = kind;
}

// Where tokens come from: the admin token's file when the controller tells it (it does
// to a browser on its own machine), else where that file is kept.
function tokenHint() {
  const file = state.access && state.access.admin_token_file;
  const where = file
    ? ["The admin token is in ", el("code", { class: "token-file" }, file), " on the controller's machine: paste what it holds above."]
    : ["The admin token is in the file ", el("code", {}, "admin.token"),
      " in the controller's state directory (the controller printed its path when it started)."];
  return el("span", {}, ...where, " Tokens of other roles come from ",
    el("code", {}, "gpu-arbiter token create --role client"), " (a client token reads, and changes only its own leases).");
}

function setRole(access) {
  const role = access && access.role ? access.role : "";
  document.body.dataset.role = role;
  $("role").hidden = !role || !access.auth;
  $("role").textContent = role === "admin" ? "admin" : `${role}: read only`;
}

// ---------------------------------------------------------------- the GPU bars

function segment(lease, gpuId, total) {
  const pct = (100 * lease.vram_mb) / total;
  const cls = priorityClass(lease.priority);
  const holder = lease.holder || "";
  const how = lease.state + (lease.idle ? ", idle" : "") + (lease.loading && lease.state !== "loading" ? ", loading" : "");
  const title = `${holder || "no holder"}: ${mib(lease.vram_mb)} on ${gpuId}, ${lease.priority_name} ` +
    `(${lease.priority}), ${how}; lease ${lease.id}`;
  const classes = ["segment", "prio-" + cls, lease.state];
  if (lease.loading || lease.state === "loading") classes.push("is-loading");
  if (lease.idle) classes.push("idle");
  return el("span", {
    class: classes.join(" "), title, "data-lease": lease.id, "data-holder": holder,
    "data-vram-mb": lease.vram_mb, "data-state": lease.state, "data-class": cls, style: { width: pct + "%" },
  }, el("span", { class: "label" }, holder));
}

function gpuBar(gpu, leasesById, figures) {
  const total = Math.max(gpu.total_mb || 0, 1);
  const pct = (mb) => Math.max(0, Math.min(100, (100 * (mb || 0)) / total)) + "%";
  const leases = (gpu.leases || []).map((id) => leasesById.get(id)).filter(Boolean)
    .sort((a, b) => (a.token || 0) - (b.token || 0));
  const shown = leases.reduce((sum, l) => sum + l.vram_mb, 0);
  const other = (gpu.committed_mb || 0) - shown; // leases granted since the list was read
  const parts = leases.map((lease) => segment(lease, gpu.id, total));
  if (other > 0) {
    parts.push(el("span", { class: "segment other", title: `${mib(other)} committed to leases not listed yet`,
      "data-vram-mb": other, style: { width: pct(other) } }));
  }
  const headroom = (gpu.total_mb || 0) - (gpu.capacity_mb || gpu.total_mb || 0);
  return el("div", { class: "bar", title: figures, role: "img", "aria-label": figures },
    el("div", { class: "segments" }, parts),
    headroom > 0 ? el("span", { class: "headroom", title: `${mib(headroom)} kept free for the driver`,
      style: { width: pct(headroom) } }) : null,
    gpu.used_mb === null ? null : el("span", { class: "used-line", title: `in use (probe): ${mib(gpu.used_mb)}`,
      "data-used-mb": gpu.used_mb, style: { left: pct(gpu.used_mb) } }));
}

// Names only where they fit: measured once the bars are laid out.
function fitLabels() {
  for (const seg of document.querySelectorAll(".segment[data-holder]")) {
    seg.classList.toggle("narrow", seg.clientWidth < LABEL_MIN_PX);
  }
}

function gpuRow(gpu, leasesById) {
  const used = gpu.used_mb === null ? "not observed" : mib(gpu.used_mb);
  const figures = `committed ${mib(gpu.committed_mb)} · used ${used} · free ${mib(gpu.free_mb)} of ${mib(gpu.total_mb)}`;
  return el("div", {
    class: "gpu" + (gpu.stale ? " stale" : ""), "data-gpu": gpu.id, "data-total-mb": gpu.total_mb,
    "data-committed-mb": gpu.committed_mb, "data-free-mb": gpu.free_mb, "data-loading": gpu.loading,
  },
  el("span", { class: "gpu-name" }, gpu.id, " ", el("span", { class: "count" }, gpu.model || gpu.arch || "")),
  gpuBar(gpu, leasesById, figures),
  el("div", { class: "history", "data-gpu": gpu.id }, gpuStrip(gpu.id)),
  el("span", { class: "figures" }, figures,
    gpu.loading ? el("span", { class: "loading" }, ` · loading ${gpu.loading}`) : null,
    gpu.stale ? el("span", { class: "stale-mark" }, " · probe stale") : null));
}

function legend() {
  const swatch = (cls, text) => [el("i", { class: "swatch " + cls }), text];
  return el("div", { class: "legend" },
    el("span", {}, CLASSES.flatMap(([name]) => swatch("prio-" + name, name))),
    el("span", {}, swatch("is-loading prio-normal", "loading"), swatch("revoking prio-normal", "revoking"),
      swatch("idle prio-normal", "idle"), swatch("used", "in use (probe)"), swatch("free", "free")),
    el("span", { class: "history-legend" }, el("span", { id: "history-span" }, "history"), ":",
      swatch("h-committed", "committed"), swatch("h-busy", "busy"), swatch("h-used", "in use")));
}

function renderWorkers(workers, leasesById) {
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
    return el("div", { class: "worker", "data-worker": worker.name }, head,
      (worker.gpus || []).map((gpu) => gpuRow(gpu, leasesById)));
  });
  $("workers").replaceChildren(legend(), ...(rows.length ? rows : [el("p", { class: "empty" }, "No worker registered yet.")]));
  fitLabels();
  drawHistorySpan();
}

// ---------------------------------------------------------------- the history strips

// One sample per time: committed and busy memory as areas, the probe's reading as a line,
// over the controller's window (samples × sample_s) ending at its latest sample.
function xy(times, values, scale) {
  const h = state.history;
  const end = times[times.length - 1];
  const span = h.samples * h.sample_s;
  const runs = [];
  let run = [];
  values.forEach((v, i) => {
    if (v === null || v === undefined) { if (run.length) runs.push(run); run = []; return; }
    run.push([(times[i] - (end - span)).toFixed(2), (100 - 100 * Math.min(1, v / scale)).toFixed(2)]);
  });
  if (run.length) runs.push(run);
  return runs;
}

function area(runs) {
  return runs.map((r) => `M${r[0][0]} 100 ` + r.map(([x, y]) => `L${x} ${y}`).join(" ") + ` L${r[r.length - 1][0]} 100 Z`).join(" ");
}

function line(runs) {
  return runs.map((r) => r.map(([x, y], i) => `${i ? "L" : "M"}${x} ${y}`).join(" ")).join(" ");
}

function strip(label, paths) {
  const h = state.history;
  return svg("svg", { class: "strip", viewBox: `0 0 ${h.samples * h.sample_s} 100`, preserveAspectRatio: "none",
    "data-samples": h.times.length, role: "img", "aria-label": label }, svg("title", {}, label), ...paths);
}

function gpuStrip(gpuId) {
  const h = state.history;
  const series = h && h.gpus.get(gpuId);
  if (!series || !h.times.length) return null;
  const total = Math.max(series.total_mb, 1);
  const last = (values) => values[values.length - 1];
  const label = `${gpuId}, last ${duration(h.samples * h.sample_s)}: now committed ${mib(last(series.committed_mb))}, ` +
    `busy ${mib(last(series.busy_mb))}, in use ${series.used_mb.some((v) => v !== null) ? mib(last(series.used_mb)) : "not observed"}`;
  return strip(label, [
    svg("path", { class: "h-committed", d: area(xy(h.times, series.committed_mb, total)) }),
    svg("path", { class: "h-busy", d: area(xy(h.times, series.busy_mb, total)) }),
    svg("path", { class: "h-used", d: line(xy(h.times, series.used_mb, total)), "vector-effect": "non-scaling-stroke" }),
  ]);
}

// The queue by priority class, stacked (batch at the bottom), scaled to its own peak.
function queueStrip() {
  const h = state.history;
  if (!h || !h.times.length) return null;
  const names = CLASSES.map(([name]) => name).reverse();
  const totals = h.times.map((_, i) => names.reduce((sum, n) => sum + ((h.queue[n] || [])[i] || 0), 0));
  const peak = Math.max(1, ...totals);
  const below = h.times.map(() => 0);
  const paths = names.map((name) => {
    const top = below.map((b, i) => b + ((h.queue[name] || [])[i] || 0));
    const upper = xy(h.times, top, peak)[0];
    const lower = xy(h.times, below, peak)[0];
    top.forEach((v, i) => { below[i] = v; });
    const d = `M${upper.map(([x, y]) => `${x} ${y}`).join(" L")} L${lower.reverse().map(([x, y]) => `${x} ${y}`).join(" L")} Z`;
    return svg("path", { class: "prio-" + name, d, "data-class": name });
  });
  const label = `pending by priority, last ${duration(h.samples * h.sample_s)}: peak ${peak}, now ${totals[totals.length - 1]}`;
  const node = strip(label, paths);
  node.setAttribute("data-peak", peak);
  return el("div", { class: "queue-strip" }, node,
    el("span", { class: "count" }, `pending, last ${duration(h.samples * h.sample_s)} (peak ${peak})`));
}

function drawHistorySpan() {
  const h = state.history;
  const span = $("history-span");
  if (span && h) span.textContent = `history of the last ${duration(h.samples * h.sample_s)} (a sample every ${duration(h.sample_s)}` +
    (h.gpus_left_out ? `; ${h.gpus_left_out} GPUs beyond the controller's cap of ${h.max_gpus} not kept)` : ")");
}

function drawHistory() {
  for (const box of document.querySelectorAll(".history[data-gpu]")) box.replaceChildren(gpuStrip(box.dataset.gpu) || "");
  $("queue-history").replaceChildren(queueStrip() || "");
  drawHistorySpan();
}

// Appends an answer of /v1/history to what the page holds, and keeps the last `samples`.
function mergeHistory(got) {
  const h = state.history || { times: [], gpus: new Map(), queue: {} };
  Object.assign(h, { sample_s: got.sample_s, samples: got.samples, max_gpus: got.max_gpus, gpus_left_out: got.gpus_left_out });
  const before = h.times.length;
  const nulls = (n) => new Array(n).fill(null);
  h.times.push(...got.times);
  const seen = new Set();
  for (const gpu of got.gpus) {
    seen.add(gpu.id);
    const series = h.gpus.get(gpu.id) || { committed_mb: nulls(before), used_mb: nulls(before), busy_mb: nulls(before) };
    series.total_mb = gpu.total_mb;
    for (const key of ["committed_mb", "used_mb", "busy_mb"]) series[key].push(...gpu[key]);
    h.gpus.set(gpu.id, series);
  }
  for (const [id, series] of h.gpus) {
    if (!seen.has(id)) for (const key of ["committed_mb", "used_mb", "busy_mb"]) series[key].push(...nulls(got.times.length));
  }
  for (const [name, counts] of Object.entries(got.queue)) h.queue[name] = (h.queue[name] || nulls(before)).concat(counts);
  const drop = Math.max(0, h.times.length - h.samples);
  if (drop) {
    h.times.splice(0, drop);
    for (const series of h.gpus.values()) for (const key of ["committed_mb", "used_mb", "busy_mb"]) series[key].splice(0, drop);
    for (const counts of Object.values(h.queue)) counts.splice(0, drop);
  }
  state.history = h;
}

async function pollHistory(generation) {
  if (generation !== state.generation) return;
  let waitMs = PERIODIC_REFRESH_MS;
  try {
    const h = state.history;
    const since = h && h.times.length ? `?since=${h.times[h.times.length - 1]}` : "";
    const got = await api("GET", "/v1/history" + since);
    if (generation !== state.generation) return;
    mergeHistory(got);
    drawHistory();
    waitMs = Math.max(1000, got.sample_s * 1000);
  } catch (err) {
    // refresh() says what is wrong; the next poll tries again
  }
  setTimeout(() => pollHistory(generation), waitMs);
}

// ---------------------------------------------------------------- the models of the gateways

// The gateways report to the controller (the page never talks to them): one block per
// host, one table per gateway, polled every GATEWAYS_POLL_MS while the page is visible.
const MODEL_STATES = {
  cold: "cold (stopped)",
  failed: "failed (its last start failed)",
  asleep: "asleep (process kept, memory given back)",
};

function modelLeases(model) {
  const leases = (model.replicas || []).filter((r) => r.lease)
    .map((r) => r.lease + (r.lease_idle ? " (idle)" : "") + (r.priority !== undefined ? `, priority ${r.priority}` : ""));
  return leases.length ? leases.join("; ") : "-";
}

// A model with requests in flight is in use now, whenever its last one came.
function lastUsed(model) {
  if (model.in_flight) return `now (${model.in_flight} in flight)`;
  const ago = model.last_used_ago_s;
  return ago === null || ago === undefined ? "never" : duration(ago) + " ago";
}

function keepAliveLeft(model) {
  const left = (model.replicas || []).map((r) => r.keep_alive_left_s).filter((s) => typeof s === "number");
  if (typeof model.keep_alive_left_s === "number") left.push(model.keep_alive_left_s);
  return left.length ? duration(Math.min(...left)) : "-";
}

function modelState(model) {
  let why = model.pending_reason || model.failure;
  if (model.state === "failed" && typeof model.retry_in_s === "number") {
    why = (why || "") + (model.retry_in_s > 0 ? `; next start in ${duration(model.retry_in_s)}` : "; may start now");
  }
  return el("span", {},
    el("span", { class: "model-state " + model.state, "data-state": model.state }, MODEL_STATES[model.state] || model.state),
    why ? el("div", { class: "reason-text" }, why) : null);
}

function pinnedText(model) {
  if (!model.pinned) return "no";
  return model.preemptible_by ? `yes: only ${model.preemptible_by} may preempt` : "yes: not preemptible";
}

function modelButtons(gateway, model) {
  const data = { "data-gateway": gateway.name, "data-model": model.id };
  return el("span", { class: "nowrap" },
    el("button", { "data-action": "model-unload", ...data }, "Unload"), " ",
    model.pinned
      ? el("button", { "data-action": "model-unpin", ...data }, "Unpin")
      : el("button", { "data-action": "model-pin", ...data }, "Pin"));
}

function gatewayBlock(gateway) {
  const head = el("div", { class: "gateway-head" },
    el("span", { class: "name" }, gateway.name),
    el("code", { class: "url" }, gateway.url),
    gateway.worker ? el("span", { class: "count" }, "beside worker " + gateway.worker) : null,
    gateway.stale
      ? el("span", { class: "stale-mark" }, `not reporting for ${duration(gateway.reported_ago_s)}`)
      : el("span", { class: "count" }, `reported ${duration(gateway.reported_ago_s)} ago`));
  return el("div", { class: "gateway" + (gateway.stale ? " stale" : ""), "data-gateway": gateway.name }, head, table([
    { title: "model", class: "lead", value: (m) => [m.id, ...(m.aliases || []).map((a) => el("span", { class: "count" }, " " + a))] },
    { title: "state", value: modelState },
    { title: "lease", class: "id", value: modelLeases },
    { title: "memory held / wanted", value: (m) => `${mib(m.held_mb || 0)} / ${mib(m.vram_mb)}` },
    { title: "in flight", value: (m) => m.in_flight || 0 },
    { title: "queued", value: (m) => m.queued || 0 },
    { title: "last used", value: lastUsed },
    { title: "keep-alive left", value: keepAliveLeft },
    { title: "pinned", class: "pinned", value: pinnedText },
    { title: "", class: "admin", value: (m) => modelButtons(gateway, m) },
  ], gateway.models || [], "No model."), routesBlock(gateway));
}

// A front door's last routing decisions: where each request went, and why.
function routesBlock(gateway) {
  const routes = (gateway.routes || []).slice(-5).reverse();
  if (!routes.length) return null;
  return el("div", { class: "routes", "data-routes": gateway.name },
    el("span", { class: "count" }, "last routes:"),
    el("ul", {}, routes.map((r) => el("li", { "data-outcome": r.outcome }, r.why))));
}

function renderModels(gateways) {
  $("model-count").textContent = `(${gateways.reduce((n, g) => n + (g.models || []).length, 0)})`;
  const hosts = new Map();
  for (const gateway of gateways) {
    const host = gateway.host || "unknown host";
    if (!hosts.has(host)) hosts.set(host, []);
    hosts.get(host).push(gateway);
  }
  const blocks = [...hosts].sort(([a], [b]) => a.localeCompare(b)).map(([host, found]) =>
    el("div", { class: "host", "data-host": host }, el("h3", {}, host), found.map(gatewayBlock)));
  $("models").replaceChildren(...(blocks.length ? blocks
    : [el("p", { class: "empty" }, "No gateway reports to this controller (gateways report to the leader, every 5 s).")]));
}

async function refreshGateways(generation) {
  try {
    const gateways = await api("GET", "/v1/gateways");
    if (generation === state.generation) renderModels(gateways);
  } catch (err) {
    // refresh() says what is wrong; the next poll tries again
  }
}

async function pollGateways(generation) {
  if (generation !== state.generation) return;
  if (!document.hidden) await refreshGateways(generation);
  setTimeout(() => pollGateways(generation), GATEWAYS_POLL_MS);
}

// ---------------------------------------------------------------- tables

function table(columns, rows, empty) {
  if (!rows.length) return el("p", { class: "empty" }, empty);
  return el("div", { class: "table-wrap" }, el("table", {},
    el("thead", {}, el("tr", {}, columns.map((c) => el("th", { class: c.class || "" }, c.title)))),
    el("tbody", {}, rows.map((row) => el("tr", { "data-id": row.id },
      columns.map((c) => el("td", { class: c.class || "", "data-label": c.title }, c.value(row))))))));
}

function holderCell(row) {
  return row.holder ? el("span", { class: "holder" }, row.holder) : el("span", { class: "holder none" }, "no holder");
}

function renderQueue(queue) {
  $("queue-count").textContent = `(${queue.length})`;
  $("queue").replaceChildren(table([
    { title: "holder", class: "lead", value: holderCell },
    { title: "#", value: (r) => r.position },
    { title: "VRAM", value: (r) => mib(r.vram_mb) + (r.gpu_count > 1 ? ` × ${r.gpu_count}` : "") },
    { title: "priority", value: (r) => `${r.priority_name} (${r.priority})` },
    { title: "waiting", value: (r) => ago(r.submitted_at) },
    { title: "why it waits", class: "reason", value: (r) => reasonView(r.reason) },
    { title: "request", class: "id", value: (r) => r.id },
  ], queue, "Nothing is waiting."));
}

function leaseState(r) {
  let text = r.state + (r.idle ? " (idle)" : "");
  if (r.state === "revoking") {
    text += ": " + words(r.revoke_reason || "revoked");
    if (r.preempted_for) text += ` for ${holderOf(r.preempted_for)}`;
  }
  return text;
}

function renderLeases(leases) {
  $("lease-count").textContent = `(${leases.length})`;
  $("leases").replaceChildren(table([
    { title: "holder", class: "lead", value: holderCell },
    { title: "state", value: leaseState },
    { title: "GPUs", value: (r) => (r.gpus || []).join(", ") },
    { title: "VRAM", value: (r) => mib(r.vram_mb) + (r.gpus && r.gpus.length > 1 ? ` × ${r.gpus.length}` : "") },
    { title: "priority", class: "nowrap", value: (r) => el("span", {}, el("i", { class: "swatch prio-" + priorityClass(r.priority) }), r.priority_name) },
    { title: "expires in", value: (r) => (r.expires_at ? `${Math.max(0, Math.round(r.expires_at - Date.now() / 1000))}s` : "") },
    { title: "lease", class: "id", value: (r) => r.id },
    { title: "fencing token", value: (r) => r.token },
    { title: "", class: "admin", value: (r) => el("button", { "data-action": "release", "data-lease": r.id }, "Release") },
  ], leases, "No lease is held."));
}

const INTERNAL_COUNTERS = ["examined"]; // the scheduler's own work, not the operator's news

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
  for (const [key, n] of Object.entries(counters)) {
    const [what, why] = key.split(":");
    if (INTERNAL_COUNTERS.includes(what)) continue;
    parts.push(`${n} ${words(what)}` + (why ? ` (${words(why)})` : ""));
  }
  if (status.paused) parts.push("paused: nothing is granted until resume");
  $("summary").textContent = parts.join(" · ");
}

function clearViews() {
  for (const id of ["summary", "workers", "queue", "queue-history", "leases", "events", "queue-count", "lease-count", "models", "model-count"]) {
    $(id).replaceChildren();
  }
  $("paused").hidden = true;
  $("standby").hidden = true;
  delete document.body.dataset.loaded;
}

// ---------------------------------------------------------------- refreshing

// Whether the page may read the controller; says why not.
async function signedIn() {
  if (state.access === null) {
    state.access = await api("GET", "/v1/access");
    setRole(state.access);
  }
  if (!state.access.auth) return true;
  if (!state.token || !state.access.role) setConn("token");
  if (!state.token) {
    setNotice(el("span", {}, "Enter a token to see this controller. "), tokenHint());
  } else if (!state.access.role) {
    setNotice(el("span", {}, "The controller refused this token (unknown token). Enter another one. "), tokenHint());
  } else {
    return true;
  }
  clearViews();
  return false;
}

async function refresh() {
  state.refreshTimer = null;
  if (state.refreshing) { state.refreshAgain = true; return; }
  state.refreshing = true;
  const generation = state.generation;
  try {
    if (!(await signedIn()) || generation !== state.generation) return;
    const [status, workers, queue, leases] = await Promise.all([
      api("GET", "/v1/status"), api("GET", "/v1/workers"),
      api("GET", "/v1/queue"), api("GET", "/v1/leases"),
    ]);
    if (generation !== state.generation) return;
    const held = leases.filter((l) => HELD.includes(l.state));
    for (const row of [...held, ...queue]) state.holders.set(row.id, row.holder);
    renderSummary(status);
    renderWorkers(workers, new Map(held.map((l) => [l.id, l])));
    renderQueue(queue);
    renderLeases(held);
    setNotice();
    document.body.dataset.loaded = "true";
    goLive(generation);
  } catch (err) {
    if (generation !== state.generation) return;
    if (err.status === 401) {
      state.access = null; // asked again next time: the token may have been removed
      setConn("token");
      clearViews();
      setNotice(`The controller refused this token (${err.message}). Enter another one.`);
    } else {
      if (!(err instanceof ApiError)) setConn("offline"); // no answer at all
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

// Once per token: the event stream, the history polling and the gateways' polling.
function goLive(generation) {
  if (state.live === generation) return;
  state.live = generation;
  follow(generation);
  pollHistory(generation);
  pollGateways(generation);
}

// ---------------------------------------------------------------- the event stream

// An event's datum as the CLI shows it: sizes and durations in words, leases by holder.
function eventValue(key, value) {
  if (typeof value === "number" && key.endsWith("_mb")) return mib(value).replace(" ", "");
  if (typeof value === "number" && key.endsWith("_s")) return duration(value);
  if (typeof value === "string" && state.holders.has(value)) return holderOf(value);
  return value;
}

function addEvent(event) {
  if (event.lease_id && event.data && event.data.holder) state.holders.set(event.lease_id, event.data.holder);
  const holder = event.lease_id ? state.holders.get(event.lease_id) : null;
  const parts = [clock(event.at), event.kind];
  if (holder) parts.push(holder);
  if (event.lease_id) parts.push(event.lease_id);
  if (event.worker) parts.push("worker " + event.worker);
  for (const [key, value] of Object.entries(event.data || {})) {
    if (value === null || typeof value === "object" || key === "holder") continue;
    parts.push(`${key}=${eventValue(key, value)}`);
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
      setConn("live");
      scheduleRefresh();
      await readStream(response, generation, (id) => { lastId = id; });
    } catch (err) {
      if (controller.signal.aborted || generation !== state.generation) return;
      if (err.status === 401) { setConn("token"); return; } // refresh() says why
    }
    setConn("offline");
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
    case "model-unload": case "model-pin": case "model-unpin":
      return ["POST", `/v1/gateways/${encodeURIComponent(data.gateway)}/models/${encodeURIComponent(data.model)}/${action.slice(6)}`];
    default: return null;
  }
}

async function act(button) {
  const { action } = button.dataset;
  const call = request(action, button.dataset);
  if (call === null) return;
  const holder = button.dataset.lease ? state.holders.get(button.dataset.lease) : null;
  const what = button.dataset.lease ? `lease ${button.dataset.lease}` + (holder ? ` of ${holder}` : "") : "";
  if (action === "release" && !window.confirm(`Release ${what}?`)) return;
  const model = button.dataset.model ? `${button.dataset.model} on ${button.dataset.gateway}` : "";
  if (action === "model-unload" && !window.confirm(`Unload ${model}? Its servers stop now.`)) return;
  const target = button.dataset.worker || button.dataset.lease || model;
  const verb = button.dataset.model ? action.replace("model-", "") : action;
  const label = target ? `${verb} ${target}` : verb;
  button.disabled = true;
  try {
    await api(...call);
    toast(`${label}: ${button.dataset.model ? "sent to the gateway" : "done"}`, "ok");
    scheduleRefresh();
    if (button.dataset.model) refreshGateways(state.generation);
  } catch (err) {
    const hint = err.status === 401 ? " (enter the admin token)" : err.status === 403 ? " (an admin token is needed)" : "";
    toast(`${label} refused: ${err.message}${hint}`, "error");
    if (err.status === 401 || err.status === 403) { state.access = null; scheduleRefresh(); }
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
  state.access = null;
  state.history = null;
  setRole(null);
  if (state.stream) state.stream.abort();
  $("logout").hidden = !token;
  clearViews();
  setConn("connecting");
  toast("", "");
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
window.addEventListener("resize", fitLabels);
setInterval(() => { if ((state.token || state.live === state.generation) && !document.hidden) scheduleRefresh(); }, PERIODIC_REFRESH_MS);
useToken(state.token);
