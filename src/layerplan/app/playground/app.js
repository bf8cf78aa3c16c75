// layerplan's playground: chat, A/B and the plan builder, over the server's own API.
// Plain JavaScript with no build step and nothing loaded from elsewhere: the machines that serve
// it may have no internet. Replies stream through /v1/chat/completions exactly as any client's
// do, so the page costs the decode nothing; plans are parsed and written by the server
// (/layerplan/plan), never here, so the page cannot disagree with the CLI about what a plan means.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY = "layerplan-key";
const KINDS = ["plain", "accepted", "correction", "bonus"];
let info = null;  // GET /layerplan/info

// ----- requests --------------------------------------------------------------------------------
class ApiError extends Error {}

function headers(json) {
  const result = json ? {"Content-Type": "application/json"} : {};
  const key = sessionStorage.getItem(KEY);
  if (key) result.Authorization = "Bearer " + key;
  return result;
}

async function errorText(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch (_) {
    return response.status + " " + response.statusText;
  }
}

async function send(path, body, signal) {
  const response = await fetch(path, {
    method: body === undefined ? "GET" : "POST", headers: headers(body !== undefined),
    body: body === undefined ? undefined : JSON.stringify(body), signal,
  });
  if (response.status === 401) askKey();
  if (!response.ok) throw new ApiError(await errorText(response));
  return response;
}

async function api(path, body) {
  return (await send(path, body)).json();
}

function showError(text) {
  $("error").textContent = text;
  $("error").classList.toggle("hidden", !text);
}

function askKey() {
  $("key-form").classList.remove("hidden");
  $("key").focus();
}

// ----- streaming a reply -----------------------------------------------------------------------
// The request's "layerplan" object asks for the plan, the draft and each token's provenance;
// chunks that carry "layerplan": {"tokens": [{text, kind}]} are coloured by kind, any other text
// is shown plain. The server gathers a quarter of a second's tokens into one chunk (the first
// goes at once): the browser reads and draws each chunk on the cores that decode, and a chunk a
// token cost the decode a third of its speed on two cores (a tenth of a second, an eighth).
function extension(plan, draft) {
  const object = {provenance: true, stream_interval: 0.25};
  if (plan) object.plan = plan;
  if (draft) object.draft = draft;
  return object;
}

function tokenSpan(text, kind) {
  const span = document.createElement("span");
  span.className = "tok " + (KINDS.includes(kind) ? kind : "plain");
  span.textContent = text;
  return span;
}

// POST a streamed chat completion; tokens are appended to `out` as they come and `onTick` gets
// the live figures. Resolves to {text, usage, kinds}. The page touches the DOM at most once a
// frame, however many tokens arrive: on a machine whose cores also decode, laying out and
// painting a reply token by token would take the time the decode needs.
async function streamChat(body, out, onTick, signal) {
  const response = await send("/v1/chat/completions",
    {...body, stream: true, stream_options: {include_usage: true}}, signal);
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  const counts = {};
  let buffer = "", text = "", usage = null, tokens = 0, first = null;
  let pending = document.createDocumentFragment(), frame = null;
  const flush = () => {
    frame = null;
    out.appendChild(pending);  // empties the fragment
    if (tokens) {
      const seconds = (performance.now() - first) / 1000;
      onTick({tokens, tokensPerSecond: seconds > 0 ? (tokens - 1) / seconds : null, counts});
    }
  };
  const take = (data) => {
    if (data === "[DONE]") return;
    const chunk = JSON.parse(data);
    if (chunk.error) throw new ApiError(chunk.error.message);
    if (chunk.usage) usage = chunk.usage;
    const delta = (chunk.choices && chunk.choices[0] && chunk.choices[0].delta.content) || "";
    const pieces = (chunk.layerplan && chunk.layerplan.tokens) || (delta ? [{text: delta, kind: null}] : []);
    for (const piece of pieces) {
      pending.appendChild(tokenSpan(piece.text, piece.kind));
      const kind = KINDS.includes(piece.kind) ? piece.kind : "plain";
      counts[kind] = (counts[kind] || 0) + 1;
      tokens += 1;
    }
    text += delta;
    if (pieces.length) {
      first = first || performance.now();
      if (frame === null) frame = requestAnimationFrame(flush);
    }
  };
  try {
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, {stream: true});
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of event.split("\n")) if (line.startsWith("data: ")) take(line.slice(6));
      }
    }
  } finally {  // what came is shown, a stopped or failed reply's too
    if (frame !== null) cancelAnimationFrame(frame);
    flush();
  }
  return {text, usage, counts};
}

function fmt(value, digits) {
  return value === null || value === undefined ? "–" : Number(value).toFixed(digits);
}

// the figures of a finished reply, from the server's usage block (its own clock), or the page's
// live estimate while the reply streams
function statsLine(usage, live) {
  if (!usage) {
    return live ? `${live.tokens} tokens · ~${fmt(live.tokensPerSecond, 1)} tokens/s (live)` : "";
  }
  const parts = [`${usage.completion_tokens} tokens`, `${fmt(usage.tokens_per_second, 1)} tokens/s`];
  const spec = usage.speculative;
  if (spec) {
    if (spec.acceptance_rate !== undefined) parts.push(`acceptance ${fmt(100 * spec.acceptance_rate, 0)}%`);
    if (spec.tokens_per_pass !== undefined) parts.push(`${fmt(spec.tokens_per_pass, 2)} tokens/pass`);
  }
  return parts.join(" · ");
}

// ----- chat ------------------------------------------------------------------------------------
const chat = {messages: [], controller: null};

function chatMessage(role) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  $("chat-log").appendChild(div);
  return div;
}

async function sendChat(event) {
  event.preventDefault();
  const content = $("chat-input").value.trim();
  if (!content || chat.controller) return;
  if (!info) return askKey();  // nothing answers without the key
  showError("");
  $("chat-input").value = "";
  chat.messages.push({role: "user", content});
  chatMessage("user").textContent = content;
  const reply = chatMessage("assistant");
  const body = reply.appendChild(document.createElement("div"));
  const footer = reply.appendChild(document.createElement("div"));
  footer.className = "footer";
  const plan = $("chat-plan").value.trim(), draft = $("chat-draft").value.trim();
  const label = `plan ${plan || info.plan}` + ((draft || info.draft) ? ` · draft ${draft || info.draft}` : "");
  chat.controller = new AbortController();
  $("chat-send").disabled = true;
  $("chat-stop").disabled = false;
  let text = "";
  try {
    const result = await streamChat({
      model: info.model, messages: chat.messages, max_tokens: Number($("chat-max").value) || undefined,
      temperature: Number($("chat-temp").value), layerplan: extension(plan, draft),
    }, body, (live) => { $("chat-stats").textContent = statsLine(null, live); }, chat.controller.signal);
    text = result.text;
    $("chat-stats").textContent = statsLine(result.usage);
    footer.textContent = `${label} · ${statsLine(result.usage)}`;
  } catch (error) {
    text = body.textContent;  // what came before a stop stays in the conversation
    if (error.name !== "AbortError") showError(error.message);
    footer.textContent = `${label} · ${error.name === "AbortError" ? "stopped" : "failed"}`;
  } finally {
    chat.controller = null;
    $("chat-send").disabled = false;
    $("chat-stop").disabled = true;
  }
  if (text) chat.messages.push({role: "assistant", content: text});
  else chat.messages.pop();  // a request refused outright leaves no turn behind
  $("chat-log").scrollTop = $("chat-log").scrollHeight;
}

// ----- A/B -------------------------------------------------------------------------------------
function commonPrefix(a, b) {
  let n = 0;
  while (n < a.length && n < b.length && a[n] === b[n]) n += 1;
  return n;
}

async function runAB(event) {
  event.preventDefault();
  const prompt = $("ab-input").value.trim();
  if (!prompt) return;
  if (!info) return askKey();
  showError("");
  $("ab-send").disabled = true;
  $("ab-agreement").textContent = "";
  const draft = $("ab-draft").value.trim();
  const texts = {};
  try {
    // one after the other, so that each plan's speed is its own and not a share of a batch's
    for (const side of ["a", "b"]) {
      const plan = $("ab-plan-" + side).value.trim();
      $("ab-label-" + side).textContent = plan || info.plan;
      const out = $("ab-out-" + side), stats = $("ab-stats-" + side);
      out.textContent = "";
      stats.textContent = "";
      const result = await streamChat({
        model: info.model, messages: [{role: "user", content: prompt}], temperature: 0,
        max_tokens: Number($("ab-max").value) || undefined, layerplan: extension(plan, draft),
      }, out, (live) => { stats.textContent = statsLine(null, live); });
      stats.textContent = statsLine(result.usage);
      texts[side] = result.text;
    }
    const same = commonPrefix(texts.a, texts.b), longer = Math.max(texts.a.length, texts.b.length);
    $("ab-agreement").textContent = texts.a === texts.b
      ? `agreement: the same text (${longer} characters)`
      : `agreement: the first ${same} of ${longer} characters (${fmt(longer ? 100 * same / longer : 100, 0)}%), `
        + `then they part: A “${texts.a.slice(same, same + 24)}…” B “${texts.b.slice(same, same + 24)}…”`;
  } catch (error) {
    showError(error.message);
  } finally {
    $("ab-send").disabled = false;
  }
}

// ----- plan builder ----------------------------------------------------------------------------
const builder = {plan: null, steps: [], scan: null, polling: null};

async function readPlan(text, toggle) {
  try {
    const body = {plan: text === undefined || text === "" ? null : text};
    if (toggle) body.toggle = toggle;
    const result = await api("/layerplan/plan", body);
    builder.plan = result.plan;
    builder.steps = result.steps;
    $("builder-plan").value = result.plan;
    showError("");
    drawHeatmap();
  } catch (error) {
    showError(error.message);
  }
}

// white (harmless) through amber to red (damaging), by where log(KL) falls among the scan's
function heat(fraction) {
  const stops = [[255, 255, 255], [253, 196, 80], [200, 30, 30]];
  const x = Math.max(0, Math.min(1, fraction)) * (stops.length - 1), i = Math.min(Math.floor(x), stops.length - 2);
  const mix = stops[i].map((c, k) => Math.round(c + (stops[i + 1][k] - c) * (x - i)));
  return `rgb(${mix.join(",")})`;
}

function drawHeatmap() {
  const items = builder.scan ? builder.scan.items.filter((it) => it.kind === "attention" || it.kind === "mlp") : [];
  const score = new Map(items.map((it) => [it.kind + ":" + it.layer, it]));
  const logs = items.map((it) => Math.log10(Math.max(it.kl, 1e-6)));
  const low = Math.min(...logs), high = Math.max(...logs);
  const table = document.createElement("table");
  const head = table.insertRow();
  head.insertCell().textContent = "layer";
  for (const step of builder.steps) head.insertCell().textContent = step.layer;
  for (const part of ["attention", "mlp"]) {
    const row = table.insertRow();
    row.insertCell().textContent = part === "mlp" ? "MLP" : "attention";
    for (const step of builder.steps) {
      const cell = row.insertCell();
      cell.id = `cell-${part}-${step.step}`;
      cell.className = "cell" + (step[part] ? "" : " off");
      const item = score.get(part + ":" + step.layer);
      if (item) {
        cell.style.background = heat(high > low ? (Math.log10(Math.max(item.kl, 1e-6)) - low) / (high - low) : 0);
        cell.title = `layer ${step.layer} ${part}: KL ${item.kl.toPrecision(3)}, `
          + `perplexity ${item.perplexity_delta >= 0 ? "+" : ""}${item.perplexity_delta.toFixed(3)}, top-1 ${(100 * item.top1_agreement).toFixed(1)}%`;
      } else {
        cell.title = `layer ${step.layer} ${part}: not in the scan`;
      }
      cell.textContent = step[part] ? "" : "✕";
      cell.addEventListener("click", () => readPlan(builder.plan, {step: step.step, part}));
    }
  }
  $("heatmap").replaceChildren(table);
}

function showScan(state) {
  const job = state.job;
  builder.scan = state.scan;
  const bar = $("scan-progress");
  bar.classList.toggle("hidden", job.state !== "running");
  bar.max = job.total || 1;
  bar.value = job.done;
  if (job.state === "running") {
    $("scan-status").textContent = `scanning ${job.tokens} tokens: ${job.done} of ${job.total || "?"} sub-layers`;
  } else if (job.state === "failed") {
    $("scan-status").textContent = `the scan failed: ${job.error}`;
  } else if (state.scan) {
    $("scan-status").textContent = `scan of ${state.scan.model}: ${state.scan.tokens} tokens, base perplexity `
      + `${state.scan.base_perplexity.toFixed(3)}, ${state.scan.items.length} sub-layers in ${state.scan.seconds.toFixed(1)} s`;
  } else {
    $("scan-status").textContent = "no scan of this model yet: run one here, or `layerplan scan` on the server's machine";
  }
  $("scan-run").disabled = job.state === "running";
  drawHeatmap();
  clearTimeout(builder.polling);
  if (job.state === "running") builder.polling = setTimeout(pollScan, 500);
}

async function pollScan() {
  try {
    showScan(await api("/layerplan/scan"));
  } catch (error) {
    showError(error.message);
  }
}

async function runScan() {
  try {
    showScan(await api("/layerplan/scan", {tokens: Number($("scan-tokens").value)}));
  } catch (error) {
    showError(error.message);
  }
}

// ----- the page --------------------------------------------------------------------------------
function show(view) {
  for (const tab of document.querySelectorAll(".tab")) tab.classList.toggle("active", tab.dataset.view === view);
  for (const section of document.querySelectorAll(".view")) section.classList.toggle("hidden", section.id !== "view-" + view);
}

function fillChoices() {
  $("model-name").textContent = `${info.model} · ${info.layers} layers · plan ${info.plan}`
    + (info.draft ? ` · draft ${info.draft}` : "");
  $("plan-choices").replaceChildren(...info.plans.map((p) => new Option(p.name, p.plan)));
  const drafts = info.drafters.filter((d) => d.example);
  $("draft-choices").replaceChildren(...drafts.map((d) => new Option(d.help, d.example)));
  $("plan-help").textContent = info.plan_help;
  $("draft-help").replaceChildren(...info.drafters.map((d) => {
    const li = document.createElement("li");
    li.append(Object.assign(document.createElement("code"), {textContent: d.syntax}), " " + d.help);
    return li;
  }));
}

async function start() {
  try {
    info = await api("/layerplan/info");
  } catch (error) {
    showError(error.message);
    return;
  }
  $("key-form").classList.add("hidden");
  showError("");
  fillChoices();
  await readPlan(info.plan);
  await pollScan();
}

document.addEventListener("DOMContentLoaded", () => {
  for (const tab of document.querySelectorAll(".tab")) tab.addEventListener("click", () => show(tab.dataset.view));
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY, $("key").value);
    start();
  });
  $("chat-form").addEventListener("submit", sendChat);
  $("chat-input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) sendChat(event);
  });
  $("chat-stop").addEventListener("click", () => chat.controller && chat.controller.abort());
  $("chat-reset").addEventListener("click", () => {
    chat.messages = [];
    $("chat-log").replaceChildren();
    $("chat-stats").textContent = "";
  });
  $("ab-form").addEventListener("submit", runAB);
  $("builder-apply").addEventListener("click", () => readPlan($("builder-plan").value.trim()));
  $("builder-plan").addEventListener("keydown", (event) => {
    if (event.key === "Enter") readPlan($("builder-plan").value.trim());
  });
  $("builder-use").addEventListener("click", () => { $("chat-plan").value = builder.plan; show("chat"); });
  $("builder-ab").addEventListener("click", () => { $("ab-plan-b").value = builder.plan; show("ab"); });
  $("scan-run").addEventListener("click", runScan);
  start();
});
