// The map: the chunks' poses seen from above (x right, y up), in the newest pose's frame, with
// the robot's path, the timeline's colours and the last answer's evidence; hover for a chunk's
// time and picture, click to set the question's window around it.
"use strict";
const MAP_W = 400, MAP_H = 300, MAP_PAD = 22;
// One tile of the memory image (deltas_ros/runtime/image.py: THUMB_W, THUMB_H + LABEL_H, GAP).
const TILE_W = 64, TILE_H = 48 + 30, TILE_GAP = 2;

function yaw(p) {
  return Math.atan2(2 * (p.qw * p.qz + p.qx * p.qy), 1 - 2 * (p.qy * p.qy + p.qz * p.qz));
}

// 1, 2 or 5 times a power of ten, near `raw`.
function niceStep(raw) {
  const unit = Math.pow(10, Math.floor(Math.log10(raw)));
  return unit * ([1, 2, 5, 10].find((m) => m * unit >= raw) || 10);
}

// The posed chunks in the newest pose's frame, and every frame seen.
function posedChunks() {
  const posed = chunks.filter((c) => c.pose);
  if (!posed.length) return {frame: null, frames: [], points: [], posed: 0};
  const frame = posed[posed.length - 1].pose.frame_id;
  const frames = [...new Set(posed.map((c) => c.pose.frame_id))];
  return {frame, frames, points: posed.filter((c) => c.pose.frame_id === frame),
          posed: posed.length};
}

function mapNote(text, empty) {
  const note = document.getElementById("map-note");
  note.textContent = text;
  note.className = empty ? "empty" : "";
}

let mapDrawn = "";  // what the map shows now: redrawn only when it changes (not per report)

function drawMap() {
  const last = chunks[chunks.length - 1];
  const shows = JSON.stringify([chunks.length, last && last.stream_time, heldStamp, newestHeld,
                                held.size, evidence, recalled, chosenWindow()]);
  if (shows === mapDrawn) return;
  mapDrawn = shows;
  const svg = document.getElementById("map");
  svg.replaceChildren();
  const {frame, frames, points, posed} = posedChunks();
  if (!chunks.length) return mapNote("No chunks yet: the map shows where each was seen.", true);
  if (!points.length) return mapNote("No poses: none of the chunks carries one. The memory " +
    "node has no pose_topic, or no pose came within pose_max_gap_s of a chunk's stamp.", true);
  mapNote(frames.length > 1 ? `Poses in ${frames.length} frames (${frames.join(", ")}): ` +
    `showing the newest frame's, ${frame} (${points.length} of ${posed} posed chunks).` :
    `Frame ${frame}: ${points.length} of ${chunks.length} chunks have a pose.`, false);
  const alone = evidencePoses.filter((e) => e.pose && e.pose.frame_id === frame &&
    !points.some((c) => Math.abs(c.stream_time - e.t) < 0.5));
  const xs = points.map((c) => c.pose.x).concat(alone.map((e) => e.pose.x));
  const ys = points.map((c) => c.pose.y).concat(alone.map((e) => e.pose.y));
  const cx = (Math.min(...xs) + Math.max(...xs)) / 2, cy = (Math.min(...ys) + Math.max(...ys)) / 2;
  const s = Math.min((MAP_W - 2 * MAP_PAD) / Math.max(Math.max(...xs) - Math.min(...xs), 0.5),
                     (MAP_H - 2 * MAP_PAD) / Math.max(Math.max(...ys) - Math.min(...ys), 0.5));
  const X = (x) => MAP_W / 2 + (x - cx) * s, Y = (y) => MAP_H / 2 - (y - cy) * s;
  const step = niceStep(70 / s);
  for (let g = Math.ceil((cx - MAP_W / 2 / s) / step) * step; X(g) < MAP_W; g += step)
    svg.appendChild(el("line", {x1: X(g), x2: X(g), y1: 0, y2: MAP_H, class: "grid"}));
  for (let g = Math.ceil((cy - MAP_H / 2 / s) / step) * step; Y(g) > 0; g += step)
    svg.appendChild(el("line", {x1: 0, x2: MAP_W, y1: Y(g), y2: Y(g), class: "grid"}));
  svg.appendChild(el("line", {x1: 10, x2: 10 + step * s, y1: MAP_H - 8, y2: MAP_H - 8,
                              class: "scale"}));
  const label = el("text", {x: 14 + step * s, y: MAP_H - 4});
  label.textContent = `${+step.toPrecision(2)} m`;
  svg.appendChild(label);
  svg.appendChild(el("polyline", {class: "path", points: points.map(
    (c) => `${X(c.pose.x)},${Y(c.pose.y)}`).join(" ")}));
  const now = points[points.length - 1].pose, a = yaw(now);
  const tri = [[17, 0], [-7, 8], [-7, -8]].map(([u, v]) => [
    X(now.x) + u * Math.cos(a) - v * Math.sin(a), Y(now.y) - u * Math.sin(a) - v * Math.cos(a)]);
  svg.appendChild(el("polygon", {points: tri.join(" "), class: "robot"}));
  const [since, until] = chosenWindow();
  const order = {evicted: 0, host: 0, disk: 0, "": 1, odd: 1, recent: 1, recalled: 2,
                 evidence: 2};
  const placed = points.map((c) => ({c, ...placeOf(c)}))
    .sort((p, r) => order[p.kind] - order[r.kind]);
  for (const {c, kind, place} of placed) {
    const inWindow = (since || until) && c.stream_time >= since &&
      (!until || c.stream_time <= until);
    const cls = ["pt", place ? "held" : "", kind, inWindow ? "inwin" : ""].filter(Boolean);
    svg.appendChild(el("circle", {cx: X(c.pose.x), cy: Y(c.pose.y),
                                  r: order[kind] ? 5.5 : 3, class: cls.join(" "),
                                  "data-t": c.stream_time}));
  }
  for (const e of alone)  // evidence the dashboard has no chunk for (it joined later)
    svg.appendChild(el("rect", {x: X(e.pose.x) - 5, y: Y(e.pose.y) - 5, width: 10, height: 10,
                                class: "pt evidence", "data-t": e.t}));
}

// The chunk's tile cut out of the memory image, or why there is none: the strip shows only
// held chunks, and which tile is which is known when it has one per held chunk and was drawn
// after the same chunk as the held list (their stamps).
function thumbnail(place, gone) {
  const img = document.getElementById("strip");
  if (!place) return {why: gone ? "evicted: the memory image shows held chunks only"
                                : "not in the memory (yet)"};
  if (stripStamp === null || !img.complete || !img.naturalWidth)
    return {why: "no memory image yet"};
  if (stripStamp !== heldStamp) return {why: "the memory image is being updated"};
  const tiles = Math.round((img.naturalWidth - TILE_GAP) / (TILE_W + TILE_GAP));
  if (tiles !== held.size)
    return {why: `the memory image shows ${tiles} of the ${held.size} held chunks ` +
                 "(memory_image_thumbnails): which tile is this one is not known"};
  const canvas = document.createElement("canvas");
  canvas.width = TILE_W * 2; canvas.height = TILE_H * 2;
  canvas.getContext("2d").drawImage(img, TILE_GAP + place.tile * (TILE_W + TILE_GAP), 0,
                                    TILE_W, TILE_H, 0, 0, canvas.width, canvas.height);
  return {canvas};
}

function line(text, cls) {
  const div = document.createElement("div");
  div.textContent = text;
  if (cls) div.className = cls;
  return div;
}

function showTip(target, event) {
  const tip = document.getElementById("maptip"), t = parseFloat(target.dataset.t);
  const c = chunks.find((k) => k.stream_time === t);
  tip.replaceChildren();
  if (!c) {
    tip.append(line(`t=${t.toFixed(2)} s: evidence`),
               line("no picture: the dashboard did not see this chunk arrive", "why"));
  } else {
    const {place, gone, where} = placeOf(c), pic = thumbnail(place, gone), p = c.pose;
    tip.append(pic.canvas || line("no picture: " + pic.why, "why"),
               line(`t=${t.toFixed(2)} s, chunk ${c.index}, drift ${c.drift.toFixed(4)}`),
               line(where || `${c.chunk_tokens} tokens`),
               line(`x=${p.x.toFixed(2)} y=${p.y.toFixed(2)} yaw=` +
                    `${(yaw(p) * 180 / Math.PI).toFixed(0)}° in ${p.frame_id}`));
  }
  tip.style.display = "block";  // beside the pointer, on the side with room for it
  const right = event.clientX + 14 + tip.offsetWidth < window.innerWidth;
  const below = event.clientY + 14 + tip.offsetHeight < window.innerHeight;
  tip.style.left = Math.max(right ? event.clientX + 14 : event.clientX - 14 - tip.offsetWidth,
                            0) + "px";
  tip.style.top = Math.max(below ? event.clientY + 14 : event.clientY - 14 - tip.offsetHeight,
                           0) + "px";
}

const map = document.getElementById("map");
map.addEventListener("mouseover", (e) => {
  const target = e.target.closest(".pt");
  if (target) showTip(target, e);
  else document.getElementById("maptip").style.display = "none";
});
map.addEventListener("mouseleave", () => {
  document.getElementById("maptip").style.display = "none";
});
map.addEventListener("click", (e) => {
  const target = e.target.closest(".pt");
  if (target) { const t = parseFloat(target.dataset.t); setWindow(t, t); }
});
