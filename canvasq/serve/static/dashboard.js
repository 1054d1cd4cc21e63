// The run dashboard: polls the Batch API with the tab's key and draws SVG charts. No build step.
const $ = (sel) => document.querySelector(sel);
const SVG = "http://www.w3.org/2000/svg";
let key = sessionStorage.getItem("canvasq_key") || "";
let selected = null; // batch id
let traceFor = null; // custom_id whose trace is drawn

async function api(path) {
  const r = await fetch(path, { headers: { Authorization: `Bearer ${key}` } });
  const body = await r.json();
  if (!r.ok) throw new Error(`${r.status}: ${body.error ? body.error.message : r.statusText}`);
  return body;
}

function el(tag, attrs = {}, text) {
  const e = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

const fmt = (x, d = 1) => (x === null || x === undefined ? "-" : Number(x).toFixed(d));
const when = (ts) => (ts ? new Date(ts * 1000).toLocaleTimeString() : "-");

// One chart: series = [{name, points: [[x, y], ...]}]; axes from 0 to the largest x and y.
function plot(svg, series, xlabel) {
  svg.replaceChildren();
  const W = 640, H = 240, L = 48, R = 12, T = 12, B = 32;
  const all = series.flatMap((s) => s.points);
  const xmax = Math.max(1, ...all.map((p) => p[0]));
  const ymax = Math.max(1, ...all.map((p) => p[1]));
  const sx = (x) => L + (x / xmax) * (W - L - R);
  const sy = (y) => H - B - (y / ymax) * (H - T - B);
  svg.append(el("svg:line", { class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B }));
  svg.append(el("svg:line", { class: "axis", x1: L, y1: T, x2: L, y2: H - B }));
  svg.append(el("svg:text", { x: L - 4, y: T + 8, "text-anchor": "end" }, fmt(ymax, ymax < 10 ? 1 : 0)));
  svg.append(el("svg:text", { x: L - 4, y: H - B, "text-anchor": "end" }, "0"));
  svg.append(el("svg:text", { x: W - R, y: H - 8, "text-anchor": "end" }, `${fmt(xmax, 0)} ${xlabel}`));
  series.forEach((s, i) => {
    const pts = s.points.map((p) => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" ");
    svg.append(el("svg:polyline", { class: `series-${s.name}`, points: pts, "data-n": s.points.length }));
    svg.append(el("svg:text", { x: L + 8 + i * 90, y: T + 10, class: `series-${s.name}` }, s.name));
  });
}

function renderBatches(list) {
  const body = $("#batches tbody");
  body.replaceChildren();
  for (const b of list.data) {
    const c = b.request_counts || { total: 0, completed: 0, failed: 0 };
    const p = (b.canvasq && b.canvasq.progress) || {};
    const done = c.completed + c.failed;
    const tr = el("tr", { "data-id": b.id });
    if (b.id === selected) tr.classList.add("selected");
    const bar = el("span", { class: "bar" });
    bar.append(el("span", { style: `width:${c.total ? (100 * done) / c.total : 0}%` }));
    const prog = el("td", { class: "progress" });
    prog.append(bar, document.createTextNode(`${done}/${c.total}`));
    tr.append(el("td", {}, b.id), el("td", { class: `status status-${b.status}` }, b.status), prog,
      el("td", {}, p.completion_tokens ?? "-"), el("td", {}, fmt(p.tok_s)),
      el("td", {}, p.eta_s ? `${fmt(p.eta_s, 0)} s` : "-"), el("td", {}, c.failed), el("td", {}, when(b.created_at)));
    tr.addEventListener("click", () => { selected = b.id; traceFor = null; refresh(); });
    body.append(tr);
  }
}

async function renderDetail() {
  $("#detail").hidden = !selected;
  if (!selected) return;
  const d = await api(`/v1/dashboard/batches/${selected}`);
  $("#detail-title").textContent = `${selected}${d.run_id ? ` (run ${d.run_id})` : ""}`;
  plot($("#tokps"), [{ name: "tok_s", points: d.throughput.map((p) => [p.t, p.tok_s]) }], "s");
  $("#errors tbody").replaceChildren(...d.errors.map((e) => {
    const tr = el("tr", { "data-code": e.code });
    tr.append(el("td", {}, e.code), el("td", {}, e.count), el("td", {}, e.example || ""));
    return tr;
  }));
  const sel = $("#cid");
  const have = [...sel.options].map((o) => o.value).join("\n");
  if (have !== d.custom_ids.join("\n")) {
    sel.replaceChildren(...d.custom_ids.map((c) => el("option", { value: c }, c)));
    if (traceFor && d.custom_ids.includes(traceFor)) sel.value = traceFor;
  }
  const cid = sel.value;
  if (cid && cid !== traceFor) {
    const t = await api(`/v1/dashboard/batches/${selected}/trace/${encodeURIComponent(cid)}`);
    const dec = t.forwards.filter((f) => f.kind === "decode");
    plot($("#trace"), [
      { name: "rows", points: dec.map((f, i) => [i, f.rows]) },
      { name: "commits", points: dec.map((f, i) => [i, f.commits]) },
    ], "forwards");
    traceFor = cid;
  }
}

async function refresh() {
  if (!key) { $("#status").textContent = "enter an API key"; return; }
  try {
    renderBatches(await api("/v1/batches?limit=50"));
    await renderDetail();
    $("#status").textContent = `updated ${new Date().toLocaleTimeString()}`;
    $("#status").className = "";
  } catch (err) {
    $("#status").textContent = String(err.message || err);
    $("#status").className = "error";
  }
}

$("#key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  key = $("#key").value.trim();
  sessionStorage.setItem("canvasq_key", key);
  refresh();
});
$("#cid").addEventListener("change", () => { traceFor = null; renderDetail(); });
refresh();
setInterval(refresh, 2000);
