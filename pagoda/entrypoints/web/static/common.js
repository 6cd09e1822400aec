// Shared by the playground and the dashboard: the API key (kept in localStorage), authorized
// fetches, and a reader for server-sent events over fetch (EventSource cannot send a key).
"use strict";

const KEY_STORE = "pagoda.apiKey";

function apiKey() {
  return localStorage.getItem(KEY_STORE) || "";
}

function authHeaders(extra = {}) {
  const key = apiKey();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

// fetch() with the key; `model` (when given) goes in the query for GETs, where a
// several-model server reads it.
function api(path, options = {}) {
  return fetch(path, { ...options, headers: authHeaders(options.headers || {}) });
}

// The message of an OpenAI-style error body, or the status line.
async function errorText(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch (_) {
    return `${response.status} ${response.statusText}`;
  }
}

// Calls onEvent(parsed JSON or the "[DONE]" string) for each `data:` event of a streamed response.
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffered = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffered += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffered.indexOf("\n\n")) >= 0) {
      const event = buffered.slice(0, cut);
      buffered = buffered.slice(cut + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
      if (data) onEvent(data === "[DONE]" ? data : JSON.parse(data));
    }
  }
}

// Shows the key form (an element with id "key-form") and resolves once a key is saved.
function askForKey(reason) {
  const form = document.getElementById("key-form");
  const input = document.getElementById("key-input");
  document.getElementById("key-reason").textContent = reason;
  form.hidden = false;
  input.focus();
  return new Promise((resolve) => {
    form.onsubmit = (event) => {
      event.preventDefault();
      localStorage.setItem(KEY_STORE, input.value.trim());
      input.value = "";
      form.hidden = true;
      resolve();
    };
  });
}

function forgetKey() {
  localStorage.removeItem(KEY_STORE);
}

function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}
