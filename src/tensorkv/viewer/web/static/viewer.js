// tensorkv viewer: the pages of `tensorkv view`. Plain DOM and uPlot, no framework.
// Every text that comes from the store is set with textContent (never parsed as HTML), so
// names and values are shown as text and never run as markup.
"use strict";

const main = document.getElementById("main");
const crumbs = document.getElementById("crumbs");
const errorBox = document.getElementById("error");
// The uPlot instances of the page (the browser test and screenshots look at them).
window.tkvPlots = [];
let renderSeq = 0;

// --- helpers ------------------------------------------------------------------------------
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "text") node.textContent = v;
    else if (k === "cls") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function link(text, hash) {
  return el("a", { href: hash, text: text });
}

function route(...parts) {
  return "#/" + parts.map((p) => encodeURIComponent(String(p))).join("/");
}

function withQuery(hash, params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== "" && v != null) q.set(k, v);
  const s = q.toString();
  return s ? hash + "?" + s : hash;
}

async function api(path, params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params || {})) if (v !== "" && v != null) q.set(k, v);
  const resp = await fetch("/api/" + path + (q.toString() ? "?" + q : ""),
                           { headers: { Accept: "application/json" } });
  let body;
  try { body = await resp.json(); } catch (e) { body = { error: resp.statusText }; }
  if (!resp.ok) throw new Error(body.error || ("HTTP " + resp.status));
  return body;
}

function fmt(x, digits) {
  if (x === null || x === undefined) return "–";
  if (typeof x === "string") return x;
  if (!Number.isFinite(x)) return String(x);
  if (Number.isInteger(x)) return x.toLocaleString("en-US");
  return x.toPrecision(digits || 4);
}

function bytes(n) {
  if (n == null) return "–";
  const u = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < u.length - 1) { n /= 1000; i++; }
  return (i ? n.toFixed(1) : n) + " " + u[i];
}

function when(t) {
  return t == null ? "–" : new Date(t * 1000).toISOString().replace("T", " ").slice(0, 19);
}

function showError(err) {
  errorBox.hidden = !err;
  errorBox.textContent = err ? String(err.message || err) : "";
}

function setCrumbs(...items) {
  crumbs.replaceChildren(...items.flatMap((it, i) => (i ? [" / ", it] : [it])));
}

function table(head, rows, leftCols) {
  const left = new Set(leftCols || [0]);
  return el("table", {},
    el("thead", {}, el("tr", {}, head.map((h, i) => el("th", { cls: left.has(i) ? "l" : "", text: h })))),
    el("tbody", {}, rows.map((r) => el("tr", {}, r.map((c, i) =>
      el("td", { cls: left.has(i) ? "l" : "" }, c instanceof Node ? c : fmt(c)))))));
}

// --- plots (uPlot) --------------------------------------------------------------------------
function addPlot(opts, data, target) {
  const u = new uPlot(opts, data, target);
  window.tkvPlots.push(u);
  return u;
}

// Bars of a histogram; log: a log-scaled count axis (for heavy tails such as frequency).
function histogram(target, title, hist, xlabel, log) {
  const centers = hist.edges.slice(0, -1).map((e, i) => (e + hist.edges[i + 1]) / 2);
  if (!centers.length) { target.append(el("p", { cls: "muted", text: title + ": no rows" })); return; }
  const bars = uPlot.paths.bars({ size: [0.95, Infinity] });
  const counts = log ? hist.counts.map((c) => (c > 0 ? c : null)) : hist.counts;
  addPlot({
    title: title, width: 380, height: 220,
    scales: { x: { time: false }, y: log ? { distr: 3 } : {} },
    legend: { show: false },
    axes: [{ label: xlabel }, { label: log ? "rows (log)" : "rows" }],
    series: [{ label: xlabel }, { label: "rows", fill: "rgba(37,99,235,0.45)",
                                  stroke: "#2563eb", paths: bars, points: { show: false } }],
  }, [centers, counts], target);
}

function scatter(target, title, pts, onPick) {
  const order = pts.x.map((_, i) => i).sort((a, b) => pts.x[a] - pts.x[b]);
  const xs = order.map((i) => pts.x[i]);
  const ys = order.map((i) => pts.y[i]);
  const keys = order.map((i) => pts.key[i]);
  addPlot({
    title: title, width: 420, height: 300,
    scales: { x: { time: false } },
    axes: [{ label: "PC 1" }, { label: "PC 2" }],
    cursor: { drag: { x: true, y: true, uni: 50 } },
    legend: { show: true },
    series: [{ label: "PC 1", value: (u, v, s, idx) => (idx == null ? "–" : fmt(v)) },
             { label: "PC 2", stroke: "#2563eb", paths: () => null,
               points: { show: true, size: 4, fill: "rgba(37,99,235,0.6)", stroke: "#2563eb" } }],
    hooks: { setCursor: [(u) => { pickIndex = u.cursor.idx; }] },
  }, [xs, ys], target);
  let pickIndex = null;
  target.addEventListener("dblclick", () => { if (pickIndex != null) onPick(keys[pickIndex]); });
}

function vectorPlot(target, values) {
  const xs = values.map((_, i) => i);
  addPlot({
    title: "value by dimension", width: 560, height: 200,
    scales: { x: { time: false, range: [-0.5, values.length - 0.5] } },
    axes: [{ label: "dimension" }, {}],
    series: [{ label: "dim" }, { label: "value", stroke: "#2563eb", fill: "rgba(37,99,235,0.4)",
                                  paths: uPlot.paths.bars({ size: [0.9, Infinity] }) }],
  }, [xs, values.map((v) => (typeof v === "number" ? v : NaN))], target);
}

// A colour map from dark blue through teal to yellow (value scaled to 0..1).
function colour(t) {
  const stops = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  if (!(t >= 0)) t = 0;
  if (t > 1) t = 1;
  const x = t * (stops.length - 1);
  const i = Math.min(Math.floor(x), stops.length - 2);
  const f = x - i;
  return stops[i].map((c, j) => Math.round(c + f * (stops[i + 1][j] - c)));
}

function heatmap(canvas, values, lo, hi) {
  const rows = values.length, cols = rows ? values[0].length : 0;
  const cell = Math.max(1, Math.min(12, Math.floor(640 / Math.max(cols, rows, 1))));
  canvas.width = Math.max(1, cols * cell);
  canvas.height = Math.max(1, rows * cell);
  const ctx = canvas.getContext("2d");
  const img = ctx.createImageData(canvas.width, canvas.height);
  const span = hi > lo ? hi - lo : 1;
  for (let r = 0; r < rows; r++) {
    for (let c = 0; c < cols; c++) {
      const v = values[r][c];
      const rgb = typeof v !== "number" ? [255, 0, 255] : colour((v - lo) / span);
      for (let dy = 0; dy < cell; dy++) {
        let p = ((r * cell + dy) * canvas.width + c * cell) * 4;
        for (let dx = 0; dx < cell; dx++, p += 4) {
          img.data[p] = rgb[0]; img.data[p + 1] = rgb[1]; img.data[p + 2] = rgb[2];
          img.data[p + 3] = 255;
        }
      }
    }
  }
  ctx.putImageData(img, 0, 0);
  return cell;
}

function legendBar(lo, hi) {
  const c = el("canvas", { width: 160, height: 12, cls: "heat" });
  const ctx = c.getContext("2d");
  for (let x = 0; x < 160; x++) {
    const [r, g, b] = colour(x / 159);
    ctx.fillStyle = `rgb(${r},${g},${b})`;
    ctx.fillRect(x, 0, 1, 12);
  }
  return el("div", { cls: "legend" }, fmt(lo), c, fmt(hi));
}

// --- pages ----------------------------------------------------------------------------------
async function pageTags() {
  setCrumbs(el("span", { text: "tags" }));
  const { tags } = await api("tags");
  if (!tags.length) return [el("p", { text: "This store holds no tags." })];
  return [
    el("h2", { text: "Tags" }),
    table(["tag", "step", "created (UTC)", "parent", "dense", "tables", "bytes", "table rows", ""],
      tags.map((t, i) => [link(t.tag, route("tag", t.tag)), t.step, when(t.created),
                          t.parent ?? "–", t.dense, t.tables, bytes(t.bytes ?? t.dense_bytes),
                          t.table_rows,
                          i ? link("diff with " + (t.parent || tags[i - 1].tag),
                                   route("diff", t.parent || tags[i - 1].tag, t.tag)) : ""]),
      [0, 3, 8]),
  ];
}

async function pageTag(tag) {
  const info = await api("variables", { tag });
  setCrumbs(link("tags", "#/"), el("span", { text: info.tag }));
  return [
    el("h2", { text: "Variables of " + info.tag }),
    table(["variable", "kind", "dtype", "shape / rows", "bytes"],
      info.variables.map((v) => [
        link(v.name, route(v.kind === "table" ? "table" : "dense", info.tag, v.name)),
        v.kind, v.dtype, v.kind === "table" ? fmt(v.rows) + " rows × " + v.dim : "[" + v.shape.join(", ") + "]",
        bytes(v.bytes)]), [0, 1, 2]),
  ];
}

// Rows come as columns (key, freq, version, norm, head, more, and maybe score).
function rowsTable(tag, name, cols, extra) {
  const head = ["key", "freq", "version", "norm", ...(extra ? [extra] : []), "value (first dims)"];
  const rows = cols.key.map((key, i) => [
    link(key, route("row", tag, name, key)), cols.freq[i], cols.version[i], cols.norm[i],
    ...(extra ? [cols.score[i]] : []),
    el("span", { cls: "vec", text: cols.head[i].map((v) => fmt(v, 3)).join("  ") + (cols.more ? "  …" : "") })]);
  const t = table(head, rows, [0, head.length - 1]);
  t.id = "rows";
  return t;
}

async function pageTable(tag, name, q) {
  setCrumbs(link("tags", "#/"), link(tag, route("tag", tag)), el("span", { text: name }));
  const here = route("table", tag, name);
  const go = (params) => { location.hash = withQuery(here, params); };
  const keysIn = el("input", { type: "text", id: "key-search", placeholder: "keys: 12, 7 or 100..200",
                               value: q.get("keys") || "" });
  const whereIn = el("input", { type: "text", cls: "wide", id: "where", value: q.get("where") || "",
                                placeholder: "freq >= 10 and norm < 0.1" });
  const nearIn = el("input", { type: "text", id: "nearest-key", placeholder: "key, or a vector 0.1, -0.2, …",
                               value: q.get("nearest") || "" });
  const kIn = el("input", { type: "number", id: "nearest-k", value: q.get("k") || "10", min: 1, max: 1000, style: "width:5em" });
  const metricIn = el("select", { id: "metric" }, ["cosine", "l2", "dot"].map((m) =>
    el("option", { value: m, selected: (q.get("metric") || "cosine") === m, text: m })));
  const bar = el("div", { cls: "toolbar" },
    el("form", { id: "search-form", onsubmit: (e) => { e.preventDefault(); go({ keys: keysIn.value.trim() }); } },
       "Key search ", keysIn, " ", el("button", { type: "submit", text: "Search" })),
    el("form", { id: "where-form", onsubmit: (e) => { e.preventDefault(); go({ where: whereIn.value.trim() }); } },
       "Filter ", whereIn, " ", el("button", { type: "submit", text: "Filter" })),
    el("form", { id: "nearest-form", onsubmit: (e) => { e.preventDefault();
                   go({ nearest: nearIn.value.trim(), k: kIn.value, metric: metricIn.value }); } },
       "Nearest to ", nearIn, " k ", kIn, " ", metricIn, " ", el("button", { type: "submit", text: "Find" })),
    q.toString() ? link("clear", here) : null);
  const results = el("div", { id: "results" });
  const plots = el("div", { id: "plots" });
  // a search's results come first; the plain table opens on its statistics
  const asked = q.get("keys") || q.get("nearest") || q.get("where");
  const stat = [el("h3", { text: "Statistics" }), plots];
  const found = [el("h3", { text: asked ? "Results" : "Rows" }), results];
  const out = [el("h2", { text: name }), bar, ...(asked ? [...found, ...stat] : [...stat, ...found])];

  const fill = async () => {
    if (q.get("keys")) {
      const r = await api("search", { tag, var: name, keys: q.get("keys") });
      const said = r.asked === null
        ? `${r.rows.key.length} rows with a key in ${r.keys}` +
          (r.complete ? "" : " (the first ones found; narrow the range to see the others)")
        : `${r.rows.key.length} of ${r.asked} keys found` +
          (r.missing.length ? "; missing: " + r.missing.slice(0, 20).join(", ") : "");
      results.append(el("p", { cls: "muted", text: said }), rowsTable(tag, name, r.rows));
    } else if (q.get("nearest")) {
      const near = q.get("nearest").trim();  // a key, or a vector: "0.1, -0.2, ..."
      const r = await api("nearest", { tag, var: name, [/[,\s]/.test(near) ? "vector" : "key"]: near,
                                       k: q.get("k"), metric: q.get("metric") });
      results.append(el("p", { cls: "muted", text: `${r.rows.key.length} nearest rows by ${r.metric} ` +
                                `(${fmt(r.scanned)} rows scanned)` }),
                     rowsTable(tag, name, r.rows, r.metric === "l2" ? "distance" : "score"));
    } else {
      const offset = Number(q.get("offset") || 0);
      const cursor = q.get("cursor") || "";
      const where = q.get("where") || "";
      const r = await api("rows", { tag, var: name, offset, cursor, where, limit: 50 });
      const prev = where ? (cursor ? "back" : null)
        : (r.prev != null ? withQuery(here, { offset: r.prev }) : null);
      const next = where ? (r.next_cursor != null ? withQuery(here, { where, cursor: r.next_cursor }) : null)
        : (r.next != null ? withQuery(here, { offset: r.next }) : null);
      const pager = el("div", { cls: "pager" },
        prev ? el("a", { href: "#", text: "‹ previous", onclick: (e) => { e.preventDefault();
          if (where) history.back(); else location.hash = prev; } }) : "",
        el("span", { id: "page-info", text: where
          ? `${r.rows.key.length} matching rows from scan position ${fmt(r.cursor)}` +
            (r.note ? " (" + r.note + ")" : "")
          : `rows ${fmt(r.offset + 1)}–${fmt(r.offset + r.rows.key.length)} of ${fmt(r.total)}` }),
        next ? link("next ›", next) : "");
      results.append(pager, rowsTable(tag, name, r.rows));
    }
  };
  const stats = async () => {
    const s = await api("stats", { tag, var: name });
    plots.append(table(["rows", "NaN values", "Inf values", "never updated", "dim"],
                       [[s.count, s.nan, s.inf, s.never_updated, s.dim]]));
    const h1 = el("div", { cls: "panel", id: "hist-norm" });
    const h2 = el("div", { cls: "panel", id: "hist-freq" });
    plots.append(h1, h2);
    histogram(h1, "norm", s.norm_hist, "L2 norm");
    histogram(h2, "frequency", s.freq_hist, "frequency", true);
    const p = el("div", { cls: "panel", id: "pca" });
    plots.append(p);
    const pca = await api("pca", { tag, var: name });
    scatter(p, `PCA of ${fmt(pca.sampled)} sampled rows (explained ${pca.explained.map((e) =>
      (100 * e).toFixed(1) + "%").join(", ")})`, pca.points,
      (key) => { location.hash = route("row", tag, name, key); });
  };
  return { nodes: out, after: () => Promise.all([fill(), stats()]) };
}

async function pageRow(tag, name, key) {
  setCrumbs(link("tags", "#/"), link(tag, route("tag", tag)), link(name, route("table", tag, name)),
            el("span", { text: "key " + key }));
  const r = await api("row", { tag, var: name, key });
  const plot = el("div", { id: "vector-plot" });
  const slots = Object.entries(r.slots || {});
  return {
    nodes: [
      el("h2", { text: `${name}[${r.key}]` }),
      table(["key", "frequency", "version", "norm", "dim"], [[r.key, r.freq, r.version, r.norm, r.value.length]]),
      plot,
      el("h3", { text: "value" }),
      el("div", { cls: "vec", id: "row-value", text: r.value.map((v) => fmt(v, 6)).join("  ") }),
      ...slots.flatMap(([s, v]) => [el("h3", { text: "optimizer slot " + s }),
                                    el("div", { cls: "vec", text: v.map((x) => fmt(x, 6)).join("  ") })]),
      el("p", {}, link("nearest neighbours of this row",
                       withQuery(route("table", tag, name), { nearest: r.key, k: 10, metric: "cosine" }))),
    ],
    after: () => vectorPlot(plot, r.value),
  };
}

async function pageDense(tag, name, q) {
  setCrumbs(link("tags", "#/"), link(tag, route("tag", tag)), el("span", { text: name }));
  const here = route("dense", tag, name);
  const sliceIn = el("input", { type: "text", id: "slice", value: q.get("slice") || "",
                                placeholder: "0:64, :" });
  const r = await api("slice", { tag, var: name, slice: q.get("slice") || "" });
  const canvas = el("canvas", { id: "heatmap", cls: "heat" });
  const readout = el("span", { id: "heat-value", cls: "muted" });
  return {
    nodes: [
      el("h2", { text: name }),
      el("p", { text: `${r.dtype} [${r.shape.join(", ")}]; showing [${r.slice}] → ` +
                      `[${r.shown.join(", ")}]` }),
      r.note ? el("p", { cls: "note", text: r.note }) : null,
      el("form", { cls: "toolbar", id: "slice-form",
                   onsubmit: (e) => { e.preventDefault(); location.hash = withQuery(here, { slice: sliceIn.value.trim() }); } },
         "Slice ", sliceIn, " ", el("button", { type: "submit", text: "Show" })),
      el("div", { cls: "legend" }, legendBar(r.min, r.max), readout),
      canvas,
    ],
    after: () => {
      const cell = heatmap(canvas, r.values, r.min, r.max);
      canvas.addEventListener("mousemove", (e) => {
        const i = Math.floor(e.offsetY / cell), j = Math.floor(e.offsetX / cell);
        const v = r.values[i] && r.values[i][j];
        readout.textContent = v === undefined ? "" : `[${i}, ${j}] of the slice = ${fmt(v, 6)}`;
      });
    },
  };
}

async function pageDiff(a, b, q) {
  setCrumbs(link("tags", "#/"), el("span", { text: "diff" }));
  const { tags } = await api("tags");
  const names = tags.map((t) => t.tag);
  const pick = (id, v) => el("select", { id }, names.map((n) => el("option", { value: n, selected: n === v, text: n })));
  const aIn = pick("diff-a", a || names[Math.max(0, names.length - 2)]);
  const bIn = pick("diff-b", b || names[names.length - 1]);
  const form = el("form", { cls: "toolbar", id: "diff-form",
    onsubmit: (e) => { e.preventDefault(); location.hash = route("diff", aIn.value, bIn.value); } },
    "From ", aIn, " to ", bIn, " ", el("button", { type: "submit", text: "Compare" }));
  const nodes = [el("h2", { text: "Diff of two tags" }), form];
  if (!a || !b) return nodes;
  const d = await api("diff", { a, b, var: q.get("var") || "" });
  nodes.push(el("h3", { text: `${d.a} → ${d.b}` }));
  nodes.push(table(["variable", "change", "kind", "keys added", "keys removed", "keys changed", "max change"],
    d.variables.map((v) => [v.name, v.status, v.kind, v.added ?? "–", v.removed ?? "–",
                            v.changed ?? "–", v.max_change ?? "–"]), [0, 1, 2]));
  for (const v of d.variables.filter((x) => x.largest && x.largest.length)) {
    nodes.push(el("h3", { text: "largest changes in " + v.name }),
      table(["key", "change (L2)"], v.largest.map((c) => [
        link(c.key, route("row", d.b, v.name, c.key)), c.change])));
  }
  return nodes;
}

// --- router ---------------------------------------------------------------------------------
async function render() {
  const seq = ++renderSeq;
  for (const u of window.tkvPlots) u.destroy();
  window.tkvPlots = [];
  showError(null);
  const raw = location.hash.replace(/^#\/?/, "");
  const [path, query] = raw.split("?");
  const q = new URLSearchParams(query || "");
  const parts = (path || "").split("/").filter(Boolean).map(decodeURIComponent);
  document.body.dataset.ready = "";
  try {
    let page;
    if (!parts.length) page = await pageTags();
    else if (parts[0] === "tag") page = await pageTag(parts[1]);
    else if (parts[0] === "table") page = await pageTable(parts[1], parts[2], q);
    else if (parts[0] === "row") page = await pageRow(parts[1], parts[2], parts[3]);
    else if (parts[0] === "dense") page = await pageDense(parts[1], parts[2], q);
    else if (parts[0] === "diff") page = await pageDiff(parts[1], parts[2], q);
    else throw new Error("no such page: " + raw);
    if (seq !== renderSeq) return;
    const nodes = Array.isArray(page) ? page : page.nodes;
    main.replaceChildren(...nodes.filter(Boolean));
    if (page.after) await page.after();
  } catch (err) {
    if (seq !== renderSeq) return;
    showError(err);
  }
  if (seq === renderSeq) document.body.dataset.ready = "1";
}

(async () => {
  try {
    const info = await api("info");
    document.getElementById("store").textContent = info.url;
  } catch (err) { showError(err); }
  window.addEventListener("hashchange", render);
  render();
})();
