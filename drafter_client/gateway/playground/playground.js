// The specdec playground: one page over the gateway's own API. It streams an answer with the
// `specdec` request extension ({"blocks": true}), so every chunk carries the verified block it
// came from (`specdec_block`: k, accepted, times, each token's text and kind), and colours each
// token by how it came. Model output only ever enters the page as text (textContent), never as
// HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const KINDS = new Set(["accepted", "recovered", "bonus", "target"]);

const state = {
  settings: null,      // GET /v1/specdec/settings
  history: [],         // the chat so far: [{role, content}]
  controller: null,    // the running request's AbortController
};

// -- talking to the gateway ----------------------------------------------------------------

function headers() {
  const h = {"Content-Type": "application/json"};
  const key = $("api-key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

// The gateway's own message for a failed request (OpenAI's error shape), with its status.
async function errorOf(response) {
  const text = await response.text();
  try {
    const error = JSON.parse(text).error;
    if (error && error.message) return `${response.status}: ${error.message}`;
  } catch (_) { /* not JSON: the raw text below */ }
  return `${response.status}: ${text || response.statusText}`;
}

function showError(message) {
  const box = $("error");
  box.textContent = message || "";
  box.hidden = !message;
}

async function loadSettings() {
  let response;
  try {
    response = await fetch("/v1/specdec/settings", {headers: headers()});
  } catch (e) {
    showError(`the gateway did not answer: ${e.message}`);
    return false;
  }
  if (!response.ok) {
    showError(await errorOf(response));
    $("about").textContent = "not connected";
    return false;
  }
  const s = await response.json();
  const first = state.settings === null;
  state.settings = s;
  $("about").textContent = `${s.model}: verifier ${s.verifier_model}, context ` +
    `${s.max_context}, kernels ${s.kernels || "unknown"}\nclient: ${s.drafter}`;
  if (first) {  // the client's defaults, once; what the user typed afterwards stays
    $("k").value = String(s.k);
    $("temperature").value = s.sampling.temperature;
    $("top-p").value = s.sampling.top_p;
    $("top-k").value = s.sampling.top_k;
    $("max-tokens").value = s.sampling.max_tokens;
    $("seed").value = s.sampling.seed;
  }
  showError("");
  return true;
}

function number(id, parse) {
  const raw = $(id).value.trim();
  if (raw === "") return undefined;
  const value = parse(raw);
  return Number.isNaN(value) ? raw : value;  // not a number: the gateway's 400 names the field
}

// The request for `prompt` (a chat turn or a completion prompt) from the form.
function requestBody(prompt, targetAlone) {
  const body = {
    model: state.settings.model, stream: true, stream_options: {include_usage: true},
    temperature: number("temperature", parseFloat), top_p: number("top-p", parseFloat),
    top_k: number("top-k", (v) => parseInt(v, 10)),
    max_tokens: number("max-tokens", (v) => parseInt(v, 10)),
    seed: number("seed", (v) => parseInt(v, 10)),
    specdec: {blocks: true, target_alone: targetAlone},
  };
  const k = $("k").value.trim();
  if (k !== "") body.specdec.k = /^\d+$/.test(k) ? parseInt(k, 10) : k;
  if ($("mode").value === "chat") {
    body.messages = [...state.history, {role: "user", content: prompt}];
    const schema = $("schema").value.trim();
    if (schema !== "") {
      let parsed;
      try {
        parsed = JSON.parse(schema);
      } catch (e) {
        throw new Error(`JSON schema: not JSON (${e.message})`);
      }
      body.response_format = {type: "json_schema",
        json_schema: {name: "playground", schema: parsed, strict: true}};
    }
    const prediction = $("prediction").value;
    if (prediction.trim() !== "") body.prediction = {type: "content", content: prediction};
  } else {
    body.prompt = prompt;
  }
  return body;
}

// POST the request and hand every event of its server-sent stream to `onEvent`.
async function stream(body, onEvent, signal) {
  const path = body.messages ? "/v1/chat/completions" : "/v1/completions";
  const response = await fetch(path, {method: "POST", headers: headers(),
                                      body: JSON.stringify(body), signal});
  if (!response.ok) throw new Error(await errorOf(response));
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) throw new Error("the stream ended before [DONE]");
    buffer += decoder.decode(value, {stream: true});
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        const payload = JSON.parse(data);
        if (payload.error) throw new Error(payload.error.message);
        onEvent(payload);
      }
    }
  }
}

// -- one answer, token by token -------------------------------------------------------------

class Answer {
  constructor(element) {
    this.element = element;
    this.started = performance.now();
    this.seconds = 0;
    this.tokens = 0;
    this.blocks = 0;
    this.drafted = 0;
    this.accepted = 0;
    this.draftBlocks = 0;
    this.text = "";
    this.lastToken = null;
    this.metrics = null;  // the last chunk's `specdec` metrics
    this.usage = null;
    this.finish = null;
  }

  event(payload) {
    if (payload.usage) this.usage = payload.usage;
    if (payload.specdec) this.metrics = payload.specdec;
    const choice = payload.choices && payload.choices[0];
    if (payload.specdec_block) {
      this.block(payload.specdec_block);
    } else if (choice) {  // text after the last block: the last token's
      const piece = choice.delta ? (choice.delta.content || "") : (choice.text || "");
      if (piece) this.loose(piece);
    }
    if (choice && choice.finish_reason) this.finish = choice.finish_reason;
    this.seconds = (performance.now() - this.started) / 1000;
  }

  block(b) {
    const span = document.createElement("span");
    span.className = "block";
    const label = `block ${b.index + 1}: k ${b.k}, accepted ${b.accepted}, round trip ` +
      `${b.round_trip_ms.toFixed(1)} ms (verifier ${b.verifier_ms.toFixed(1)} ms)`;
    span.title = label;
    span.dataset.k = b.k;
    span.dataset.accepted = b.accepted;
    span.dataset.roundTripMs = b.round_trip_ms;
    span.addEventListener("mouseenter", () => { $("hover").textContent = label; });
    for (const [text, kind] of b.tokens) {
      const token = document.createElement("span");
      token.className = "tok " + (KINDS.has(kind) ? kind : "target");
      token.textContent = text;
      span.appendChild(token);
      this.lastToken = token;
      this.text += text;
      this.tokens += 1;
    }
    const box = $("transcript");
    const following = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
    this.element.appendChild(span);
    if (following && this.element.isConnected) box.scrollTop = box.scrollHeight;
    this.blocks += 1;
    if (b.k > 0) {
      this.drafted += b.k;
      this.accepted += b.accepted;
      this.draftBlocks += 1;
    }
  }

  loose(piece) {
    if (this.lastToken === null) {
      this.lastToken = document.createElement("span");
      this.lastToken.className = "tok target";
      this.element.appendChild(this.lastToken);
    }
    this.lastToken.textContent += piece;
    this.text += piece;
  }

  showFigures() {
    const m = this.metrics;
    $("fig-tokens").textContent = this.tokens;
    $("fig-time").textContent = `${this.seconds.toFixed(2)} s`;
    $("fig-rate").textContent = this.seconds > 0 ? (this.tokens / this.seconds).toFixed(1) : "-";
    const rate = m ? m.acceptance_rate : (this.drafted ? this.accepted / this.drafted : null);
    $("fig-acceptance").textContent = rate === null || rate === undefined || !this.drafted
      ? "no drafts" : `${(100 * rate).toFixed(1)}%`;
    $("fig-mean").textContent = this.draftBlocks
      ? (this.accepted / this.draftBlocks).toFixed(2) : "-";
    $("fig-calls").textContent = m ? m.verify_calls : this.blocks;
    const details = this.usage && this.usage.completion_tokens_details;
    $("fig-prediction").textContent = details
      ? `${details.accepted_prediction_tokens} of ` +
        `${details.accepted_prediction_tokens + details.rejected_prediction_tokens} drafted`
      : "-";
  }
}

// -- the page -------------------------------------------------------------------------------

function busy(running) {
  $("send").disabled = running;
  $("race").disabled = running;
  $("stop").disabled = !running;
}

function newTurn(prompt) {
  const turn = document.createElement("div");
  turn.className = "turn";
  const asked = document.createElement("div");
  asked.className = "user";
  asked.textContent = prompt;
  const answer = document.createElement("div");
  answer.className = "answer";
  turn.append(asked, answer);
  $("transcript").appendChild(turn);
  return answer;
}

// One streamed request into `element`; returns the Answer ("done" says how it ended).
async function run(body, element) {
  const answer = new Answer(element);
  const controller = new AbortController();
  state.controller = controller;
  const timer = setInterval(() => {
    answer.seconds = (performance.now() - answer.started) / 1000;
    if (element.isConnected) answer.showFigures();
  }, 250);
  try {
    await stream(body, (payload) => {
      answer.event(payload);
      if (element.isConnected) answer.showFigures();
    }, controller.signal);
    answer.done = answer.finish || "stop";
  } catch (e) {
    answer.done = controller.signal.aborted ? "stopped" : "error";
    if (!controller.signal.aborted) showError(e.message);
  } finally {
    clearInterval(timer);
    state.controller = null;
    answer.seconds = (performance.now() - answer.started) / 1000;
    element.dataset.done = answer.done;
  }
  if (element.isConnected) answer.showFigures();
  return answer;
}

async function ask(racing) {
  const prompt = $("prompt").value;
  if (!prompt.trim() || state.controller !== null) return;
  showError("");
  if (state.settings === null && !(await loadSettings())) return;
  busy(true);
  $("race-result").hidden = !racing;
  try {
    // both legs of a race ask the same: built before this turn joins the conversation
    let targetBody, specBody;
    try {
      targetBody = requestBody(prompt, true);
      specBody = requestBody(prompt, false);
    } catch (e) {  // a box the page can check itself (the schema is not JSON)
      showError(e.message);
      return;
    }
    const spec = await run(specBody, newTurn(prompt));
    if (spec.done === "error") return;
    if (spec.done !== "stopped" && $("mode").value === "chat") {
      state.history.push({role: "user", content: prompt}, {role: "assistant", content: spec.text});
    }
    $("prompt").value = "";
    if (racing && spec.done !== "stopped") await raceTarget(targetBody, spec);
  } finally {
    busy(false);
    $("prompt").focus();
  }
}

// The race's second leg: the same request with the target alone, then both times.
async function raceTarget(body, spec) {
  $("race-spec").textContent = `${spec.seconds.toFixed(2)} s, ${spec.tokens} tokens`;
  $("race-target").textContent = "running...";
  $("race-speedup").textContent = "-";
  $("race-identical").textContent = "-";
  const holder = document.createElement("div");  // not shown: the text goes to race-text
  const target = await run(body, holder);
  $("race-text").textContent = target.text;
  if (target.done === "stopped" || target.done === "error") {
    $("race-target").textContent = target.done;
    return;
  }
  $("race-target").textContent = `${target.seconds.toFixed(2)} s, ${target.tokens} tokens`;
  $("race-speedup").textContent = `${(target.seconds / spec.seconds).toFixed(2)}x`;
  const comparable = body.temperature === 0 || body.seed !== undefined;
  if (!comparable) {
    $("race-identical").textContent = "sampled without a seed: not comparable";
  } else {
    $("race-identical").textContent = identity(spec.text, target.text);
  }
}

// "identical", or where two answers part.
function identity(a, b) {
  if (a === b) return "identical";
  let at = 0;
  while (at < a.length && a[at] === b[at]) at += 1;
  return `differ from character ${at}`;
}

function stop() {
  if (state.controller !== null) state.controller.abort();
}

function reset() {
  stop();
  state.history = [];
  $("transcript").replaceChildren();
  $("race-result").hidden = true;
  showError("");
}

document.addEventListener("DOMContentLoaded", () => {
  $("api-key").value = sessionStorage.getItem("specdec-api-key") || "";
  $("api-key").addEventListener("change", () => {
    sessionStorage.setItem("specdec-api-key", $("api-key").value);
    loadSettings();
  });
  $("ask").addEventListener("submit", (e) => { e.preventDefault(); ask(false); });
  $("race").addEventListener("click", () => ask(true));
  $("stop").addEventListener("click", stop);
  $("reset").addEventListener("click", reset);
  $("mode").addEventListener("change", reset);
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      ask(false);
    } else if (e.key === "Escape") {
      stop();
    }
  });
  busy(false);
  loadSettings();
});
