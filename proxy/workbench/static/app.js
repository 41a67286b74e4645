// The workbench page: plain DOM, no build step. State lives on the server; this only draws it.
"use strict";

const $ = (sel) => document.querySelector(sel);
const state = { scenarios: [], session: null, turns: [], head: null, busy: false, creating: null };

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

async function api(path, options = {}) {
  const resp = await fetch(path, { headers: { "Content-Type": "application/json" }, ...options });
  const data = await resp.json();
  if (!resp.ok) throw new Error(data.error ? data.error.message : resp.statusText);
  return data;
}

async function loadScenarios() {
  state.scenarios = await api("/api/scenarios");
  const select = $("#scenario");
  for (const s of state.scenarios) select.append(el("option", { value: s.name }, s.title));
  select.addEventListener("change", showScenario);
  showScenario();
}

function currentScenario() {
  const name = state.session ? state.session.scenario : $("#scenario").value;
  return state.scenarios.find((s) => s.name === name);
}

function showScenario() {
  const s = state.scenarios.find((x) => x.name === $("#scenario").value);
  $("#scenario-description").textContent = s.description;
  if (!state.session || state.session.scenario !== s.name) $("#message").value = s.task;
}

async function loadSessions() {
  const list = $("#sessions");
  list.replaceChildren();
  for (const s of await api("/api/sessions")) {
    const item = el("li", { onclick: () => openSession(s.id) }, `${s.title} (${s.turns} turns)`);
    if (state.session && s.id === state.session.id) item.classList.add("current");
    list.append(item);
  }
}

function newSession() {
  // Kept while it runs, so a Send clicked meanwhile waits for it instead of making another.
  state.creating = (async () => {
    const s = await api("/api/sessions", { method: "POST", body: JSON.stringify({ scenario: $("#scenario").value }) });
    await openSession(s.id);
    $("#message").value = currentScenario().task;
  })().finally(() => { state.creating = null; });
  return state.creating;
}

async function openSession(id, head) {
  const data = await api(`/api/sessions/${id}`);
  state.session = data.session;
  state.turns = data.turns;
  state.head = head !== undefined ? head : (data.turns.length ? data.turns[data.turns.length - 1].id : null);
  $("#scenario").value = state.session.scenario;
  $("#export").href = `/api/sessions/${id}/manifest`;
  draw();
  await loadSessions();
}

function pathTo(id) {
  const byId = Object.fromEntries(state.turns.map((t) => [t.id, t]));
  const out = [];
  for (let t = byId[id]; t; t = byId[t.parent_id]) out.unshift(t);
  return out;
}

function draw() {
  drawChat();
  drawTree();
  drawTimeline();
  const path = pathTo(state.head);
  drawTrace(path.length ? path[path.length - 1] : null);
  const last = state.turns.length ? state.turns[state.turns.length - 1].id : null;
  $("#branch-note").textContent = state.head && state.head !== last
    ? "Next message branches after the selected turn." : "";
}

function toolDetails(tool) {
  return el("details", { class: "tool" },
    el("summary", {}, `tool ${tool.name}(${JSON.stringify(tool.arguments)})`),
    el("pre", {}, tool.result));
}

function drawChat() {
  const chat = $("#chat");
  chat.replaceChildren();
  for (const turn of pathTo(state.head)) {
    chat.append(el("div", { class: "msg user" }, turn.user));
    for (const tool of turn.tools) chat.append(toolDetails(tool));
    if (turn.error) chat.append(el("div", { class: "msg error" }, `error: ${turn.error}`));
    chat.append(el("div", { class: "msg assistant answer" }, turn.final || "(empty answer)"));
  }
  chat.scrollTop = chat.scrollHeight;
}

function drawTree() {
  const tree = $("#tree");
  tree.replaceChildren();
  const kids = {};
  for (const t of state.turns) (kids[t.parent_id || "root"] ||= []).push(t);
  const root = el("div", { class: "tree-node" + (state.head === null ? " head" : ""), onclick: () => selectHead(null) }, "● start");
  tree.append(root);
  const walk = (parent, container) => {
    const box = el("div", { class: "tree-children" });
    for (const t of kids[parent] || []) {
      const label = `#${t.seq + 1} ${t.user.slice(0, 40)}`;
      box.append(el("div", { class: "tree-node" + (t.id === state.head ? " head" : ""), "data-turn": t.id, onclick: () => selectHead(t.id) }, label));
      walk(t.id, box);
    }
    container.append(box);
  };
  walk("root", tree);
}

function selectHead(id) {
  state.head = id;
  draw();
}

function tokens(call) {
  const cached = call.cached_tokens || 0;
  const computed = call.prefilled_tokens !== null && call.prefilled_tokens !== undefined
    ? call.prefilled_tokens : Math.max(0, (call.prompt_tokens || 0) - cached);
  return { cached, computed };
}

function drawTimeline() {
  const box = $("#timeline");
  box.replaceChildren(el("div", { class: "legend" }, el("span", { style: "background:#3a9b5c" }), "reused",
    el("span", { style: "background:#d9822b" }), "computed"));
  const rows = state.turns.map((turn) => {
    const sum = turn.calls.reduce((acc, c) => { const t = tokens(c); return [acc[0] + t.cached, acc[1] + t.computed]; }, [0, 0]);
    return { turn, cached: sum[0], computed: sum[1] };
  });
  const max = Math.max(1, ...rows.map((r) => r.cached + r.computed));
  for (const r of rows) {
    const bar = el("div", { class: "bar", title: `${r.cached} reused, ${r.computed} computed` },
      el("div", { class: "cached", style: `width:${100 * r.cached / max}%` }),
      el("div", { class: "computed", style: `width:${100 * r.computed / max}%` }));
    box.append(el("div", { class: "timeline-row", "data-turn": r.turn.id }, `#${r.turn.seq + 1}: ${r.cached} reused / ${r.computed} computed`, bar));
  }
}

function traceTable(calls) {
  const table = el("table", {}, el("tr", {}, ...["step", "kind", "route", "server/slot", "prompt", "cached", "prefilled", "TTFT s"].map((h) => el("th", {}, h))));
  for (const c of calls) {
    table.append(el("tr", { class: "trace-call" },
      el("td", {}, c.step), el("td", {}, c.kind), el("td", {}, c.route || "-"),
      el("td", {}, `${c.server || "-"}/${c.slot === null ? "-" : c.slot}`),
      el("td", {}, c.prompt_tokens ?? "-"), el("td", {}, c.cached_tokens ?? "-"),
      el("td", {}, c.prefilled_tokens ?? "-"), el("td", {}, c.ttft_s ?? "-")));
  }
  return table;
}

function drawTrace(turn, liveCalls) {
  const box = $("#trace");
  box.replaceChildren();
  const calls = liveCalls || (turn ? turn.calls : []);
  if (!calls.length) return;
  box.append(traceTable(calls));
  for (const c of calls) {
    box.append(el("details", { class: "call" },
      el("summary", {}, `step ${c.step} (${c.kind}): request and answer`),
      el("pre", {}, JSON.stringify({ request: c.request, answer: c.content, tool_calls: c.native_tool_calls, error: c.error }, null, 1))));
  }
}

async function send() {
  if (state.busy) return;
  const message = $("#message").value.trim();
  if (!message) return;
  if (state.creating) await state.creating;
  if (!state.session) await newSession();
  state.busy = true;
  $("#send").disabled = true;
  const chat = $("#chat");
  chat.append(el("div", { class: "msg user" }, message));
  let live = el("div", { class: "msg assistant live" });
  chat.append(live);
  const calls = [];
  try {
    const resp = await fetch(`/api/sessions/${state.session.id}/turns`, {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ message, parent: state.head }),
    });
    if (!resp.ok) throw new Error((await resp.json()).error.message);
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    let done = null;
    for (;;) {
      const { value, done: end } = await reader.read();
      if (end) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const line = buffer.slice(0, cut).trim();
        buffer = buffer.slice(cut + 2);
        if (!line.startsWith("data:")) continue;
        const event = JSON.parse(line.slice(5));
        if (event.type === "step" && live.textContent) {
          live = el("div", { class: "msg assistant live" });
          chat.append(live);
        } else if (event.type === "token") live.textContent += event.text;
        else if (event.type === "tool") {
          live.remove();
          chat.append(toolDetails(event));
          live = el("div", { class: "msg assistant live" });
          chat.append(live);
        } else if (event.type === "call") { calls.push(event.call); drawTrace(null, calls); }
        else if (event.type === "done") done = event.turn;
        chat.scrollTop = chat.scrollHeight;
      }
    }
    $("#message").value = "";
    if (done) await openSession(state.session.id, done.id);
  } catch (err) {
    chat.append(el("div", { class: "msg error" }, String(err)));
  } finally {
    state.busy = false;
    $("#send").disabled = false;
  }
}

async function preview() {
  if (!state.session) await newSession();
  const out = $("#preview-out");
  const data = await api(`/api/sessions/${state.session.id}/preview`, {
    method: "POST", body: JSON.stringify({ message: $("#message").value || "…", parent: state.head }),
  });
  out.hidden = false;
  out.textContent = `POST ${data.url}\n${JSON.stringify(data.body, null, 1)}`;
}

async function replayFile(event) {
  const file = event.target.files[0];
  if (!file) return;
  const out = $("#preview-out");
  out.hidden = false;
  out.textContent = "replaying…";
  const resp = await fetch("/api/replay", {
    method: "POST", headers: { "Content-Type": "application/x-ndjson" }, body: await file.text(),
  });
  const data = await resp.json();
  out.textContent = resp.ok
    ? data.results.map((r) => `${r.id}: status ${r.status} route ${r.route} cached ${r.cache_n} prefilled ${r.prompt_n} ttft ${r.ttft_s}`).join("\n")
    : `error: ${data.error.message}`;
}

async function proxyStatus() {
  try {
    const info = await api("/api/proxy");
    $("#proxy-status").textContent = info.error ? `proxy: ${info.error}` : `proxy ${info.url}: ${info.health.status}`;
  } catch (err) {
    $("#proxy-status").textContent = `proxy: ${err}`;
  }
}

$("#new-session").addEventListener("click", newSession);
$("#send").addEventListener("click", send);
$("#preview").addEventListener("click", preview);
$("#replay-file").addEventListener("change", replayFile);
loadScenarios().then(loadSessions);
proxyStatus();
