// The engine dashboard: one server-sent event stream (/v1/debug/stream) a few times a second,
// drawn as cards, charts (uPlot), the recent requests' timelines, the last steps and the radix tree.
"use strict";

const $ = (id) => document.getElementById(id);
const charts = {};
let stream = null;  // the AbortController of the open stream

const fmt = (value, digits = 0, unit = "") =>
  value === null || value === undefined ? "–" : `${Number(value).toFixed(digits)}${unit}`;
const pct = (value) => fmt(value * 100, 1, " %");

const CARDS = [
  ["running", "running", (e) => e.stats.num_running],
  ["waiting", "waiting", (e) => e.stats.num_waiting],
  ["kv-usage", "KV cache usage", (e) => pct(e.stats.kv_cache_usage)],
  ["memory-pressure", "memory pressure", (e) => fmt(e.stats.memory_pressure, 3)],
  ["prefix-hit-rate", "prefix cache hit rate", (e) => pct(e.stats.prefix_cache_hit_rate)],
  // the KV tiers under the prefix cache (--kv-offload-*): prompt tokens promoted back, and of the
  // tiers below memory the part read from the shared store (--kv-offload-url)
  ["kv-tier-hits", "KV tier hit tokens: memory / disk+shared (shared)", (e) =>
    `${fmt(e.stats.kv_offload_memory_hit_tokens)} / ${fmt(e.stats.kv_offload_disk_hit_tokens)} ` +
    `(${fmt(e.stats.kv_offload_remote_read_tokens)})`],
  ["preemptions", "preemptions (total)", (e) => e.stats.num_preemptions_total],
  ["gen-tps", "generated tok/s (10 s)", (e) => fmt(e.window.generation_tokens_per_s, 1)],
  ["prompt-tps", "prompt tok/s (10 s)", (e) => fmt(e.window.prompt_tokens_per_s, 1)],
  ["ttft-p50", "TTFT p50 / p99 (ms)", (e) => `${fmt(e.window.ttft_ms.p50, 1)} / ${fmt(e.window.ttft_ms.p99, 1)}`],
  ["itl-p50", "ITL p50 / p99 (ms)", (e) => `${fmt(e.window.itl_ms.p50, 2)} / ${fmt(e.window.itl_ms.p99, 2)}`],
  ["busy", "engine busy (10 s)", (e) => pct(e.window.busy)],
  ["num-steps", "steps (total)", (e) => e.num_steps],
];

function drawCards(engine) {
  const box = $("cards");
  if (!box.children.length) {
    box.innerHTML = CARDS.map(([id, label]) =>
      `<div class="card"><div class="value" id="${id}">–</div><div class="label">${label}</div></div>`).join("");
  }
  for (const [id, , value] of CARDS) $(id).textContent = value(engine);
}

function chart(id, series, yLabel) {
  const el = $(id);
  const opts = {
    width: Math.max(300, el.clientWidth), height: 180, legend: { live: false },
    scales: { x: { time: true } }, axes: [{}, { label: yLabel, size: 55 }],
    series: [{}, ...series.map(([label, stroke]) => ({ label, stroke, width: 1.5, spanGaps: true }))],
  };
  return new uPlot(opts, [[], ...series.map(() => [])], el);
}

function drawCharts(series) {
  if (!charts.throughput) {
    charts.throughput = chart("chart-throughput", [["generated", "#2f6fdf"], ["prompt", "#e49b2f"]], "tok/s");
    charts.ttft = chart("chart-ttft", [["p50", "#2f6fdf"], ["p90", "#e49b2f"], ["p99", "#c0392b"]], "ms");
    charts.itl = chart("chart-itl", [["p50", "#2f6fdf"], ["p90", "#e49b2f"], ["p99", "#c0392b"]], "ms");
    charts.load = chart("chart-load", [["running", "#2f6fdf"], ["waiting", "#e49b2f"], ["KV %", "#7d3cc0"]], "");
  }
  const t = series.map((p) => p.time);
  const col = (f) => series.map(f);
  charts.throughput.setData([t, col((p) => p.generated_tokens), col((p) => p.prompt_tokens)]);
  charts.ttft.setData([t, col((p) => p.ttft_ms.p50), col((p) => p.ttft_ms.p90), col((p) => p.ttft_ms.p99)]);
  charts.itl.setData([t, col((p) => p.itl_ms.p50), col((p) => p.itl_ms.p90), col((p) => p.itl_ms.p99)]);
  charts.load.setData([t, col((p) => p.running), col((p) => p.waiting), col((p) => p.kv_usage * 100)]);
}

// One bar per request, scaled to its own total time: where the time went.
function timeline(r) {
  const total = Math.max(r.total_ms || 0, 0.001);
  const at = (ms) => `${Math.min(100, (100 * ms) / total).toFixed(2)}%`;
  const span = (cls, from, to, title) =>
    `<span class="${cls}" style="left:${at(from)};width:${at(Math.max(to - from, total / 400))}" title="${title}"></span>`;
  const parts = [span("queued", 0, r.queued_ms, `queued ${fmt(r.queued_ms, 1)} ms`)];
  for (const c of r.prefill_chunks) {
    parts.push(span("prefill", c.start_ms, c.start_ms + c.duration_ms, `step ${c.step}: ${c.tokens} prompt tokens`));
  }
  if (r.first_token_ms !== null) parts.push(span("decode", r.first_token_ms, total, `${r.output_tokens} tokens`));
  for (const p of r.preemptions_ms) parts.push(`<span class="preempt" style="left:${at(p)}" title="preempted"></span>`);
  return `<div class="timeline">${parts.join("")}</div>`;
}

function drawRequests(requests) {
  const rows = requests.slice(0, 25).map((r) => `<tr>
    <td class="mono">${escapeHtml(r.request_id.slice(0, 28))}</td><td>${r.state}</td><td>${r.prompt_tokens}</td>
    <td>${r.cached_tokens}</td><td>${r.output_tokens || ""}</td><td>${fmt(r.queued_ms, 1)}</td>
    <td>${r.prefill_chunks.length}</td><td>${fmt(r.first_token_ms, 1)}</td><td>${fmt(r.mean_itl_ms, 2)}</td>
    <td>${fmt(r.total_ms, 0)}</td><td>${r.finish_reason || ""}</td><td class="text">${timeline(r)}</td></tr>`);
  $("requests").innerHTML = `<tr><th>request</th><th>state</th><th>prompt</th><th>cached</th><th>output</th>
    <th>queued ms</th><th>chunks</th><th>TTFT ms</th><th>ITL ms</th><th>total ms</th><th>finish</th>
    <th class="text">timeline</th></tr>${rows.join("")}`;
}

function drawSteps(steps) {
  const shown = steps.slice(0, 30);
  const longest = Math.max(0.001, ...shown.map((s) => s.duration_ms));
  const rows = shown.map((s) => `<tr><td>${s.step}</td><td>${new Date(s.time * 1000).toLocaleTimeString()}</td>
    <td>${s.prefill_requests} / ${s.prefill_tokens}</td><td>${s.decode_requests} / ${s.decode_tokens}</td>
    <td>${s.generated_tokens}</td><td>${s.preempted || ""}</td><td>${s.running} / ${s.waiting}</td>
    <td>${pct(s.kv_usage)}</td><td>${fmt(s.duration_ms, 2)}</td>
    <td class="text"><div class="bar" style="width:${((100 * s.duration_ms) / longest).toFixed(1)}%"></div></td></tr>`);
  $("steps").innerHTML = `<tr><th>step</th><th>time</th><th>prefill req / tokens</th><th>decode req / tokens</th>
    <th>generated</th><th>preempted</th><th>running / waiting</th><th>KV</th><th>step ms</th>
    <th class="text" style="width:12rem">step time</th></tr>${rows.join("")}`;
}

// The paths of the largest prefixes, as an indented tree (parents before children).
function drawRadix(radix) {
  if (!radix.enabled) {
    $("radix-summary").textContent = "prefix caching is off (--no-enable-prefix-caching)";
    $("radix").innerHTML = "";
    return;
  }
  $("radix-summary").textContent = `${radix.cached_blocks} cached blocks of ${radix.block_size} tokens, ` +
    `${radix.evictable_blocks} evictable (unused), ${radix.num_nodes} nodes, ${radix.num_leaves} leaves`;
  const children = new Map();
  for (const node of radix.nodes) {
    if (!children.has(node.parent)) children.set(node.parent, []);
    children.get(node.parent).push(node);
  }
  const rows = [];
  const walk = (parent, depth) => {
    for (const node of (children.get(parent) || []).sort((a, b) => b.prefix_tokens - a.prefix_tokens)) {
      const label = node.parent === null ? `(root${node.salt ? ": " + node.salt : ""})` : JSON.stringify(node.preview);
      rows.push(`<tr><td class="text" style="padding-left:${0.4 + depth * 1.1}rem">${escapeHtml(label)}</td>
        <td>${node.tokens}</td><td>${node.prefix_tokens}</td><td>${node.blocks}</td><td>${node.references}</td>
        <td>${fmt(node.age_s, 1)}</td><td>${node.children}</td></tr>`);
      walk(node.id, depth + 1);
    }
  };
  walk(null, 0);
  $("radix").innerHTML = `<tr><th class="text">edge (first tokens)</th><th>tokens</th><th>prefix tokens</th>
    <th>blocks</th><th>references</th><th>age s</th><th>children</th></tr>${rows.join("")}`;
}

function update(snapshot) {
  if (snapshot.error) throw new Error(snapshot.error.message);
  $("status").textContent = `${snapshot.model}: updated ${new Date(snapshot.engine.time * 1000).toLocaleTimeString()}`;
  drawCards(snapshot.engine);
  drawCharts(snapshot.engine.series);
  drawRequests(snapshot.requests.requests);
  drawSteps(snapshot.steps.steps);
  drawRadix(snapshot.radix);
}

async function loadModels() {
  const response = await api("/v1/models");
  if (!response.ok) return;
  const select = $("model");
  select.innerHTML = "";
  for (const model of (await response.json()).data) select.add(new Option(model.id, model.id));
}

async function connect() {
  if (stream) stream.abort();
  stream = new AbortController();
  const model = $("model").value;
  const query = `interval=0.25${model ? "&model=" + encodeURIComponent(model) : ""}`;
  try {
    const response = await api(`/v1/debug/stream?${query}`, { signal: stream.signal });
    if (response.status === 401 || response.status === 403) {
      await askForKey(await errorText(response));
      await loadModels();
      return connect();
    }
    if (!response.ok) throw new Error(await errorText(response));
    $("error").hidden = true;
    await readEvents(response, update);
    $("status").textContent = "the server ended the stream";
  } catch (e) {
    if (e.name === "AbortError") return;
    $("error").textContent = e.message;
    $("error").hidden = false;
    $("status").textContent = "disconnected; retrying…";
    setTimeout(connect, 2000);
  }
}

$("model").addEventListener("change", connect);
$("change-key").addEventListener("click", async () => {
  forgetKey();
  await askForKey("Enter a key (leave empty for a server without one).");
  loadModels().then(connect);
});
loadModels().then(connect);
