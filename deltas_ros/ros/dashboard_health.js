// Health at a glance: a few tiles (OK, WARN or ERROR, each with its reason) from the node's
// /diagnostics, and every key-value in the folded table below them.
"use strict";
const LEVELS = ["ok", "warn", "error"];
const SILENT_S = 5;  // the node reports at 1 Hz: this long without a report is an error

function num(v, k) {
  const n = parseFloat((v || {})[k]);
  return isNaN(n) ? null : n;
}

// [name, level (0 OK, 1 WARN, 2 ERROR), reason] per tile.
function healthTiles(h, silentS, heldChunks) {
  const v = h.values || {};
  if (h.level === undefined)
    return [["Node", 1, "no diagnostics from the memory node yet"]];
  const node = silentS > SILENT_S ? [2, `no diagnostics for ${silentS.toFixed(0)} s`]
    : [Math.min(h.level, 2), (h.level === 3 ? "stale: " : "") + (h.message || "") +
       (v.lifecycle ? ` (${v.lifecycle})` : "")];
  const tiles = [["Node", ...node]];
  const publishers = num(v, "camera_publishers"), rate = num(v, "input_rate_hz");
  if (publishers === 0) tiles.push(["Camera", 1, "no camera publisher"]);
  else if (rate === null) tiles.push(["Camera", 1, "not reported (the model is not loaded)"]);
  else tiles.push(["Camera", rate > 0 ? 0 : 1, rate > 0 ? `${rate} frames/s` +
                   (publishers ? ` from ${publishers} publisher(s)` : "")
                   : "no frames now (0 frames/s)"]);
  const kv = num(v, "kv_tokens"), budget = num(v, "budget_tokens");
  const dropped = num(v, "chunks_dropped") || 0;
  if (kv === null || !budget) tiles.push(["Memory", 1, "not reported"]);
  else tiles.push(["Memory", kv > budget ? 2 : dropped ? 1 : 0,
    `${kv} of ${budget} tokens (${(100 * kv / budget).toFixed(0)} %), ${heldChunks} chunks ` +
    "held" + (dropped ? `; ${dropped} chunks dropped (model slower than real time)` : "")]);
  const answered = num(v, "questions_answered"), failed = num(v, "questions_failed") || 0;
  const refused = num(v, "questions_refused") || 0, waiting = num(v, "questions_waiting") || 0;
  if (answered === null) tiles.push(["Questions", 1, "not reported"]);
  else tiles.push(["Questions", failed ? 1 : 0, `${answered} answered` +
    (failed ? `, ${failed} failed` : "") + (refused ? `, ${refused} refused` : "") +
    (waiting ? `, ${waiting} waiting` : "")]);
  return tiles;
}

function showHealth() {
  const silent = healthAt ? (Date.now() - healthAt) / 1000 : 0;
  const box = document.getElementById("tiles");
  box.replaceChildren();
  for (const [name, level, why] of healthTiles(health, silent, held.size)) {
    const tile = document.createElement("div");
    tile.className = "tile " + LEVELS[level];
    tile.dataset.name = name;
    const head = document.createElement("div"), mark = document.createElement("span");
    head.textContent = name;
    mark.className = "level";
    mark.textContent = LEVELS[level].toUpperCase();
    head.appendChild(mark);
    const reason = document.createElement("div");
    reason.className = "why";
    reason.textContent = why;
    tile.append(head, reason);
    box.appendChild(tile);
  }
  document.getElementById("status").textContent =
    (health.message || "") + (health.level !== undefined ? ` (level ${health.level})` : "");
  const t = document.getElementById("health");
  t.replaceChildren();
  for (const [k, v] of Object.entries(health.values || {})) {
    const row = t.insertRow();
    row.insertCell().textContent = k;
    row.insertCell().textContent = v;
  }
}
