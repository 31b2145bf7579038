// The monitor page: fetches /api/v1/swarm every refresh period and draws models, coverage and servers.
"use strict";

const DEFAULT_REFRESH_MS = 2000;

function el(tag, attrs, children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === "text") node.textContent = value; else node.setAttribute(key, value);
  }
  for (const child of children || []) node.appendChild(child);
  return node;
}

function table(headers, rows) {
  const head = el("tr", {}, headers.map((h) => el("th", { text: h })));
  const body = rows.map((cells) => el("tr", {}, cells.map((c) =>
    Array.isArray(c) ? el("td", { text: c[0], class: c[1] }) : el("td", { text: c === null ? "-" : String(c) }))));
  return el("div", { class: "scroll" }, [el("table", {}, [el("thead", {}, [head]), el("tbody", {}, body)])]);
}

function ranges(blocks) {
  const parts = [];
  for (const b of blocks) {
    const last = parts[parts.length - 1];
    if (last && last[1] === b - 1) last[1] = b; else parts.push([b, b]);
  }
  return parts.map(([a, b]) => (a === b ? `${a}` : `${a}-${b}`)).join(", ");
}

function coverageBar(model) {
  const cells = model.blocks.map((block, index) => {
    const kind = block.servers === 0 ? "gap" : block.servers === 1 ? "one" : "many";
    const title = `block ${index}: ${block.servers} server(s), ${block.throughput} tokens/s`;
    return el("div", { class: `cell ${kind}`, title, "data-block": String(index), "data-servers": String(block.servers) },
      [document.createTextNode(model.blocks.length <= 40 ? String(block.servers) : "")]);
  });
  return el("div", { class: "bar", "data-model": model.name }, cells);
}

function modelCard(model) {
  const verdict = model.complete
    ? el("span", { class: "ok coverage-state", text: "complete" })
    : el("span", { class: "bad coverage-state", text: `missing blocks ${ranges(model.missing_blocks)}` });
  const rows = model.servers.map((s) => [
    s.short_id, `${s.start}:${s.end}`, [s.state, `state-${s.state}`], s.version || "?",
    s.throughput, s.inference_throughput, s.sessions_open,
    s.cache_tokens_left === null ? "?" : `${s.cache_tokens_left} / ${s.cache_tokens_total}`,
    s.last_seen_s === null ? "-" : `${s.last_seen_s} s ago`,
  ]);
  return el("div", { class: "card model" }, [
    el("h2", { text: model.name }),
    el("div", { class: "muted", text: `swarm ${model.dht_prefix}, ${model.num_blocks} blocks, ` }, [verdict]),
    coverageBar(model),
    table(["peer", "blocks", "state", "version", "tokens/s", "decode steps/s", "sessions", "cache free", "last seen"],
      rows),
  ]);
}

function clientCard(client) {
  const route = client.route.map((hop) => [hop.short_id, `${hop.start}:${hop.end}`, hop.step_ms]);
  const recent = client.recent.map((r) => [`${r.age_s} s ago`, r.ttft_ms, r.tokens, r.tokens_per_s, r.outcome]);
  return el("div", { class: "card" }, [
    el("h2", { text: "This API's client" }),
    el("div", { class: "muted", text: "route of its last session" }),
    route.length ? table(["peer", "blocks", "decode step (ms)"], route) : el("p", { class: "muted", text: "no request yet" }),
    el("div", { class: "muted", text: "recent requests" }),
    recent.length ? table(["finished", "first token (ms)", "tokens", "tokens/s", "outcome"], recent)
      : el("p", { class: "muted", text: "none" }),
  ]);
}

function render(snapshot) {
  const models = document.getElementById("models");
  models.replaceChildren(...(snapshot.models.length ? snapshot.models.map(modelCard)
    : [el("div", { class: "card muted", text: "No model is served in this swarm yet." })]));
  const client = document.getElementById("client");
  client.replaceChildren(...(snapshot.client ? [clientCard(snapshot.client)] : []));
  const when = new Date(snapshot.generated_at * 1000).toLocaleTimeString();
  document.getElementById("updated").textContent = `updated ${when}`;
}

async function refresh() {
  let wait = DEFAULT_REFRESH_MS;
  try {
    const response = await fetch("/api/v1/swarm", { cache: "no-store" });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const snapshot = await response.json();
    wait = Math.max(500, 1000 * (snapshot.refresh_s || DEFAULT_REFRESH_MS / 1000));
    render(snapshot);
  } catch (error) {
    document.getElementById("updated").textContent = `cannot reach the server (${error.message}); retrying`;
  }
  setTimeout(refresh, wait);
}

refresh();
