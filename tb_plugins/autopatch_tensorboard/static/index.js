// The autopatch tab: what mode auto measured and chose, autotune trials (sortable), score by trial
// with the best marked, the frozen config, the per-step time breakdown for each fusion mode, and
// where each step's time went over the run (stacked, window by window).
// Self-contained: no network.

const CSS = `
  body { font-family: Roboto, sans-serif; font-size: 14px; margin: 16px; color: #212121; }
  h2 { font-size: 16px; margin: 20px 0 8px; }
  .message { background: #fff8e1; border: 1px solid #ffe082; padding: 8px 12px; margin: 8px 0; }
  .frozen { background: #e8f5e9; border: 1px solid #a5d6a7; padding: 8px 12px; }
  table { border-collapse: collapse; }
  th, td { padding: 4px 10px; border-bottom: 1px solid #e0e0e0; text-align: right; }
  th { cursor: pointer; user-select: none; background: #fafafa; }
  th.sorted::after { content: attr(data-dir); margin-left: 4px; }
  tr.best td, tr.chosen td { background: #e8f5e9; font-weight: bold; }
  tr.failed td { color: #c62828; }
  td.mode { text-align: left; }
  .legend span { display: inline-block; margin-right: 12px; }
  .note { color: #616161; font-size: 12px; max-width: 760px; margin: 6px 0; }
  .swatch { display: inline-block; width: 10px; height: 10px; margin-right: 4px; }
  svg text { font-size: 11px; fill: #424242; }
`;
const COLORS = { data: "#8d6e63", forward: "#42a5f5", backward: "#7e57c2", optimizer: "#ef6c00", comm: "#26a69a",
                 autopatch: "#ec407a", other: "#bdbdbd", compute: "#5c6bc0" };
const SHORT = { data: "data", forward: "fwd", backward: "bwd", optimizer: "opt", comm: "comm", autopatch: "ap",
                other: "other", compute: "compute" };
const breakdownText = (b) => b ? Object.entries(b).filter(([p]) => p !== "step")
  .map(([p, ms]) => `${SHORT[p] || p} ${fmt(ms)}`).join(" \u00b7 ") : "";

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  for (const c of children) e.append(c);
  return e;
}

function svg(tag, attrs = {}) {
  const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  return e;
}

const fmt = (v) => (typeof v === "number" && !Number.isInteger(v) ? v.toFixed(3).replace(/\.?0+$/, "") : String(v));
const configText = (c) => Object.entries(c).map(([k, v]) => `${k}=${fmt(v)}`).join(", ");

async function getJSON(url) {
  const r = await fetch(url);
  return r.json();
}

function frozenSection(data) {
  const f = data.frozen;
  if (!f) return null;
  const gain = f.improvement == null ? "" : f.trial === 0 ? ", the starting config was the best" :
    `, ${(100 * f.improvement).toFixed(1)}% over the starting config`;
  const how = f.resumed ? `resumed from ${f.resumed}` : `trial ${f.trial}, ${fmt(f.score)} ${f.unit}${gain}`;
  const box = el("div", { class: "frozen", id: "frozen" }, `Frozen config: ${configText(f.config)} (${how})`);
  if (f.best_json) box.append(el("div", {}, `saved to ${f.best_json}`));
  return box;
}

function autoSection(data) {
  const box = el("div", { id: "auto" });
  for (const a of data.auto) {
    const head = a.ms_per_step
      ? `${a.optimizer}, step ${a.step}: chose ${a.chosen}, ${a.speedup_vs_off.toFixed(2)}x unpatched ` +
        `(${a.rounds} rounds of ${a.window_steps} timed steps, ${a.clock}` +
        (a.noise != null ? `, noise ${(100 * a.noise).toFixed(1)}%` : "") + ")"
      : `${a.optimizer}, step ${a.step}: chose ${a.chosen}: ${a.why}`;
    box.append(el("div", { class: "frozen" }, head));
    if (a.ms_per_step) {
      const table = el("table", { class: "auto-modes" },
        el("thead", {}, el("tr", {}, ...["mode", "ms/step", "vs unpatched", "steps run", "left the race"]
          .map((c) => el("th", {}, c)))));
      const body = el("tbody");
      for (const [mode, ms] of Object.entries(a.ms_per_step)) {
        const ratio = a.ratio_vs_off[mode];
        const left = (a.dropped || {})[mode];
        body.append(el("tr", mode === a.chosen ? { class: "chosen" } : {},
          el("td", { class: "mode" }, mode === "off" ? "off (unpatched)" : mode), el("td", {}, fmt(ms)),
          el("td", {}, ratio == null ? "" : `${fmt(ratio)}x`), el("td", { class: "ran" }, `${(a.ran || {})[mode] ?? ""}`),
          el("td", { class: "left" }, left ? `step ${left.step}: ${left.why}` : mode === a.chosen ? "chosen" : "")));
      }
      table.append(body);
      box.append(table);
    }
    for (const [mode, why] of Object.entries(a.ruled_out || {})) box.append(el("div", {}, `not ${mode}: ${why}`));
    box.append(el("div", {}, `${a.measure_steps} steps (${fmt(a.measure_seconds)} s) spent measuring in ` +
      `${a.measurements.length} measurement(s), each at most ${a.measure_steps_limit} steps`));
  }
  return box;
}

function scoreChart(data) {
  const trials = data.trials.filter((t) => t.score != null);
  const W = 560, H = 220, pad = 40;
  const s = svg("svg", { width: W, height: H, id: "score-chart" });
  const max = Math.max(...trials.map((t) => t.score)) * 1.1;
  const x = (i) => pad + (trials.length === 1 ? 0 : (i * (W - 2 * pad)) / (trials.length - 1));
  const y = (v) => H - pad + 10 - (v / max) * (H - pad - 10);
  s.append(svg("line", { x1: pad, y1: y(0), x2: W - pad, y2: y(0), stroke: "#9e9e9e" }));
  const path = trials.map((t, i) => `${i ? "L" : "M"}${x(i)},${y(t.score)}`).join(" ");
  s.append(svg("path", { d: path, fill: "none", stroke: "#90a4ae" }));
  trials.forEach((t, i) => {
    const best = t.trial === data.best_trial;
    const dot = svg("circle", { cx: x(i), cy: y(t.score), r: best ? 7 : 4, fill: best ? "#2e7d32" : "#1e88e5" });
    const tip = svg("title");
    tip.textContent = `trial ${t.trial}: ${configText(t.config)} -> ${fmt(t.score)} ${data.unit}`;
    dot.append(tip);
    s.append(dot);
    const label = svg("text", { x: x(i), y: H - 12, "text-anchor": "middle" });
    label.textContent = t.trial;
    s.append(label);
    if (best) {
      const b = svg("text", { x: x(i), y: y(t.score) - 12, "text-anchor": "middle" });
      b.textContent = "best";
      s.append(b);
    }
  });
  const axis = svg("text", { x: 4, y: 12 });
  axis.textContent = `score (${data.unit}), max ${fmt(Math.max(...trials.map((t) => t.score)))}`;
  s.append(axis);
  return s;
}

function trialsTable(data) {
  const cols = ["trial", ...data.knobs, "score", "train_iter", "step ms", "breakdown ms"];
  const value = (t, c) => c === "step ms" ? t.step_ms : c === "score" && t.failed ? "failed"
    : c === "breakdown ms" ? breakdownText(t.breakdown_ms) : c in t ? t[c] : t.config[c];
  const table = el("table", { id: "trials" });
  const head = el("tr");
  const body = el("tbody");
  let sortCol = "trial", dir = 1;
  const fill = () => {
    const rows = [...data.trials].sort((a, b) => {
      const va = value(a, sortCol), vb = value(b, sortCol);
      return (va < vb ? -1 : va > vb ? 1 : 0) * dir;
    });
    body.replaceChildren(...rows.map((t) => el("tr",
      t.trial === data.best_trial ? { class: "best" } : t.failed ? { class: "failed", title: t.failed } : {},
      ...cols.map((c) => el("td", {}, value(t, c) == null ? "" : fmt(value(t, c)))))));
    for (const th of head.children) {
      th.classList.toggle("sorted", th.dataset.col === sortCol);
      th.dataset.dir = dir > 0 ? "\u25B2" : "\u25BC";
    }
  };
  for (const c of cols) {
    const th = el("th", { "data-col": c }, c);
    th.addEventListener("click", () => {
      dir = sortCol === c ? -dir : c === "score" ? -1 : 1;
      sortCol = c;
      fill();
    });
    head.append(th);
  }
  table.append(el("thead", {}, head), body);
  fill();
  return table;
}

function breakdownChart(data) {
  const modes = Object.entries(data.breakdown);
  const W = 560, rowH = 28, left = 110;
  const box = el("div", { id: "breakdown" });
  const s = svg("svg", { width: W, height: rowH * modes.length + 10 });
  const max = Math.max(...modes.map(([, b]) => b.step_ms));
  modes.forEach(([mode, b], i) => {
    const label = svg("text", { x: 0, y: i * rowH + 18 });
    label.textContent = mode;
    s.append(label);
    let x = left;
    for (const [part, ms] of Object.entries(b.parts_ms)) {
      const w = (ms / max) * (W - left - 90);
      const r = svg("rect", { x, y: i * rowH + 4, width: Math.max(0, w), height: rowH - 8, fill: COLORS[part] || "#9e9e9e" });
      const tip = svg("title");
      tip.textContent = `${mode} ${part}: ${fmt(ms)} ms`;
      r.append(tip);
      s.append(r);
      x += w;
    }
    const total = svg("text", { x: x + 6, y: i * rowH + 18 });
    total.textContent = `${fmt(b.step_ms)} ms/step`;
    s.append(total);
  });
  box.append(s, legend([...new Set(modes.flatMap(([, b]) => Object.keys(b.parts_ms)))]));
  return box;
}

function legend(parts) {
  return el("div", { class: "legend" }, ...parts.map((p) =>
    el("span", {}, el("span", { class: "swatch", style: `background:${COLORS[p] || "#9e9e9e"}` }), p)));
}

function timelineChart(data) {
  const points = data.timeline;
  const W = 760, H = 220, left = 50, bottom = 20;
  const total = (p) => Object.values(p.parts_ms).reduce((a, b) => a + b, 0);
  const max = Math.max(...points.map(total)) || 1;
  const bar = (W - left) / points.length;
  const box = el("div", { id: "timeline" });
  const s = svg("svg", { width: W, height: H });
  points.forEach((p, i) => {
    let y = H - bottom;
    for (const [part, ms] of Object.entries(p.parts_ms)) {
      const h = (ms / max) * (H - bottom - 10);
      y -= h;
      const r = svg("rect", { x: left + i * bar, y, width: Math.max(1, bar - 1), height: Math.max(0, h),
                              fill: COLORS[part] || "#9e9e9e" });
      const tip = svg("title");
      tip.textContent = `iteration ${p.iteration}${p.mode ? ` (${p.mode})` : ""}: ${part} ${fmt(ms)} ms`;
      r.append(tip);
      s.append(r);
    }
  });
  const axis = svg("text", { x: 0, y: 12 });
  axis.textContent = `${fmt(max)} ms`;
  const end = svg("text", { x: W - 4, y: H - 4, "text-anchor": "end" });
  end.textContent = `iteration ${points[points.length - 1].iteration}`;
  s.append(axis, end);
  box.append(s, legend([...new Set(points.flatMap((p) => Object.keys(p.parts_ms)))]));
  return box;
}

async function showRun(root, run) {
  const data = await getJSON(`run?run=${encodeURIComponent(run)}`);
  const parts = [];
  if (data.message) parts.push(el("div", { class: "message" }, data.message));
  if (data.auto.length) parts.push(el("h2", {}, "Mode auto: whole training step by mode (median ms)"), autoSection(data));
  const frozen = frozenSection(data);
  if (frozen) parts.push(frozen);
  if (data.trials.some((t) => t.score != null)) parts.push(el("h2", {}, "Score by trial"), scoreChart(data));
  if (data.trials.length) {
    parts.push(el("h2", {}, `Trials (${data.trials.length}), click a column to sort`), trialsTable(data));
    parts.push(el("p", { class: "note", id: "trials-note" },
      "score: the median throughput of the trial's windows. From trial 1 on, those windows alternate " +
      "with the best config so far, and the score is scaled by how that config ran alongside against " +
      "its own score, so that load from other jobs cancels out and scores compare across trials. " +
      "step ms: the time per step that score stands for, corrected alike. breakdown ms: where the " +
      "trial's steps went, as measured (data wait, forward, backward, optimizer, communication wait, " +
      "autopatch's own work, other)."));
  }
  if (data.timeline.length) {
    parts.push(el("h2", {}, "Where each step's time went (ms per step, window by window)"), timelineChart(data));
  }
  if (Object.keys(data.breakdown).length) {
    parts.push(el("h2", {}, "Time per step by mode (median ms)"), breakdownChart(data));
    parts.push(el("p", { class: "note" }, "Step times as measured, under whatever load each window " +
      "ran: the median over every window spent in the mode, trials and the rest of the run alike."));
  }
  root.replaceChildren(...parts);
}

export async function render() {
  document.head.append(el("style", {}, CSS));
  const header = el("div");
  const root = el("div", { id: "run" });
  document.body.append(header, root);
  const listing = await getJSON("runs");
  if (!listing.runs.length) {
    header.append(el("div", { class: "message", id: "empty" }, listing.message));
    return;
  }
  const select = el("select", { id: "run-select" }, ...listing.runs.map((r) => el("option", { value: r }, r === "." ? "(log dir)" : r)));
  select.addEventListener("change", () => showRun(root, select.value));
  header.append(el("label", {}, "Run: ", select));
  await showRun(root, listing.runs[0]);
}
