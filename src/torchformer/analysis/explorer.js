// torchformer attention explorer: the inline script of the page torchformer.analysis.to_html writes.
// Reads the JSON block #tf-data, draws a model view (layers x heads thumbnails) and a head view
// (queries left, keys right, lines weighted by attention; hover a token to see where it looks and
// what looks at it). No network, no libraries: DOM, canvas and textContent only (never innerHTML,
// so token text cannot inject markup).
"use strict";
(function () {
  const DATA = JSON.parse(document.getElementById("tf-data").textContent);
  const ROW = 18; // px per token in the head view
  // viridis anchors (matplotlib's default map), interpolated; weights go through sqrt as in the PNGs
  const VIRIDIS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];

  function colour(w) {
    const x = Math.sqrt(Math.min(1, Math.max(0, w))) * (VIRIDIS.length - 1);
    const i = Math.min(VIRIDIS.length - 2, Math.floor(x));
    const f = x - i;
    return VIRIDIS[i].map((c, k) => Math.round(c + f * (VIRIDIS[i + 1][k] - c)));
  }

  function decode(b64) {
    const bytes = Uint8Array.from(atob(b64), (ch) => ch.charCodeAt(0));
    const view = new DataView(bytes.buffer);
    const out = new Float32Array(bytes.length / 4);
    for (let i = 0; i < out.length; i++) out[i] = view.getFloat32(4 * i, true);
    return out;
  }

  function printable(t) {
    return t.replace(/\n/g, "\u21b5").replace(/\t/g, "\u2192").replace(/ /g, "\u2423");
  }

  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  // weights of group g, layer l: a (H, T, S) Float32Array, decoded once
  for (const g of DATA.groups) for (const layer of g.layers) layer.w = decode(layer.weights);

  // matrix (T, S) as an array of rows for head index hi, or the mean over heads when hi < 0
  function matrix(g, layer, hi) {
    const T = g.queries.length, S = g.keys.length, H = layer.heads.length;
    const rows = [];
    for (let i = 0; i < T; i++) {
      const row = new Array(S).fill(0);
      for (let h = 0; h < H; h++) {
        if (hi >= 0 && h !== hi) continue;
        const base = (h * T + i) * S;
        for (let j = 0; j < S; j++) row[j] += layer.w[base + j];
      }
      if (hi < 0) for (let j = 0; j < S; j++) row[j] /= H;
      rows.push(row);
    }
    return rows;
  }

  function paint(canvas, m) {
    const T = m.length, S = m[0].length;
    canvas.width = S;
    canvas.height = T;
    const ctx = canvas.getContext("2d");
    const img = ctx.createImageData(S, T);
    for (let i = 0; i < T; i++) {
      for (let j = 0; j < S; j++) {
        const [r, g, b] = colour(m[i][j]);
        const p = 4 * (i * S + j);
        img.data[p] = r; img.data[p + 1] = g; img.data[p + 2] = b; img.data[p + 3] = 255;
      }
    }
    ctx.putImageData(img, 0, 0);
  }

  const app = document.getElementById("tf-app");
  const state = { g: 0, l: 0, h: 0, m: null };
  app.append(el("h1", {}, DATA.title));
  app.append(el("p", { class: "tf-hint" },
    "Click a thumbnail to open that head. Hover a query token (left) to see where it looks, a key token " +
    "(right) to see what looks at it. Captions: mean entropy (nats) \u00b7 mean max weight \u00b7 mean distance " +
    "(tokens), as head_stats computes them."));
  const body = el("div", { class: "tf-body" });
  app.append(body);

  // ---- head view ----
  const hv = el("section", { id: "tf-head-view" });
  const controls = el("div", { class: "tf-controls" });
  const selGroup = el("select", { id: "tf-group", "aria-label": "attention" });
  const selLayer = el("select", { id: "tf-layer", "aria-label": "layer" });
  const selHead = el("select", { id: "tf-head", "aria-label": "head" });
  DATA.groups.forEach((g, gi) => selGroup.append(el("option", { value: gi }, g.title)));
  controls.append(selGroup, selLayer, selHead);
  const pair = el("div", { class: "tf-pair" });
  const qCol = el("div", { class: "tf-col tf-queries", id: "tf-queries" });
  const lines = el("canvas", { id: "tf-lines", width: 150 });
  const kCol = el("div", { class: "tf-col tf-keys", id: "tf-keys" });
  pair.append(qCol, lines, kCol);
  const big = el("canvas", { id: "tf-matrix", class: "tf-matrix" });
  const readout = el("p", { id: "tf-readout", class: "tf-readout" }, "\u00a0");
  hv.append(controls, el("h2", { id: "tf-head-title" }), pair, big, readout);

  function drawLines(only, side) {
    const m = state.m, T = m.length, S = m[0].length;
    lines.height = Math.max(T, S) * ROW;
    const ctx = lines.getContext("2d");
    ctx.clearRect(0, 0, lines.width, lines.height);
    ctx.strokeStyle = "rgb(30, 90, 200)";
    // All lines: opacity = weight (as bertviz). One token's lines: relative to their largest, so a
    // flat row over many keys still shows its shape.
    const shown = side === "q" ? m[only] : side === "k" ? m.map((row) => row[only]) : [1];
    const scale = 1 / Math.max(1e-12, ...shown);
    for (let i = 0; i < T; i++) {
      if (side === "q" && i !== only) continue;
      for (let j = 0; j < S; j++) {
        if (side === "k" && j !== only) continue;
        ctx.globalAlpha = Math.min(1, m[i][j] * scale);
        ctx.lineWidth = only === null ? 1 : 2;
        ctx.beginPath();
        ctx.moveTo(0, (i + 0.5) * ROW);
        ctx.lineTo(lines.width, (j + 0.5) * ROW);
        ctx.stroke();
      }
    }
    ctx.globalAlpha = 1;
  }

  function highlight(col, weights) {
    col.querySelectorAll(".tf-tok").forEach((node, n) => {
      if (weights === null) {
        node.removeAttribute("data-weight");
        node.style.backgroundColor = "";
        return;
      }
      node.setAttribute("data-weight", String(weights[n]));
      const [r, g, b] = colour(weights[n]);
      node.style.backgroundColor = `rgba(${r}, ${g}, ${b}, ${Math.sqrt(weights[n]).toFixed(3)})`;
    });
  }

  function hover(side, n) {
    const m = state.m;
    qCol.querySelectorAll(".tf-tok").forEach((x, i) => x.classList.toggle("tf-active", side === "q" && i === n));
    kCol.querySelectorAll(".tf-tok").forEach((x, j) => x.classList.toggle("tf-active", side === "k" && j === n));
    if (side === null) {
      highlight(qCol, null); highlight(kCol, null); drawLines(null, null);
      readout.textContent = "\u00a0";
      return;
    }
    const g = DATA.groups[state.g];
    if (side === "q") {
      highlight(kCol, m[n]); highlight(qCol, null);
      readout.textContent = `query ${n} "${printable(g.queries[n])}" looks at: ` + topk(m[n], g.keys);
    } else {
      const col = m.map((row) => row[n]);
      highlight(qCol, col); highlight(kCol, null);
      readout.textContent = `key ${n} "${printable(g.keys[n])}" is looked at by: ` + topk(col, g.queries);
    }
    drawLines(n, side);
  }

  function topk(weights, labels) {
    return weights.map((w, i) => [w, i]).sort((a, b) => b[0] - a[0]).slice(0, 3)
      .map(([w, i]) => `"${printable(labels[i])}" ${w.toFixed(3)}`).join(", ");
  }

  function tokens(col, labels, side) {
    col.replaceChildren();
    labels.forEach((t, n) => {
      const node = el("div", { class: "tf-tok", "data-index": n, title: JSON.stringify(t) }, printable(t) || "\u00a0");
      node.addEventListener("mouseenter", () => hover(side, n));
      col.append(node);
    });
  }
  qCol.addEventListener("mouseleave", () => hover(null, null));
  kCol.addEventListener("mouseleave", () => hover(null, null));

  function fillSelect(select, items, value) {
    select.replaceChildren(...items.map(([v, text]) => el("option", { value: v }, text)));
    select.value = String(value);
  }

  function show(g, l, h) {
    state.g = g; state.l = l; state.h = h;
    const group = DATA.groups[g], layer = group.layers[l];
    fillSelect(selGroup, DATA.groups.map((x, i) => [i, x.title]), g);
    fillSelect(selLayer, group.layers.map((x, i) => [i, `layer ${x.layer}`]), l);
    fillSelect(selHead, [...layer.heads.map((x, i) => [i, `head ${x}`]), [-1, "mean over heads"]], h);
    state.m = matrix(group, layer, h);
    hv.setAttribute("data-group", g); hv.setAttribute("data-layer", l); hv.setAttribute("data-head", h);
    const which = h < 0 ? "mean over heads" : `head ${layer.heads[h]}`;
    document.getElementById("tf-head-title").textContent = `${group.title}: ${layer.name}, ${which}`;
    tokens(qCol, group.queries, "q");
    tokens(kCol, group.keys, "k");
    paint(big, state.m);
    const cell = Math.max(2, Math.min(12, Math.floor(360 / Math.max(group.queries.length, group.keys.length))));
    big.style.width = `${group.keys.length * cell}px`;
    big.style.height = `${group.queries.length * cell}px`;
    drawLines(null, null);
    document.querySelectorAll(".tf-thumb").forEach((t) => {
      const on = +t.dataset.group === g && +t.dataset.layer === l && +t.dataset.head === h;
      t.classList.toggle("tf-selected", on);
      t.setAttribute("aria-pressed", on ? "true" : "false");
    });
  }

  selGroup.addEventListener("change", () => show(+selGroup.value, 0, 0));
  selLayer.addEventListener("change", () => show(state.g, +selLayer.value, state.h));
  selHead.addEventListener("change", () => show(state.g, state.l, +selHead.value));
  big.addEventListener("mousemove", (ev) => {
    const g = DATA.groups[state.g], r = big.getBoundingClientRect();
    const i = Math.floor(((ev.clientY - r.top) / r.height) * g.queries.length);
    const j = Math.floor(((ev.clientX - r.left) / r.width) * g.keys.length);
    if (i < 0 || j < 0 || i >= g.queries.length || j >= g.keys.length) return;
    readout.textContent = `query ${i} "${printable(g.queries[i])}" \u2192 key ${j} "${printable(g.keys[j])}": ` +
      state.m[i][j].toFixed(4);
  });

  // ---- model view ----
  const mv = el("section", { id: "tf-model-view" });
  DATA.groups.forEach((group, gi) => {
    mv.append(el("h2", {}, group.title));
    const grid = el("div", { class: "tf-grid", style: `grid-template-columns: repeat(${group.layers[0].heads.length}, auto)` });
    group.layers.forEach((layer, li) => {
      layer.heads.forEach((head, hi) => {
        const [ent, top, dist] = layer.stats[hi];
        const [e, m, d] = layer.exact[hi];
        const fig = el("figure", {
          class: "tf-thumb", role: "button", tabindex: 0, "aria-pressed": "false",
          "data-group": gi, "data-layer": li, "data-head": hi, "data-name": layer.name, "data-head-index": head,
        });
        const canvas = el("canvas", { class: "tf-thumb-canvas" });
        paint(canvas, matrix(group, layer, hi));
        const cap = el("figcaption");
        cap.append(el("b", {}, `L${layer.layer} H${head}`));
        cap.append(el("span", {
          class: "tf-stats", "data-entropy": String(e), "data-max-weight": String(m), "data-distance": String(d),
        }, `ent ${ent} \u00b7 max ${top}\ndist ${dist}`));
        fig.append(canvas, cap);
        fig.addEventListener("click", () => show(gi, li, hi));
        fig.addEventListener("keydown", (ev) => { if (ev.key === "Enter" || ev.key === " ") show(gi, li, hi); });
        grid.append(fig);
      });
    });
    mv.append(grid);
  });

  body.append(mv, hv);
  show(0, 0, 0);
  document.body.setAttribute("data-ready", "1");
})();
