// The playground: a conversation with one served model over /v1/chat/completions, streamed.
"use strict";

const $ = (id) => document.getElementById(id);
const conversation = [];  // {role, content} of the turns so far (kept in the page; an image turn's content: parts)
let running = null;  // the answer being streamed: {controller, ...}

async function loadModels() {
  for (;;) {
    const response = await api("/v1/models");
    if (response.status === 401 || response.status === 403) {
      await askForKey(await errorText(response));
      continue;
    }
    if (!response.ok) return showError(await errorText(response));
    const select = $("model");
    const previous = select.value;
    select.innerHTML = "";
    for (const model of (await response.json()).data) {
      select.add(new Option(model.id, model.id));
    }
    if (previous) select.value = previous;
    return;
  }
}

function showError(text) {
  const box = $("error");
  box.textContent = text || "";
  box.hidden = !text;
}

function addMessage(role, text, imageUrl) {
  const box = document.createElement("div");
  box.className = `message ${role}`;
  box.innerHTML = `<div class="role">${role}</div><div class="content"></div>`;
  box.querySelector(".content").textContent = text;
  if (imageUrl) {  // the attached image, shown with the turn it went with
    const img = document.createElement("img");
    img.className = "attached-image";
    img.src = imageUrl;
    img.alt = "attached image";
    box.querySelector(".content").prepend(img);
  }
  $("conversation").append(box);
  box.scrollIntoView({ block: "end" });
  return box;
}

function number(id) {
  const raw = $(id).value.trim();
  return raw === "" ? null : Number(raw);
}

// The request's constraint fields, or throws an Error naming what is wrong with the box.
function constraintFields() {
  const kind = $("constraint-kind").value;
  const text = $("constraint").value.trim();
  if (kind === "none") return {};
  if (kind === "json_object") return { response_format: { type: "json_object" } };
  if (!text) throw new Error(`the ${kind} constraint is empty`);
  if (kind === "json_schema") {
    let schema;
    try { schema = JSON.parse(text); } catch (e) { throw new Error(`the JSON schema is not valid JSON: ${e.message}`); }
    return { response_format: { type: "json_schema", json_schema: { name: "playground", schema } } };
  }
  if (kind === "regex") return { structured_outputs: { regex: text } };
  return { structured_outputs: { choice: text.split("\n").map((s) => s.trim()).filter(Boolean) } };
}

function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...conversation);
  const body = {
    model: $("model").value, messages, stream: true, stream_options: { include_usage: true },
    temperature: number("temperature"), top_p: number("top_p"), top_k: number("top_k"), min_p: number("min_p"),
    repetition_penalty: number("repetition_penalty"), max_tokens: number("max_tokens"), seed: number("seed"),
    ...constraintFields(),
  };
  const stops = $("stop_strings").value.split(",").map((s) => s.trim()).filter(Boolean);
  if (stops.length) body.stop = stops;
  for (const key of Object.keys(body)) if (body[key] === null) delete body[key];
  return body;
}

// Markdown → sanitized HTML, at most once per frame while text streams in. A constrained
// answer is JSON or a pattern's match, shown as a code block.
function render(answer) {
  if (answer.frame) return;
  answer.frame = requestAnimationFrame(() => {
    answer.frame = 0;
    paint(answer);
  });
}

function paint(answer) {
  const source = answer.code ? "```" + answer.code + "\n" + answer.text + "\n```" : answer.text;
  answer.content.innerHTML = DOMPurify.sanitize(marked.parse(source));
  answer.box.dataset.chars = String(answer.text.length);
  if (answer.follow) answer.box.scrollIntoView({ block: "end" });
}

// The last paint, now (a frame render() asked for is dropped): an answer marked done shows all its text.
function flushRender(answer) {
  if (answer.frame) cancelAnimationFrame(answer.frame);
  answer.frame = 0;
  paint(answer);
}

function showFigures(answer, usage, stopped) {
  const ttft = answer.firstAt ? answer.firstAt - answer.sentAt : null;
  const tokens = usage ? usage.completion_tokens : null;
  const decodeSeconds = answer.firstAt ? (answer.endAt - answer.firstAt) / 1000 : 0;
  const rate = tokens > 1 && decodeSeconds > 0 ? (tokens - 1) / decodeSeconds : null;
  const cached = usage && usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : null;
  const parts = [
    ["ttft", ttft === null ? "–" : `${ttft.toFixed(0)} ms`, "TTFT"],
    ["rate", rate === null ? "–" : `${rate.toFixed(1)} tok/s`, ""],
    ["tokens", tokens === null ? "–" : `${tokens} tokens`, ""],
    ["prompt", usage ? `${usage.prompt_tokens} prompt tokens` : "", ""],
    ["cached", cached === null ? "" : `${cached} cached`, ""],
    ["finish", stopped ? "stopped" : answer.finish || "", ""],
  ];
  answer.figures.innerHTML = parts.filter(([, text]) => text)
    .map(([name, text, label]) => `<span class="figure-${name}">${label ? label + " " : ""}${escapeHtml(text)}</span>`)
    .join("");
  answer.box.dataset.done = stopped ? "stopped" : "finished";
}

// The attached image as a data: URL (read when the turn is sent), or "".
function readImage() {
  const file = $("image").files[0];
  if (!file) return Promise.resolve("");
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(new Error(`could not read ${file.name}`));
    reader.readAsDataURL(file);
  });
}

function clearImage() {
  $("image").value = "";
  $("attached").textContent = "";
}

async function send() {
  const text = $("prompt").value;
  if (!text.trim() || running) return;
  let body, imageUrl;
  try {
    imageUrl = await readImage();
  } catch (e) {
    return showError(e.message);
  }
  try {
    // an image goes as OpenAI's image_url part beside the text (the server checks and places it)
    const content = imageUrl ? [{ type: "text", text }, { type: "image_url", image_url: { url: imageUrl } }] : text;
    conversation.push({ role: "user", content });
    body = requestBody();
  } catch (e) {
    conversation.pop();
    return showError(e.message);
  }
  showError("");
  $("prompt").value = "";
  clearImage();
  const userBox = addMessage("user", text, imageUrl);
  const box = addMessage("assistant", "");
  const figures = document.createElement("div");
  figures.className = "figures";
  box.append(figures);
  const kind = $("constraint-kind").value;
  const answer = {
    box, figures, content: box.querySelector(".content"), text: "", frame: 0, follow: true,
    code: kind === "none" ? "" : kind === "regex" || kind === "choice" ? "text" : "json",
    controller: new AbortController(), sentAt: performance.now(), firstAt: 0, endAt: 0, finish: "",
  };
  running = answer;
  $("send").hidden = true;
  $("stop").hidden = false;
  let usage = null, stopped = false, refused = "";
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
      signal: answer.controller.signal,
    });
    if (response.status === 401 || response.status === 403) {
      refused = await errorText(response);
      return;  // asked again below, once this turn is undone
    }
    if (!response.ok) throw new Error(await errorText(response));
    await readEvents(response, (event) => {
      if (event === "[DONE]") return;
      if (event.error) throw new Error(event.error.message);
      if (event.usage) usage = event.usage;
      for (const choice of event.choices || []) {
        const delta = choice.delta && choice.delta.content;
        if (delta) {
          if (!answer.firstAt) answer.firstAt = performance.now();
          answer.text += delta;
          render(answer);
        }
        if (choice.finish_reason) answer.finish = choice.finish_reason;
      }
    });
  } catch (e) {
    if (e.name === "AbortError") stopped = true;
    else showError(e.message);
  } finally {
    answer.endAt = performance.now();
    flushRender(answer);  // before the answer is marked done
    showFigures(answer, usage, stopped);
    if (answer.text) conversation.push({ role: "assistant", content: answer.text });
    else if (!stopped) conversation.pop();  // a failed turn leaves no trace
    running = null;
    $("send").hidden = false;
    $("stop").hidden = true;
  }
  if (refused) {  // the key was missing or wrong: take the turn back, ask, let the user resend
    userBox.remove();
    box.remove();
    await askForKey(refused);
    $("prompt").value = text;  // (the image is to be attached again)
  }
}

// Closing the stream is what stops the request: the server aborts it when the client goes.
function stop() {
  if (running) running.controller.abort();
}

$("composer").addEventListener("submit", (event) => { event.preventDefault(); send(); });
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    send();
  }
});
$("stop").addEventListener("click", stop);
$("image").addEventListener("change", () => {
  const file = $("image").files[0];
  $("attached").textContent = file ? file.name : "";
});
$("clear").addEventListener("click", () => {
  stop();
  conversation.length = 0;
  $("conversation").innerHTML = "";
  showError("");
});
$("change-key").addEventListener("click", async () => {
  forgetKey();
  await askForKey("Enter a key (leave empty for a server without one).");
  loadModels();
});
$("conversation").addEventListener("wheel", () => { if (running) running.follow = false; });
loadModels();
