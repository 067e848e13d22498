// dllm's page: a prompt, the live block as it denoises, and a timeline of the forwards.
// Plain JavaScript over the server's own SSE API (stream_options.denoise_steps); it loads
// nothing from anywhere else.
"use strict";

const $ = (id) => document.getElementById(id);
const MASK = "\u2591";
const STEP_COLOURS = ["#ff5f5f", "#ff9f40", "#f5d033", "#5fd35f", "#4fd0e0", "#5f8fff", "#b36bff", "#ff6bd6"];
const stepColour = (s) => STEP_COLOURS[s % STEP_COLOURS.length];
let info = { algorithms: {}, default_algorithm: "" };
let apiKey = localStorage.getItem("dllm-api-key") || "";
// Every state the canvas drew, in order (the page's own record; also read by tests).
window.dllmHistory = [];

function headers() {
  const h = { "Content-Type": "application/json" };
  if (apiKey) h["Authorization"] = "Bearer " + apiKey;
  return h;
}

// A special token (<|endoftext|>, <|im_end|>, ...) is drawn as "end"; its name is its title.
const show = (t) => (/^<\|[^|]*\|>$/.test(t) ? "end" : t.replace(/\n/g, "\u21b5") || "\u2205");
const fmt = (x) => (x === null || x === undefined ? "?" : x.toFixed(3));

function status(text) { $("status").textContent = text || ""; }

async function init() {
  info = await (await fetch("/web/info.json")).json();
  const sel = $("algorithm");
  for (const name of Object.keys(info.algorithms).sort()) {
    const o = document.createElement("option");
    o.value = o.textContent = name;
    sel.appendChild(o);
  }
  sel.value = info.default_algorithm;
  sel.addEventListener("change", fillSettings);
  fillSettings();
  $("mode").value = info.chat ? "chat" : "completion";
  $("api-key").value = apiKey;
  $("key-save").addEventListener("click", () => {
    apiKey = $("api-key").value.trim();
    localStorage.setItem("dllm-api-key", apiKey);
    checkModel();
  });
  $("ask").addEventListener("submit", (e) => { e.preventDefault(); run(); });
  drawBlock(null);
  checkModel();
}

function fillSettings() {
  const name = $("algorithm").value;
  const settings = name === info.default_algorithm ? info.default_config : info.algorithms[name];
  $("settings").value = JSON.stringify(settings || {});
}

async function checkModel() {
  const r = await fetch("/v1/models", { headers: headers() });
  if (r.status === 401) {
    $("key-row").hidden = false;
    $("model").textContent = "this server needs its API key";
    status("enter the API key (--api-key) to use this server");
    return false;
  }
  const body = await r.json();
  $("model").textContent = "model: " + body.data.map((m) => m.id).join(", ") +
    " · block size " + info.block_size;
  status("");
  return true;
}

// ---- SSE over fetch ----------------------------------------------------------------------
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const raw = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      let event = "message", data = "";
      for (const line of raw.split("\n")) {
        if (line.startsWith("event: ")) event = line.slice(7);
        else if (line.startsWith("data: ")) data += line.slice(6);
      }
      if (data) yield { event, data };
    }
  }
}

// ---- one answer --------------------------------------------------------------------------
async function run() {
  const prompt = $("prompt").value.trim();
  if (!prompt) { status("write a prompt first"); return; }
  let dllm;
  try { dllm = JSON.parse($("settings").value || "{}"); }
  catch (e) { status("algorithm settings: not JSON (" + e.message + ")"); return; }
  dllm.algorithm = $("algorithm").value;
  const chat = $("mode").value === "chat";
  const body = {
    max_tokens: Number($("max-tokens").value) || 64,
    temperature: Number($("temperature").value) || 0,
    dllm, stream: true,
    stream_options: { denoise_steps: true, include_usage: true },
  };
  if (chat) body.messages = [{ role: "user", content: prompt }];
  else body.prompt = prompt;
  $("go").disabled = true;
  status("");
  $("answer").textContent = "";
  $("stats").textContent = "";
  const answer = { prompt, text: "", canvas: new Map(), block: null, steps: 0, start: performance.now() };
  const timeline = newTimeline(prompt, dllm);
  try {
    const r = await fetch(chat ? "/v1/chat/completions" : "/v1/completions",
                          { method: "POST", headers: headers(), body: JSON.stringify(body) });
    if (!r.ok) {
      const err = await r.json().catch(() => ({}));
      status((err.error && err.error.message) || ("HTTP " + r.status));
      if (r.status === 401) $("key-row").hidden = false;
      return;
    }
    for await (const { event, data } of sseEvents(r)) {
      if (data === "[DONE]") break;
      const msg = JSON.parse(data);
      if (msg.error) { status(msg.error.message); break; }
      if (event === "denoise_step") onStep(answer, msg, timeline);
      else onChunk(answer, msg, chat);
    }
    finishAnswer(answer);
  } catch (e) {
    status("request failed: " + e.message);
  } finally {
    $("go").disabled = false;
  }
}

function onStep(answer, ev, timeline) {
  answer.steps += 1;
  if (ev.step === 0) {  // a new block: first as it started, all masks
    answer.block = { offset: ev.block.offset, size: ev.block.size, index: ev.block.index,
                     cells: new Array(ev.block.size).fill(null) };
    for (const g of ev.given) answer.block.cells[g.position] = { text: g.text, step: 0 };
    const before = new Set([...ev.masked, ...ev.committed.map((c) => c.position)]);
    for (const p of before) answer.block.cells[p] = "mask";
    drawBlock(answer.block, ev, true);
  }
  for (const c of ev.committed) answer.block.cells[c.position] = { text: c.text, step: ev.step, c };
  for (const p of ev.masked) answer.block.cells[p] = "mask";
  drawBlock(answer.block, ev, false);
  addForward(timeline, ev);
}

function onChunk(answer, chunk, chat) {
  if (!chunk.choices || !chunk.choices.length) {
    if (chunk.usage) answer.usage = chunk.usage;
    return;
  }
  const choice = chunk.choices[0];
  const piece = chat ? (choice.delta && choice.delta.content) || "" : choice.text || "";
  answer.text += piece;
  $("answer").textContent = answer.text;
}

function finishAnswer(answer) {
  const seconds = (performance.now() - answer.start) / 1000;
  const tokens = answer.usage ? answer.usage.completion_tokens : 0;
  $("stats").textContent = `${tokens} tokens, ${answer.steps} denoise forwards, ` +
    `${(tokens / Math.max(answer.steps, 1)).toFixed(2)} tokens/forward, ${seconds.toFixed(2)} s`;
  window.dllmHistory.push({ final: true, answer: answer.text });
}

// ---- the canvas --------------------------------------------------------------------------
function drawBlock(block, ev, before) {
  const cv = $("canvas"), g = cv.getContext("2d");
  g.clearRect(0, 0, cv.width, cv.height);
  g.font = "20px ui-monospace, monospace";
  g.textAlign = "center";
  g.textBaseline = "middle";
  if (!block) {
    g.fillStyle = "#999";
    g.fillText("the block appears here as it denoises", cv.width / 2, cv.height / 2);
    $("block-text").textContent = "";
    return;
  }
  const w = Math.min(110, (cv.width - 20) / block.size), h = 60, y = 40;
  const cells = [];
  block.cells.forEach((cell, i) => {
    const x = 10 + i * w;
    let label, fill, fg = "#000";
    if (block.offset + i < 0) { label = "·"; fill = "#eee"; fg = "#aaa"; }  // prompt
    else if (cell === "mask" || cell === null) { label = MASK; fill = "#555"; fg = "#ccc"; }
    else { label = show(cell.text); fill = stepColour(cell.step); }
    g.fillStyle = fill;
    g.fillRect(x + 2, y, w - 4, h);
    g.fillStyle = fg;
    g.fillText(label.length > 6 ? label.slice(0, 5) + "…" : label, x + w / 2, y + h / 2, w - 8);
    if (block.offset + i >= 0) cells.push(cell === "mask" || cell === null ? MASK : label);
  });
  g.textAlign = "left";
  g.font = "13px system-ui, sans-serif";
  g.fillStyle = "#555";
  const where = before ? "before step 0" : `after step ${ev.step}`;
  g.fillText(`block ${block.index} · ${where} · forward ${ev.forward}`, 10, 20);
  const text = cells.join(" ");
  $("block-text").textContent = text;
  window.dllmHistory.push({ block: block.index, step: before ? -1 : ev.step, text,
                            masked: cells.filter((c) => c === MASK).length });
}

// ---- the timeline ------------------------------------------------------------------------
function newTimeline(prompt, dllm) {
  const div = document.createElement("div");
  div.className = "timeline";
  const h = document.createElement("h3");
  h.textContent = `${prompt} — ${dllm.algorithm} ${JSON.stringify(dllm)}`;
  div.appendChild(h);
  $("timelines").prepend(div);
  return div;
}

function addForward(div, ev) {
  const row = document.createElement("div");
  row.className = "fwd";
  const label = document.createElement("span");
  label.className = "label";
  label.textContent = `forward ${ev.forward} · block ${ev.block.index} step ${ev.step}`;
  row.appendChild(label);
  for (const c of ev.committed) {
    const t = document.createElement("span");
    t.className = "tok";
    t.style.background = stepColour(ev.step);
    t.textContent = show(c.text);
    t.title = `${JSON.stringify(c.text)} at position ${c.position}, confidence ${fmt(c.confidence)}, ` +
      `logprob ${fmt(c.logprob)}${c.edit ? " (edit)" : ""}`;
    row.appendChild(t);
  }
  if (!ev.committed.length) row.appendChild(document.createTextNode("(nothing committed)"));
  div.appendChild(row);
}

init().catch((e) => status("could not start: " + e.message));
