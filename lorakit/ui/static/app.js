// lorakit ui: the run list (refreshed every few seconds) and a run page fed by server-sent events.
"use strict";

const $ = (sel) => document.querySelector(sel);
let source = null;      // the open EventSource of a run page
let listTimer = null;   // the run list's refresh
let points = [];        // the run page's metrics rows
let current = null;     // the run page's summary, kept up to date by the stream

function esc(s) {
  return String(s ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}
function num(x, digits = 4) { return typeof x === "number" ? x.toFixed(digits) : "-"; }
function duration(s) {
  if (typeof s !== "number") return "-";
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = Math.round(s % 60);
  return h ? `${h}h${String(m).padStart(2, "0")}m` : `${m}m${String(sec).padStart(2, "0")}s`;
}
function fileUrl(rel) { return "/files/" + rel.split("/").map(encodeURIComponent).join("/"); }
function runUrl(name) { return name.split("/").map(encodeURIComponent).join("/"); }

async function getJSON(url) {
  const r = await fetch(url, { credentials: "same-origin" });
  if (r.status === 401) {  // opened without the link `lorakit ui` printed: say how to get in
    document.body.innerHTML = "<main><h1>lorakit ui</h1><p>This dashboard needs the secret made when it started: " +
      "open the link <code>lorakit ui</code> printed (<code>http://127.0.0.1:PORT/?token=…</code>).</p></main>";
    throw new Error(`${url}: 401`);
  }
  if (!r.ok) throw new Error(`${url}: ${r.status}`);
  return r.json();
}

async function showList() {
  const data = await getJSON("/api/runs");
  $("#root").textContent = data.root;
  const body = $("#runs tbody");
  body.innerHTML = data.runs.map((r) => `
    <tr data-run="${esc(r.name)}">
      <td><a href="#/run/${esc(r.name)}">${esc(r.name)}</a></td>
      <td><span class="status ${esc(r.status)}">${esc(r.status)}</span></td>
      <td>${esc(r.family)}</td><td>${r.step}${r.steps ? " / " + r.steps : ""}</td>
      <td>${num(r.loss)}</td><td>${num(r.s_per_step, 3)}</td><td>${duration(r.eta_s)}</td><td>${esc(r.updated)}</td>
    </tr>`).join("");
  $("#empty").hidden = data.runs.length > 0;
}

let phaseLines = [];     // the run page's phases.jsonl lines
let phaseTimer = null;  // ticks the open phase's seconds
let chartGeom = null;   // what the hover needs: the steps drawn and their scale
let zoom = null;        // {from, to}: the steps the chart shows (null: all); drag to set, double-click to reset
let dragFrom = null;

function smoothed(loss) {
  // the moving average the run's loss_curve.png draws (a twentieth of the run, at least one step)
  const k = Math.max(1, Math.floor(loss.length / 20));
  let acc = 0;
  return loss.map((p, i) => {
    acc += p.loss;
    if (i >= k) acc -= loss[i - k].loss;
    return { step: p.step, loss: acc / Math.min(i + 1, k) };
  });
}

function drawChart() {
  const c = $("#chart"), g = c.getContext("2d"), W = c.width, H = c.height, pad = 44;
  g.clearRect(0, 0, W, H);
  const shown = (p) => typeof p.step === "number" && (!zoom || (p.step >= zoom.from && p.step <= zoom.to));
  const loss = points.filter((p) => typeof p.loss === "number" && shown(p));
  const val = points.filter((p) => typeof p.val_loss === "number" && shown(p));
  $("#points").textContent = `${loss.length} steps` + (val.length ? `, ${val.length} validations` : "") +
    (zoom ? ` (steps ${zoom.from}-${zoom.to}; double-click: all)` : "");
  $(".legend .val").hidden = !points.some((p) => typeof p.val_loss === "number");  // only where the run measured one
  chartGeom = null;
  if (!loss.length && !val.length) return;
  const all = loss.map((p) => p.loss).concat(val.map((p) => p.val_loss));
  const steps = loss.map((p) => p.step).concat(val.map((p) => p.step));
  let lo = Math.min(...all), hi = Math.max(...all);
  if (hi === lo) { hi += 0.5; lo -= 0.5; }
  const s0 = Math.min(...steps), s1 = Math.max(...steps, s0 + 1);
  const x = (s) => pad + ((s - s0) / (s1 - s0)) * (W - 2 * pad);
  const y = (v) => H - pad + ((lo - v) / (hi - lo)) * (H - 2 * pad);
  g.strokeStyle = "#99a"; g.lineWidth = 1; g.beginPath();
  g.moveTo(pad, pad / 2); g.lineTo(pad, H - pad); g.lineTo(W - pad / 2, H - pad); g.stroke();
  g.fillStyle = "#556"; g.font = "12px sans-serif";
  g.fillText(hi.toFixed(3), 2, y(hi) + 4); g.fillText(lo.toFixed(3), 2, y(lo) + 4);
  g.fillText(`step ${s0}`, pad, H - pad + 16); g.fillText(`step ${s1}`, W - pad - 50, H - pad + 16);
  const line = (pts, color, width) => {
    g.strokeStyle = color; g.lineWidth = width; g.beginPath();
    pts.forEach((p, i) => (i ? g.lineTo(x(p.step), y(p.loss)) : g.moveTo(x(p.step), y(p.loss))));
    g.stroke();
  };
  const smooth = $("#smooth").checked ? smoothed(loss) : null;
  line(loss, smooth ? "#a9c6ee" : "#1f6fd1", smooth ? 1 : 1.5);
  if (smooth) line(smooth, "#1f6fd1", 2.5);
  g.fillStyle = "#e07b00";
  val.forEach((p) => { g.beginPath(); g.arc(x(p.step), y(p.val_loss), 3.5, 0, 2 * Math.PI); g.fill(); });
  chartGeom = { loss, smooth, val, s0, s1, pad, W };
}

function stepAt(e) {
  if (!chartGeom) return null;
  const c = $("#chart"), rect = c.getBoundingClientRect();
  const px = (e.clientX - rect.left) * (c.width / rect.width);
  const { s0, s1, pad, W } = chartGeom;
  return Math.round(s0 + ((px - pad) / (W - 2 * pad)) * (s1 - s0));
}

function zoomChart(e) {
  const to = stepAt(e);
  if (dragFrom !== null && to !== null && Math.abs(to - dragFrom) >= 2) {
    zoom = { from: Math.min(dragFrom, to), to: Math.max(dragFrom, to) };
    drawChart();
  }
  dragFrom = null;
}

function hoverChart(e) {
  // the step under the pointer: its loss (and the smoothed loss, and val_loss where measured there)
  if (!chartGeom || !chartGeom.loss.length) return;
  const c = $("#chart"), rect = c.getBoundingClientRect();
  const px = (e.clientX - rect.left) * (c.width / rect.width);
  const { loss, smooth, val, s0, s1, pad, W } = chartGeom;
  const step = s0 + ((px - pad) / (W - 2 * pad)) * (s1 - s0);
  let best = 0;
  loss.forEach((p, i) => { if (Math.abs(p.step - step) < Math.abs(loss[best].step - step)) best = i; });
  const p = loss[best], v = val.find((q) => q.step === p.step);
  $("#hover").textContent = `step ${p.step}: loss ${p.loss.toFixed(4)}` +
    (smooth ? `, smoothed ${smooth[best].loss.toFixed(4)}` : "") + (v ? `, val_loss ${v.val_loss.toFixed(4)}` : "");
}

function stepOf(path) {
  const m = /step-0*(\d+)\.png$/.exec(path);
  return m ? Number(m[1]) : null;
}

function showLatest(path) {
  $("#latest").innerHTML = path ? `<img src="${fileUrl(path)}" alt="${esc(path)}" data-sample="${esc(path)}">` : "<p>No sample grid yet.</p>";
  document.querySelectorAll("#gallery figure").forEach((f) => f.classList.toggle("shown", f.dataset.path === path));
}

function showSamples(list) {
  $("#samples").innerHTML = list.map((s) => `<li><a href="${fileUrl(s)}" target="_blank">${esc(s.split("/").pop())}</a></li>`).join("");
  const grids = list.filter((s) => stepOf(s) !== null);
  // every grid of the run, oldest first, each under its step: a click shows it large above
  $("#gallery").innerHTML = grids.map((s) => `<figure data-path="${esc(s)}"><img src="${fileUrl(s)}" alt="${esc(s)}" loading="lazy">
    <figcaption>step ${stepOf(s)}</figcaption></figure>`).join("");
  document.querySelectorAll("#gallery figure").forEach((f) => { f.onclick = () => showLatest(f.dataset.path); });
  showLatest(grids[grids.length - 1] || list.filter((s) => !s.endsWith("progress.png")).pop() || list[list.length - 1]);
}

function showPhases() {
  // the run's phases as they happened (phases.jsonl): each with its seconds and facts, the open one counting up;
  // a resumed run's lines under a row of their own; infos and warnings as the log below
  const rows = [], log = [];
  for (const l of phaseLines) {
    if (l.event === "run") rows.push({ run: l.time });
    else if (l.event === "start") rows.push({ name: l.name, start: l.time });
    else if (l.event === "end" || l.event === "failed") {
      const open = rows.filter((r) => r.name === l.name && r.end === undefined).pop();
      if (open) Object.assign(open, { end: l.time, seconds: l.seconds, facts: l.facts, failed: l.event === "failed" });
    } else if (l.event === "info" || l.event === "warn") {
      log.push(`[${new Date(l.time * 1000).toLocaleTimeString()}] ${l.event === "warn" ? "warning: " : ""}${l.message}`);
    }
  }
  // repeated phases (a checkpoint or a grid every N steps) in one row each: how many, their seconds, the last facts
  const folded = [];
  let since = 0;  // folding stays within one start of the run (a resume begins anew)
  for (const r of rows) {
    if (r.run !== undefined) { since = folded.length; folded.push(r); continue; }
    const kind = r.name.replace(/ \(step \d+\)$/, "");
    const same = kind !== r.name && r.end !== undefined && !r.failed
      ? folded.slice(since).filter((f) => f.kind === kind && f.end !== undefined && !f.failed).pop() : null;
    if (same) {
      Object.assign(same, { count: same.count + 1, total: same.total + r.seconds, last: r.seconds, facts: r.facts,
                            name: `${kind} (last: ${r.name.slice(kind.length + 2, -1)})` });
    } else {
      folded.push({ ...r, kind, count: 1, total: r.seconds, last: r.seconds });
    }
  }
  rows.length = 0;
  rows.push(...folded);
  const running = current && current.status === "running";
  const now = Date.now() / 1000;
  const facts = (f) => Object.entries(f || {}).filter(([, v]) => v !== null && v !== "").map(([k, v]) => `${k} ${v}`).join(", ");
  $("#phases tbody").innerHTML = rows.map((r, i) => r.run !== undefined
    ? (i ? `<tr class="resumed"><td colspan="3">started again at ${esc(new Date(r.run * 1000).toLocaleString())}</td></tr>` : "")
    : `<tr class="${r.end === undefined ? (running ? "open" : "failed-phase") : (r.failed ? "failed-phase" : "")}">
       <td>${esc(r.count > 1 ? `${r.name} × ${r.count}` : r.name)}</td>
       <td>${r.end === undefined ? (running ? `${(now - r.start).toFixed(0)} so far` : "did not end") : (r.failed ? "failed" :
         (r.count > 1 ? `${r.total.toFixed(1)} in all, ${r.last.toFixed(1)} the last` : r.seconds.toFixed(1)))}</td>
       <td>${esc(facts(r.facts))}</td></tr>`).join("") || '<tr><td colspan="3">none recorded (a run from before lorakit recorded its phases)</td></tr>';
  $("#run-log").hidden = !log.length;
  $("#run-log").textContent = log.slice(-30).join("\n");
}

async function showActions(r) {
  // stop where the dashboard's queue runs this run; the LoRA to download and the command that publishes it
  const parts = [];
  const all = (await getJSON("/api/jobs")).jobs.filter((j) => j.run === r.name);
  const jobs = all.filter((j) => ["running", "queued"].includes(j.state));
  const again = all.filter((j) => j.resumable).pop();  // the queue's newest job of this folder, with a checkpoint
  if (jobs.length) parts.push(`<button id="run-stop" data-stop="${jobs[0].id}">stop (a checkpoint, then exit)</button>`);
  else if (r.status === "running") parts.push("started outside the dashboard: stop it where it runs (Ctrl-C keeps a checkpoint)");
  else if (again) parts.push(`<button id="run-resume" data-resume="${again.id}">resume from its last checkpoint</button>`);
  else if (r.status === "interrupted") parts.push("continue it: <code>lorakit train YOUR_CONFIG --resume latest</code>");
  if (r.files.some((f) => f.endsWith("/lora.safetensors") || f === "lora.safetensors")) {
    const lora = r.files.find((f) => f.endsWith("lora.safetensors"));
    parts.push(`<a href="${fileUrl(lora)}" download>download the LoRA</a>`);
    parts.push(`publish: <code>lorakit push ${esc(r.path)} YOU/${esc(r.name.split("/").pop())}</code>`);
  }
  parts.push(`folder: <code>${esc(r.path)}</code>`);
  $("#run-actions").innerHTML = parts.join(" · ");
  const stop = $("#run-stop");
  if (stop) stop.onclick = async () => { stop.disabled = true; await jobAction(`/api/jobs/${stop.dataset.stop}/stop`); };
  const resume = $("#run-resume");
  if (resume) resume.onclick = async () => { resume.disabled = true; await jobAction(`/api/jobs/${resume.dataset.resume}/resume`); };
}

function showSummary(r) {
  current = r;
  $("#run-summary").innerHTML = `<span class="status ${esc(r.status)}">${esc(r.status)}</span> ${esc(r.family)} ·
    step ${r.step}${r.steps ? " / " + r.steps : ""} · loss ${num(r.loss)} · ${num(r.s_per_step, 3)} s/step · ETA ${duration(r.eta_s)}`;
}

async function showRun(name) {
  const r = await getJSON("/api/run/" + runUrl(name));
  $("#run-name").textContent = r.name;
  showSummary(r);
  $("#config").textContent = r.config;
  $("#checkpoints").innerHTML = r.checkpoints.map((c) => `<li>${esc(c.name)}: ` +
    c.files.map((f) => `<a href="${fileUrl(f)}">${esc(f.split("/").pop())}</a>`).join(", ") + "</li>").join("") +
    r.files.map((f) => `<li><a href="${fileUrl(f)}">${esc(f.split("/").pop())}</a></li>`).join("");
  $("#prompts").innerHTML = (r.prompts || []).map((p) => `<li>${esc(p)}</li>`).join("");  // the grids' rows, in full
  points = [];
  phaseLines = [];
  drawChart();
  showSamples(r.samples);
  showPhases();
  showActions(r).catch(() => {});
  $("#smooth").onchange = drawChart;
  $("#chart").onmousemove = hoverChart;
  zoom = null;
  $("#chart").onmousedown = (e) => { dragFrom = stepAt(e); };
  $("#chart").onmouseup = zoomChart;
  $("#chart").ondblclick = () => { zoom = null; drawChart(); };
  if (phaseTimer) clearInterval(phaseTimer);
  phaseTimer = setInterval(showPhases, 1000);
  source = new EventSource("/api/events/" + runUrl(name) + "?since=0");
  source.addEventListener("phases", (e) => { phaseLines = phaseLines.concat(JSON.parse(e.data).lines); showPhases(); });
  source.addEventListener("metrics", (e) => {
    const rows = JSON.parse(e.data).rows;
    points = points.concat(rows);
    drawChart();
    const last = rows.filter((p) => typeof p.loss === "number").pop();
    if (last && current) {  // the header follows the newest step; the s/step is the last 20 steps' median
      const recent = points.filter((p) => typeof p.s_per_step === "number").slice(-20).map((p) => p.s_per_step).sort((a, b) => a - b);
      const sps = recent.length ? recent[Math.floor(recent.length / 2)] : current.s_per_step;
      showSummary({ ...current, step: last.step, loss: last.loss, s_per_step: sps,
                    eta_s: current.status === "running" && current.steps && sps ? (current.steps - last.step) * sps : current.eta_s });
    }
  });
  source.addEventListener("samples", (e) => showSamples(JSON.parse(e.data)));
  source.addEventListener("status", (e) => { showSummary(JSON.parse(e.data)); showActions({ ...r, ...JSON.parse(e.data) }).catch(() => {}); });
}

function dfileUrl(rel) { return "/dfiles/" + rel.split("/").map(encodeURIComponent).join("/"); }

async function showDatasets() {
  const data = await getJSON("/api/datasets");
  $("#root").textContent = data.root || "the data folders of the runs";
  $("#datasets").innerHTML = data.datasets.map((d) =>
    `<li><a href="#/dataset/${esc(d.name)}" data-dataset="${esc(d.name)}">${esc(d.path || d.name)}</a> (${d.items})` +
    (d.runs ? ` · trained on by ${d.runs.map((r) => `<a href="#/run/${esc(r)}">${esc(r)}</a>`).join(", ")}` : "") + "</li>").join("")
    || (data.root ? "<li>No folder with images or clips here.</li>" :
      "<li>No run trains on a folder with images or clips yet; <code>lorakit ui --datasets DIR</code> lists the dataset folders under DIR.</li>");
}

function showCheck(c) {
  $("#check-summary").textContent = (c.error ? `not checked: ${c.error}` :
    `${c.items} items train, ${c.problems.length} problems` + (c.warnings.length ? `; ${c.warnings.join("; ")}` : "")) +
    (c.settings ? ` (checked with ${c.settings})` : "");
  $("#problems tbody").innerHTML = (c.problems || []).map((p) =>
    `<tr><td>${esc(p.path)}</td><td>${esc(p.code)}</td><td>${esc(p.message)}</td></tr>`).join("");
}

function mediaTag(it) {
  // images and animated .gif / .webp clips as pictures (the browser plays the latter), other clips as videos
  if (it.kind === "image" || /\.(gif|webp)$/i.test(it.file)) {
    return `<img src="${dfileUrl(it.file)}" alt="${esc(it.stem)}" loading="lazy">` + (it.kind === "clip" ? "<p>clip</p>" : "");
  }
  return `<video src="${dfileUrl(it.file)}" muted controls preload="metadata"></video><p>clip</p>`;
}

async function showDataset(name, family) {
  const d = await getJSON("/api/dataset/" + runUrl(name) + (family ? "?family=" + encodeURIComponent(family) : ""));
  family = d.family;
  $("#dataset-name").textContent = d.path;
  $("#family").innerHTML = d.families.map((f) => `<option${f === family ? " selected" : ""}>${f}</option>`).join("");
  $("#family").onchange = () => showDataset(name, $("#family").value);
  showCheck(d.check);
  $("#items").innerHTML = d.items.map((it) => `
    <div class="item" data-stem="${esc(it.stem)}">
      ${mediaTag(it)}
      <div>${esc(it.file.split("/").pop())} ${it.caption === null ? '<span class="missing">no caption</span>' : ""}</div>
      <textarea>${esc(it.caption ?? "")}</textarea>
      <button>save</button><span class="saved"></span>
    </div>`).join("");
  document.querySelectorAll("#items .item").forEach((el) => {
    el.querySelector("button").onclick = async () => {
      const r = await fetch("/api/caption/" + runUrl(name), { method: "PUT", credentials: "same-origin",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ stem: el.dataset.stem, text: el.querySelector("textarea").value }) });
      const out = await r.json();
      el.querySelector(".saved").textContent = r.ok ? `saved (${out.chars} characters)` : (out.detail || "not saved");
      const miss = el.querySelector(".missing");
      if (r.ok && miss) miss.remove();
      if (r.ok) {  // the problems as the check sees the folder now
        const fresh = await getJSON("/api/dataset/" + runUrl(name) + "?family=" + encodeURIComponent($("#family").value));
        showCheck(fresh.check);
      }
    };
  });
}

async function jobAction(url, body) {
  const r = await fetch(url, { method: "POST", credentials: "same-origin", headers: { "Content-Type": "application/json" },
    body: body ? JSON.stringify(body) : undefined });
  const out = await r.json();
  $("#job-problems").innerHTML = r.ok ? "" : (out.problems || [out.error || out.detail]).map((p) => `<li>${esc(p)}</li>`).join("");
  await showJobs();
  return r.ok;
}

function reading(v, unit, digits = 0) {
  return v === null || v === undefined ? "-" : `${Number(v).toFixed(digits)}${unit}`;
}

function gib(mib) {
  return mib === null || mib === undefined ? null : mib / 1024;
}

async function showMachine() {
  const m = await getJSON("/api/machine");
  $("#gpus tbody").innerHTML = m.gpus.length ? m.gpus.map((g) => `<tr><td>${g.index}: ${esc(g.name)}</td>
    <td>${reading(gib(g.memory_used_mib), "", 1)} / ${reading(gib(g.memory_total_mib), " GiB", 1)}</td>
    <td>${reading(g.utilization_pct, " %")}</td><td>${reading(g.temperature_c, " °C")}</td><td>${reading(g.power_w, " W")}</td>
    <td>${g.job ? `#${g.job.id}` + (g.job.run ? ` <a href="#/run/${esc(g.job.run)}">${esc(g.job.run)}</a>` : "") : "-"}</td></tr>`).join("")
    : `<tr><td colspan="6">${esc(m.note || "no GPU")}</td></tr>`;
  const h = m.host;
  $("#host").textContent = `host: load ${reading(h.load_1m, "", 2)} on ${h.cpus} cores · memory ${reading(h.memory_available_gib, "", 1)} of ` +
    `${reading(h.memory_total_gib, " GiB", 1)} available · disk ${reading(h.disk_free_gib, "", 1)} of ${reading(h.disk_total_gib, " GiB", 1)} free`;
}

async function showJobs() {
  showMachine().catch(() => {});
  const data = await getJSON("/api/jobs");
  $("#jobs tbody").innerHTML = data.jobs.map((j) => {
    const run = j.run || "";
    // resume only where the server says a step checkpoint is there and no other job holds the run folder
    const act = ["queued", "running"].includes(j.state) ? `<button data-stop="${j.id}">stop</button>`
      : j.resumable ? `<button data-resume="${j.id}">resume</button>` : "";
    const link = run ? `<a href="#/run/${esc(run)}">${esc(run)}</a>` : "";
    return `<tr data-job="${j.id}"><td>${j.id}</td><td><span class="status ${esc(j.state)}">${esc(j.state)}</span>` +
      `${j.exit !== null && j.exit !== undefined ? " (exit " + j.exit + ")" : ""}</td><td>${esc(j.config)}</td>` +
      `<td>${link}</td><td>${act} <a href="#/jobs" data-log="${j.id}">log</a></td></tr>`;
  }).join("");
  document.querySelectorAll("[data-stop]").forEach((b) => { b.onclick = () => jobAction(`/api/jobs/${b.dataset.stop}/stop`); });
  document.querySelectorAll("[data-resume]").forEach((b) => { b.onclick = () => jobAction(`/api/jobs/${b.dataset.resume}/resume`); });
  document.querySelectorAll("[data-log]").forEach((a) => {
    a.onclick = async (e) => {
      e.preventDefault();
      const l = await getJSON(`/api/jobs/${a.dataset.log}/log`);
      $("#job-log").hidden = false;
      $("#job-log").textContent = l.log || "(empty)";
    };
  });
}

let schemaLoaded = false;

function fieldKind(spec) {
  const alts = spec.anyOf || [spec];
  const enumAlt = alts.find((a) => a.enum);
  if (enumAlt) return { kind: "enum", values: enumAlt.enum };
  const t = alts.map((a) => a.type).filter((x) => x && x !== "null");
  if (t.includes("boolean")) return { kind: "enum", values: [true, false] };
  if (t.includes("integer")) return { kind: "integer" };
  if (t.includes("number")) return { kind: "number" };
  if (t.includes("array") && alts.some((a) => a.items && a.items.type === "string")) return { kind: "lines" };
  if (t.includes("string")) return { kind: "string" };
  return null;  // nested objects and lists of them: a config file
}

async function buildSchemaForm() {
  if (schemaLoaded) return;
  const s = await getJSON("/api/schema");
  const section = (name, props) => Object.entries(props).map(([k, spec]) => {
    const f = fieldKind(spec);
    if (!f) return "";
    const key = name ? `${name}.${k}` : k;
    const dflt = spec.default === undefined || spec.default === null ? "" : JSON.stringify(spec.default);
    const input = f.kind === "enum"
      ? `<select data-key="${esc(key)}" data-kind="${f.kind}"><option value="">${esc(dflt ? "default: " + dflt : "")}</option>` +
        f.values.map((v) => `<option value="${esc(JSON.stringify(v))}">${esc(v)}</option>`).join("") + "</select>"
      : f.kind === "lines" ? `<textarea data-key="${esc(key)}" data-kind="lines" rows="2" placeholder="one per line"></textarea>`
      : `<input data-key="${esc(key)}" data-kind="${f.kind}" placeholder="${esc(dflt)}">`;
    return `<label>${esc(key)} ${input}<small>${esc(spec.description || "")}</small></label>`;
  }).join("");
  let html = `<fieldset><legend>run</legend>${section("", Object.fromEntries(
    Object.entries(s.properties).filter(([, v]) => !v.$ref)))}</fieldset>`;
  for (const [name, v] of Object.entries(s.properties)) {
    if (!v.$ref) continue;
    const def = s.$defs[v.$ref.split("/").pop()];
    html += `<fieldset><legend>${esc(name)}</legend>${section(name, def.properties)}</fieldset>`;
  }
  $("#schema-fields").innerHTML = html;
  schemaLoaded = true;
  await buildQuickForm();
}

let choices = null;  // the new-run form's families, profiles and datasets

async function buildQuickForm() {
  choices = await getJSON("/api/choices");
  $("#q-family").innerHTML = choices.families.map((f) => `<option value="${esc(f.name)}">${esc(f.name)}</option>`).join("");
  $("#q-profile").innerHTML = `<option value="">this machine's (lorakit doctor decides)</option>` +
    choices.profiles.map((p) => `<option value="${esc(p)}">${esc(p)}</option>`).join("");
  $("#q-datasets").innerHTML = choices.datasets.map((d) => `<option value="${esc(d.path || d.name)}">${esc(d.items)} items</option>`).join("");
  const about = () => { const f = choices.families.find((x) => x.name === $("#q-family").value); $("#q-about").textContent = f ? f.description : ""; };
  about();
  $("#q-family").onchange = () => { about(); preview(); };
  $("#q-preset").onchange = () => {
    const v = $("#q-preset").value ? JSON.parse($("#q-preset").value) : {};
    for (const [key, value] of Object.entries(v)) $(`#quick-fields [data-key="${key}"]`).value = value;
  };
  for (const id of ["#q-data", "#q-res"]) $(id).onchange = preview;
  document.querySelectorAll('#schema-fields [data-key^="data.bucket_"]').forEach((el) => { el.onchange = preview; });
  $("#q-check-btn").onclick = checkRun;
}

async function preview() {
  // the chosen dataset as this family at this resolution would cache it: its first images and its problems
  const path = $("#q-data").value.trim();
  const d = choices && choices.datasets.find((x) => (x.path || x.name) === path);
  if (!path) { $("#q-check").textContent = ""; $("#q-thumbs").innerHTML = ""; return; }
  if (!d) { $("#q-check").textContent = "not one of the dataset folders listed here: the check (dry run) reads it"; $("#q-thumbs").innerHTML = ""; return; }
  const sizes = { resolution: $("#q-res").value.trim() };
  document.querySelectorAll('#schema-fields [data-key^="data.bucket_"]').forEach((el) => { sizes[el.dataset.key.slice(5)] = el.value.trim(); });
  const q = new URLSearchParams({ family: $("#q-family").value });
  for (const [k, v] of Object.entries(sizes)) if (v) q.set(k, v);
  const r = await getJSON("/api/dataset/" + runUrl(d.name) + "?" + q);
  const c = r.check;
  $("#q-check").textContent = c.error ? `not checked: ${c.error}` :
    `${c.items} items train, ${c.problems.length} problems (checked with ${c.settings})` +
    (c.problems.length ? ": " + c.problems.slice(0, 3).map((p) => `${p.path}: ${p.code}`).join("; ") : "");
  $("#q-thumbs").innerHTML = r.items.slice(0, 8).map((it) => mediaTag(it)).join("");
}

function showEstimate(out) {
  const p = out.profile || {}, m = out.memory_estimate;
  const lines = [`profile ${p.profile || "?"}: ${p.reason || ""}`, `device ${out.device}` + (out.world > 1 ? `, ${out.world} processes` : "")];
  if (m) lines.push(`GPU memory estimate: ${m.gib} GiB per GPU` + (m.uncompiled_gib ? ` (${m.uncompiled_gib} GiB while the blocks compile)` : ""));
  else lines.push("no GPU memory estimate (no GPU profile)");
  const mem = (out.config || {}).memory || {};  // what the profile set for this run (the resolved config)
  const set = ["base_quant", "compile", "cuda_graphs", "checkpoint_blocks", "blocks_to_swap", "attention"]
    .filter((k) => mem[k] !== undefined && mem[k] !== null).map((k) => `${k} ${JSON.stringify(mem[k])}`);
  if (set.length) lines.push("the profile's settings: memory " + set.join(", "));
  if (out.memory_note) lines.push(out.memory_note);
  for (const n of out.notes || []) lines.push(n);
  for (const w of p.warnings || []) lines.push("warning: " + w);
  $("#q-estimate").innerHTML = "<ul>" + lines.map((l) => `<li>${esc(l)}</li>`).join("") + "</ul>";
}

async function checkRun() {
  $("#q-estimate").innerHTML = "<p>checking as lorakit train --dry-run does...</p>";
  const r = await fetch("/api/jobs/check", { method: "POST", credentials: "same-origin",
    headers: { "Content-Type": "application/json" }, body: JSON.stringify({ form: formValues() }) });
  const out = await r.json();
  if (r.ok) showEstimate(out);
  else $("#q-estimate").innerHTML = '<ul class="error">' + (out.problems || [out.error || out.detail]).map((x) => `<li>${esc(x)}</li>`).join("") + "</ul>";
  return r.ok;
}

function formValues() {
  // the advanced fields, then the ones up front (which win where both are given)
  const out = {};
  document.querySelectorAll("#schema-fields [data-key], #quick-fields [data-key]").forEach((el) => {
    const raw = el.value.trim();
    if (!raw) return;
    const kind = el.dataset.kind;
    const value = kind === "enum" ? JSON.parse(raw) : kind === "integer" || kind === "number" ? Number(raw)
      : kind === "lines" ? raw.split("\n").map((x) => x.trim()).filter(Boolean) : kind === "list" ? [raw] : raw;
    const path = el.dataset.key.split(".");
    let at = out;
    path.slice(0, -1).forEach((p) => { at = at[p] = at[p] || {}; });
    at[path[path.length - 1]] = Number.isNaN(value) ? raw : value;  // a bad number is the CLI's to name
  });
  return out;
}

async function route() {
  if (source) { source.close(); source = null; }
  if (listTimer) { clearInterval(listTimer); listTimer = null; }
  if (phaseTimer) { clearInterval(phaseTimer); phaseTimer = null; }
  const m = location.hash.match(/^#\/run\/(.+)$/);
  const ds = location.hash.match(/^#\/dataset\/(.+)$/);
  const dsList = location.hash === "#/datasets";
  const jobs = location.hash === "#/jobs";
  $("#list-view").hidden = !!(m || ds || dsList || jobs);
  $("#jobs-view").hidden = !jobs;
  $("#run-view").hidden = !m;
  $("#datasets-view").hidden = !dsList;
  $("#dataset-view").hidden = !ds;
  try {
    if (m) {
      await showRun(decodeURIComponent(m[1]));
    } else if (ds) {
      await showDataset(decodeURIComponent(ds[1]), "");
    } else if (dsList) {
      await showDatasets();
    } else if (jobs) {
      await showJobs();
      await buildSchemaForm();
      listTimer = setInterval(() => showJobs().catch(() => {}), 1000);
    } else {
      await showList();
      listTimer = setInterval(() => showList().catch(() => {}), 3000);
    }
  } catch (err) {
    document.body.insertAdjacentHTML("beforeend", `<p class="error">${esc(err.message)}</p>`);
  }
}

window.addEventListener("hashchange", route);
$("#schema-form").onsubmit = async (e) => {
  e.preventDefault();
  $("#job-problems").innerHTML = "<li>checking the config as lorakit train --dry-run does...</li>";
  const ok = await jobAction("/api/jobs", { form: formValues() });
  $("#q-estimate").innerHTML = ok ? "<p>queued: see the jobs below</p>" : `<ul class="error">${$("#job-problems").innerHTML}</ul>`;
};
$("#job-form").onsubmit = async (e) => {
  e.preventDefault();
  const sets = $("#job-sets").value.split("\n").map((x) => x.trim()).filter(Boolean);
  $("#job-problems").innerHTML = "<li>checking the config as lorakit train --dry-run does...</li>";
  await jobAction("/api/jobs", { config: $("#job-config").value, sets });
};
route();
