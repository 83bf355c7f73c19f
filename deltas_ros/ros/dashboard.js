// The dashboard page's state, timeline, memory image, events and questions (the map and the
// health tiles are in dashboard_map.js and dashboard_health.js; the server inlines all three).
"use strict";
const token = new URLSearchParams(location.search).get("token");
const q = (path) => token ? path + "?token=" + encodeURIComponent(token) : path;
const NS = "http://www.w3.org/2000/svg";
let chunks = [], evidence = [], evidencePoses = [], recalled = [], health = {}, healthAt = 0;
// stream time (ms) -> {tokens, bucket, tile} of each held chunk, from ~/memory_chunks
let held = new Map(), newestHeld = -Infinity, heldStamp = null;
// stream time (ms) -> {tokens, tier} of each chunk in the second tier ("host" or "disk")
let tiered = new Map();
const key = (t) => Math.round(t * 1000);
let span = [0, 1], drag = null;  // the drawn time span; the drag's first stream time
let stripStamp = null, imageAsked = 0, imageShown = 0;  // the memory image's chunk stamp

function el(tag, attrs) {
  const e = document.createElementNS(NS, tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  return e;
}

function budget() {
  const v = (health.values || {});
  for (const k of ["budget", "kv_budget", "budget_tokens", "max_kv_tokens"])
    if (v[k] !== undefined && !isNaN(parseFloat(v[k]))) return parseFloat(v[k]);
  return null;
}

// Where a chunk is: its colour class (as the timeline and the map draw it), its place in the
// memory (undefined when not held), whether it was evicted, and where its tokens wait in the
// second tier (an evicted chunk takes its tier's colour; a thinned one keeps its bucket's).
function placeOf(c) {
  const near = (t) => Math.abs(t - c.stream_time) < 0.5;
  const hit = evidence.some(near), back = recalled.some(near);
  const place = held.get(key(c.stream_time)), tier = tiered.get(key(c.stream_time));
  const gone = !place && c.stream_time < newestHeld;
  const kind = hit ? "evidence" : back ? "recalled" : gone ? (tier ? tier.tier : "evicted") :
    !place ? "" : place.bucket < 0 ? "recent" : place.bucket % 2 ? "odd" : "";
  const gpu = gone ? "evicted" : !place ? "" : (place.bucket < 0 ? "recent window" :
    `bucket ${place.bucket}`) + `, ${place.tokens} tokens held`;
  const away = !tier ? "" :
    `${tier.tokens} tokens ${tier.tier === "disk" ? "on disk" : "in host memory"}`;
  const where = [gpu, away, back ? "recalled by the last question" : ""]
    .filter(Boolean).join("; ");
  return {kind, place, gone, where};
}

function draw() {
  drawMap();
  const svg = document.getElementById("timeline");
  svg.replaceChildren();
  if (!chunks.length) return;
  const t0 = chunks[0].stream_time, t1 = Math.max(chunks[chunks.length - 1].stream_time, t0 + 1);
  span = [t0, t1];
  const x = (t) => 10 + 980 * (t - t0) / (t1 - t0);
  const [since, until] = chosenWindow();
  if (since || until) {
    const a = x(Math.max(since || t0, t0)), b = x(Math.min(until || t1, t1));
    if (b >= a) svg.appendChild(el("rect", {x: a, y: 0, width: Math.max(b - a, 2), height: 175,
                                            class: "window"}));
  }
  const dmax = Math.max(...chunks.map((c) => c.drift), 1e-9);
  const b = budget();
  const kmax = Math.max(b || 0, ...chunks.map((c) => c.kv_tokens), 1);
  const w = Math.min(40, Math.max(2, 960 / chunks.length));
  for (const c of chunks) {
    const h = 120 * c.drift / dmax;
    const {kind, where} = placeOf(c);
    const r = el("rect", {x: x(c.stream_time) - w / 2, y: 150 - h, width: w * 0.8,
                          height: h, class: ("bar " + kind).trim(), "data-index": c.index});
    const tip = el("title", {});
    const pose = c.pose ? `; pose in ${c.pose.frame_id}: x=${c.pose.x.toFixed(2)} ` +
      `y=${c.pose.y.toFixed(2)} z=${c.pose.z.toFixed(2)}` : "";
    tip.textContent = `chunk ${c.index} t=${c.stream_time.toFixed(1)} s drift=` +
      `${c.drift.toFixed(4)} kv=${c.kv_tokens} evicted=${c.evicted_tokens}` +
      (where ? `; ${where}` : "") + pose;
    r.appendChild(tip);
    svg.appendChild(r);
    if (c.evicted_tokens > 0)
      svg.appendChild(el("line", {x1: x(c.stream_time), x2: x(c.stream_time), y1: 150, y2: 170,
                                  class: "evict"}));
  }
  const pts = chunks.map((c) => `${x(c.stream_time)},${150 - 140 * c.kv_tokens / kmax}`);
  svg.appendChild(el("polyline", {points: pts.join(" "), class: "kv"}));
  if (b) svg.appendChild(el("line", {x1: 10, x2: 990, y1: 150 - 140 * b / kmax,
                                     y2: 150 - 140 * b / kmax, class: "budget"}));
}

function chosenWindow() {
  return ["since", "until"].map((id) => parseFloat(document.getElementById(id).value) || 0);
}

function timeAt(event) {
  const box = document.getElementById("timeline").getBoundingClientRect();
  const px = 1000 * (event.clientX - box.left) / box.width;
  return span[0] + (span[1] - span[0]) * Math.min(Math.max((px - 10) / 980, 0), 1);
}

function setWindow(a, b) {
  // Widened to whole tenths, so a chunk at an edge stays inside; 0 leaves a side open.
  document.getElementById("since").value = Math.max(Math.floor(Math.min(a, b) * 10) / 10, 0);
  document.getElementById("until").value = Math.ceil(Math.max(a, b) * 10) / 10;
  draw();
}

function nearestChunk(t) {
  return chunks.reduce((best, c) => Math.abs(c.stream_time - t) <
                       Math.abs(best.stream_time - t) ? c : best).stream_time;
}

// The strip, fetched with its stamp (X-Memory-Stamp): the chunk after which it was drawn.
async function refreshImage() {
  const asked = ++imageAsked;
  const response = await fetch(q("/memory.jpg"), {cache: "no-store"});
  if (!response.ok) return;
  const blob = await response.blob();
  if (asked < imageShown) return;  // a newer one is shown already
  imageShown = asked;
  const img = document.getElementById("strip"), old = img.src;
  img.src = URL.createObjectURL(blob);
  stripStamp = parseFloat(response.headers.get("X-Memory-Stamp"));
  if (old.startsWith("blob:")) URL.revokeObjectURL(old);
}

function setHeld(h) {
  const times = h.stream_time || [];
  held = new Map(times.map((t, k) => [key(t), {tokens: h.tokens[k], bucket: h.bucket[k],
                                               tile: k}]));
  newestHeld = times.length ? times[times.length - 1] : -Infinity;
  heldStamp = h.stamp === undefined ? null : h.stamp;
  const away = h.tiered_time || [];
  tiered = new Map(away.map((t, k) => [key(t), {tokens: h.tiered_tokens[k],
                                                tier: h.tiered_tier[k]}]));
}

function setHealth(h) {
  health = h || {};
  healthAt = Date.now();
  showHealth();
}

function apply(state) {
  chunks = state.chunks;
  setHeld(state.held || {});
  setHealth(state.health);
  if (state.image) refreshImage();
  draw();
}

const events = new EventSource(q("/events"));
events.addEventListener("state", (e) => apply(JSON.parse(e.data)));
events.addEventListener("chunk", (e) => {
  chunks.push(JSON.parse(e.data));
  if (chunks.length > 600) chunks.shift();
  draw();
});
events.addEventListener("health", (e) => { setHealth(JSON.parse(e.data)); draw(); });
events.addEventListener("image", refreshImage);
events.addEventListener("held", (e) => { setHeld(JSON.parse(e.data)); draw(); showHealth(); });
setInterval(showHealth, 1000);  // the tiles age: a node gone silent turns its tile red

async function ask() {
  const answer = document.getElementById("answer");
  const ev = document.getElementById("evidence"), back = document.getElementById("recalled");
  answer.textContent = "…"; ev.textContent = ""; back.textContent = "";
  evidence = []; evidencePoses = []; recalled = []; draw();
  const question = document.getElementById("question").value;
  const response = await post("/ask", {question, window: chosenWindow()});
  if (!response.ok) { answer.textContent = (await response.json()).error; return; }
  const reader = response.body.getReader(), dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const {done, value} = await reader.read();
    if (done) break;
    buf += dec.decode(value, {stream: true});
    let i;
    while ((i = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, i); buf = buf.slice(i + 2);
      const kind = (block.match(/^event: (.*)$/m) || [])[1];
      const data = JSON.parse((block.match(/^data: (.*)$/m) || [, "null"])[1]);
      if (kind === "feedback") answer.textContent = data.answer;
      if (kind === "feedback" || kind === "result") back.textContent = recalledText(data);
      if (kind === "result") {
        answer.textContent = data.success ? data.answer : "failed: " + data.message;
        evidence = data.evidence_times || [];
        evidencePoses = evidence.map((t, k) => ({t, pose: (data.evidence_poses || [])[k]}));
        ev.textContent = evidence.length ? "evidence at " +
          evidence.map((t) => t.toFixed(1) + " s").join(", ") : "";
        ev.className = evidence.length ? "has-evidence" : "";
        recalled = data.recalled_times || [];
        draw();
      }
    }
  }
}
// What a question called back from the second tier: the counts (known before its first
// token), and the chunks' times once answered.
function recalledText(data) {
  if (!data.recalled_chunks) return "";
  const n = data.recalled_chunks;
  const times = (data.recalled_times || []).map((t) => t.toFixed(1) + " s").join(", ");
  return `recalled ${n} chunk${n === 1 ? "" : "s"} from the second tier ` +
    `(${data.recalled_from_disk} from disk)` + (times ? " at " + times : "");
}
const timeline = document.getElementById("timeline");
timeline.addEventListener("pointerdown", (e) => {
  if (!chunks.length) return;
  drag = {t: timeAt(e), x: e.clientX};
  timeline.setPointerCapture(e.pointerId);
});
timeline.addEventListener("pointermove", (e) => { if (drag) setWindow(drag.t, timeAt(e)); });
timeline.addEventListener("pointerup", (e) => {
  if (!drag) return;
  // A click (no drag) chooses the chunk under it.
  if (Math.abs(e.clientX - drag.x) < 3) { const t = nearestChunk(drag.t); setWindow(t, t); }
  else setWindow(drag.t, timeAt(e));
  drag = null;
});
for (const id of ["since", "until"]) document.getElementById(id).oninput = draw;
document.getElementById("clear").onclick = () => setWindow(0, 0);
document.getElementById("ask").onclick = ask;
// JSON bodies only: the server refuses the content types a foreign page may send unasked.
const post = (path, body) => fetch(q(path), {method: "POST",
  headers: {"Content-Type": "application/json"}, body: JSON.stringify(body)});
document.getElementById("cancel").onclick = () => post("/cancel", {});
