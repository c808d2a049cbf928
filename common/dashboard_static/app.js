// The live page: polls the monitor's /api/state and redraws. Every value from the swarm (peer names, metric
// names) is untrusted text: it goes into the page as textContent or escaped chart titles, never as markup.
"use strict";

const POLL_MS = 2000;
const STALE_SECONDS = 30; // no new snapshot for this long: say so instead of pretending the run is live
let xAxis = "step";
let latest = null;
let lastSuccess = null;

function escapeText(text) {
  return String(text).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
}

function formatNumber(value, digits) {
  if (value === null || value === undefined) return "\u2013";
  return Number(value).toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: 0 });
}

function formatDuration(seconds) {
  if (seconds === null || seconds === undefined) return "\u2013";
  const total = Math.round(seconds);
  const hours = Math.floor(total / 3600);
  const minutes = Math.floor((total % 3600) / 60);
  if (hours > 0) return `${hours} h ${String(minutes).padStart(2, "0")} min`;
  if (minutes > 0) return `${minutes} min ${String(total % 60).padStart(2, "0")} s`;
  return `${total} s`;
}

function wallTime(unixSeconds) {
  const date = new Date(unixSeconds * 1000);
  const pad = (number) => String(number).padStart(2, "0");
  return `${date.getFullYear()}-${pad(date.getMonth() + 1)}-${pad(date.getDate())} ` +
    `${pad(date.getHours())}:${pad(date.getMinutes())}:${pad(date.getSeconds())}`;
}

function formatShare(value) {
  if (value === null || value === undefined) return "\u2013";
  return `${(100 * value).toFixed(0)} %`;
}

function setText(id, text) {
  document.getElementById(id).textContent = text;
}

function chartSpecs(series) {
  const specs = [{ key: "loss", title: "loss", y: series.loss }];
  Object.keys(series.metrics).forEach((name, index) => {
    specs.push({ key: `metric-${index}`, title: name, y: series.metrics[name] });
  });
  specs.push({ key: "peers", title: "peers per global step", y: series.peers, shape: "hv" });
  specs.push({ key: "rate", title: "swarm samples/s", y: series.samples_per_second });
  if ((series.used_share || []).some((value) => value !== null)) {
    specs.push({ key: "used", title: "share of computed samples used", y: series.used_share });
    specs.push({ key: "computing", title: "share of time computing", y: series.compute_share });
  }
  return specs;
}

function drawCharts(series) {
  const container = document.getElementById("charts");
  const x = xAxis === "step" ? series.step : series.time.map(wallTime);
  const wanted = new Set();
  for (const spec of chartSpecs(series)) {
    const id = `chart-${spec.key}`;
    wanted.add(id);
    let div = document.getElementById(id);
    if (!div) {
      div = document.createElement("div");
      div.id = id;
      div.className = "chart";
      container.appendChild(div);
    }
    container.appendChild(div); // (re)placed in spec order: metrics that appear later still follow the loss
    div.dataset.title = spec.title;
    div.dataset.points = String(spec.y.filter((value) => value !== null).length);
    const trace = {
      x: x, y: spec.y, type: "scatter", mode: spec.y.length > 60 ? "lines" : "lines+markers",
      line: { shape: spec.shape || "linear", width: 2 }, connectgaps: false, name: escapeText(spec.title),
    };
    const layout = {
      title: { text: escapeText(spec.title), font: { size: 15 }, x: 0.02, xanchor: "left" },
      margin: { l: 60, r: 20, t: 40, b: 50 },
      xaxis: { title: { text: xAxis === "step" ? "global step" : "wall time" }, type: xAxis === "step" ? "linear" : "date" },
      yaxis: { rangemode: spec.key === "peers" || spec.key === "rate" ? "tozero" : "normal" },
      paper_bgcolor: "#fff", plot_bgcolor: "#fff",
    };
    Plotly.react(div, [trace], layout, { displayModeBar: false, responsive: true });
  }
  for (const div of Array.from(container.children)) {
    if (!wanted.has(div.id)) {
      Plotly.purge(div);
      div.remove();
    }
  }
}

function drawLeaderboard(rows, now) {
  const body = document.querySelector("#leaderboard tbody");
  body.replaceChildren();
  rows.forEach((row, index) => {
    const cells = [
      String(index + 1), row.peer, formatNumber(row.samples, 0), formatNumber(row.steps, 0),
      formatDuration(row.hours_online * 3600), formatShare(row.used_share), formatShare(row.compute_share),
      `${formatDuration(Math.max(0, now - row.last_seen))} ago`,
    ];
    const tr = document.createElement("tr");
    cells.forEach((text, column) => {
      const td = document.createElement("td");
      td.textContent = text;
      if (column !== 1) td.className = "number";
      tr.appendChild(td);
    });
    body.appendChild(tr);
  });
}

function render(state) {
  latest = state;
  setText("run-id", state.run_id ? `\u2014 ${state.run_id}` : "");
  document.title = state.run_id ? `${state.run_id}: collaborative training` : "Collaborative training";
  const step = state.global_step === null ? "\u2013" :
    `${formatNumber(state.global_step + 1, 0)} / ${formatNumber(state.max_global_steps, 0)}`;
  setText("global-step", step);
  setText("active-peers", formatNumber(state.active_peers, 0));
  setText("samples-per-second", formatNumber(state.samples_per_second, 1));
  setText("total-samples", formatNumber(state.total_samples, 0));
  setText("loss", formatNumber(state.loss, 4));
  setText("used-share", formatShare(state.used_share));
  setText("compute-share", formatShare(state.compute_share));
  const checkpoint = state.checkpoint;
  setText("checkpoint", checkpoint ? `step ${checkpoint.step}: ${checkpoint.file} (${wallTime(checkpoint.time)})` :
    (state.checkpoints_enabled ? "none yet" : "checkpoints off"));
  setText("join-command", state.join_command || "\u2013");
  drawCharts(state.series);
  drawLeaderboard(state.leaderboard, state.generated);
  const resumed = state.resumed_steps ? ` \u00b7 ${state.resumed_steps} steps resumed from an earlier monitor session` : "";
  setText("footer", `target batch ${formatNumber(state.target_batch_size, 0)} samples per global step \u00b7 ` +
    `monitor up since ${wallTime(state.monitor_started)}${resumed} \u00b7 updates every ${POLL_MS / 1000} s`);
}

function showStatus() {
  const status = document.getElementById("status");
  if (lastSuccess === null) return;
  const age = (Date.now() - lastSuccess) / 1000;
  status.className = age > STALE_SECONDS ? "status down" : "status";
  const since = latest && latest.global_step !== null ? ` \u00b7 last global step at ${wallTime(latest.series.time[latest.series.time.length - 1])}` : " \u00b7 waiting for the first global step";
  status.textContent = age > STALE_SECONDS ?
    `the monitor has not answered for ${formatDuration(age)} (stopped, or unreachable); retrying` :
    `live: updated ${formatDuration(age)} ago${since}`;
}

async function poll() {
  try {
    const response = await fetch("api/state", { cache: "no-store" });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    render(await response.json());
    lastSuccess = Date.now();
    document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
  } catch (error) {
    console.warn("dashboard poll failed:", error);
  } finally {
    showStatus();
    setTimeout(poll, POLL_MS);
  }
}

document.getElementById("x-axis").addEventListener("change", (event) => {
  xAxis = event.target.value;
  if (latest) drawCharts(latest.series);
});
document.getElementById("copy-join").addEventListener("click", () => {
  navigator.clipboard.writeText(document.getElementById("join-command").textContent);
});
poll();
