// The review page: list the queue, open an item, mark it fraud or legitimate, and put
// the card of a confirmed fraud on the blocked_cards list (PUT /v1/lists/..., the lists
// scope: a key without it is told so, and keeps its other rights).
// Plain DOM, no framework, nothing from another origin. Every value from the API is
// put in the page as text (textContent), never as HTML.
"use strict";

const KEY = "fraud-scoring.api-key"; // sessionStorage: this tab only
const PAGE = 50;
const LIST_FEATURES = 4; // key features shown per row (all of them when opened)
const BLOCK_LIST = "blocked_cards"; // the shipped rules file's list of card_id
const $ = (id) => document.getElementById(id);
let offset = 0;
let openId = null;

function headers() {
  const key = sessionStorage.getItem(KEY);
  return key ? { Authorization: "Bearer " + key } : {};
}

function say(text, error = false) {
  const s = $("status");
  s.textContent = text;
  s.classList.toggle("error", error);
}

function problems(body) {
  return (body && body.detail ? body.detail : [])
    .map((p) => (p.field ? p.field + ": " : "") + p.message)
    .join("; ");
}

// One call to the API, relative to the page (so it works under a path prefix).
// Resolves to the JSON body, or null after telling the user what went wrong. A 401, or a
// 403 unless ``forbiddenSays`` (a right this key may lack while the page still works),
// asks for another key.
async function api(path, options = {}, forbiddenSays = false) {
  let r;
  try {
    r = await fetch(path, { ...options, headers: { ...headers(), ...(options.headers || {}) } });
  } catch (e) {
    say("The service did not answer: " + e.message, true);
    return null;
  }
  const body = await r.json().catch(() => null);
  if (r.status === 401 || (r.status === 403 && !forbiddenSays)) {
    askKey(problems(body) || r.statusText);
    return null;
  }
  if (!r.ok) {
    say(r.status + ": " + (problems(body) || r.statusText), true);
    return null;
  }
  $("key-form").hidden = true;
  $("forget-key").hidden = !sessionStorage.getItem(KEY);
  return body;
}

function askKey(why) {
  $("key-why").textContent = why;
  $("key-form").hidden = false;
  $("key").focus();
}

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

// Key features as "name value" chips; a default (missing/stale) is greyed and says so.
function features(list) {
  const td = el("td");
  const chips = el("div", null, "chips");
  for (const f of list) {
    const chip = el("span", f.name + " ", "kf" + (f.flag ? " " + f.flag : ""));
    chip.append(el("b", fmtNum(f.value)));
    if (f.flag) chip.title = f.flag + ": the feature's default";
    chips.append(chip);
  }
  td.append(chips);
  return td;
}

// A value kept to one short line: cut with an ellipsis, the whole of it on hover.
function clipped(tag, text) {
  const e = el(tag, text, "clip");
  e.title = String(text);
  return e;
}

function cardAndMerchant(it) {
  const td = el("td", null, "id");
  td.append(clipped("span", it.card_id), clipped("small", it.merchant_id));
  return td;
}

function fmtTime(iso) {
  return iso.replace("T", " ").replace(/(\.\d+)?(\+00:00|Z)$/, "");
}

function fmtNum(v) {
  if (v === null || v === undefined) return "—";
  return Number.isInteger(v) ? String(v) : Number(v).toPrecision(4).replace(/\.?0+$/, "");
}

function fmtAmount(amount, currency) {
  return amount.toFixed(2) + (currency ? " " + currency : "");
}

async function loadList() {
  const page = await api(`v1/review/items?offset=${offset}&limit=${PAGE}`);
  if (!page) return;
  const body = $("items").tBodies[0];
  body.replaceChildren();
  for (const it of page.items) {
    const tr = el("tr");
    tr.dataset.id = it.transaction_id;
    tr.tabIndex = 0;
    tr.append(
      el("td", fmtTime(it.decided_at).slice(5), "time"),
      el("td", fmtAmount(it.amount, it.currency), "num"),
      cardAndMerchant(it),
      el("td", fmtNum(it.score), "num"),
      el("td", it.reasons.map((r) => r.code).join("\n"), "codes"),
      features(it.key_features.slice(0, LIST_FEATURES)),
    );
    if (it.transaction_id === openId) tr.classList.add("open");
    tr.addEventListener("click", () => openItem(it.transaction_id));
    tr.addEventListener("keydown", (e) => e.key === "Enter" && openItem(it.transaction_id));
    body.append(tr);
  }
  $("total").textContent = `${page.total} queued`;
  $("empty").hidden = page.items.length > 0;
  $("prev").disabled = offset === 0;
  $("next").disabled = offset + page.items.length >= page.total;
}

function row(table, cells) {
  const tr = el("tr");
  for (const [text, cls] of cells) tr.append(el("td", text, cls));
  table.tBodies[0].append(tr);
  return tr;
}

async function openItem(id) {
  // The id in a query parameter: ids may hold "/" or be "..", which a path would lose.
  const d = await api("v1/review/item?transaction_id=" + encodeURIComponent(id));
  if (!d) return;
  openId = id;
  for (const tr of $("items").tBodies[0].rows) tr.classList.toggle("open", tr.dataset.id === id);
  $("detail").hidden = false;
  $("detail").dataset.id = id;
  $("d-title").textContent = `${fmtAmount(d.amount, d.currency)} · card ${d.card_id} · merchant ${d.merchant_id}`;
  const state = d.label
    ? `Labelled ${d.label.label} (${d.label.source}, ${fmtTime(d.label.label_time)}); out of the queue.`
    : "Waiting for review.";
  $("d-state").textContent = state;
  $("d-state").className = d.label ? "labelled " + d.label.label : "";
  $("mark-fraud").disabled = $("mark-legit").disabled = !d.queued;
  const block = $("block-card");
  block.hidden = !(d.label && d.label.label === "fraud");
  block.disabled = false;
  block.dataset.card = d.card_id;

  const dl = $("d-txn");
  dl.replaceChildren();
  const facts = [
    ["transaction", d.transaction_id],
    ["event time", d.event_time],
    ["decided (UTC)", fmtTime(d.decided_at)],
    ["country / channel / MCC", `${d.country} / ${d.channel} / ${d.mcc}`],
    ["device", d.device_id || "—"],
    ["score", fmtNum(d.score)],
    ["model", d.model_version],
    ["missing / stale", [d.missing.join(", ") || "—", d.stale.join(", ") || "—"].join(" / ")],
  ];
  // the team's declared fields (a PII one as its hash's prefix: the service never has more)
  for (const [k, v] of Object.entries(d.fields || {})) facts.push([k, v === null ? "—" : String(v)]);
  for (const [k, v] of facts) dl.append(el("dt", k), el("dd", v));

  const reasons = $("d-reasons");
  reasons.replaceChildren(...d.reasons.map((r) => {
    const li = el("li");
    li.append(el("code", r.code), document.createTextNode(" " + r.message));
    return li;
  }));

  $("d-key").tBodies[0].replaceChildren();
  for (const f of d.key_features) {
    row($("d-key"), [[f.name], [fmtNum(f.value), "num"], [f.flag ? f.flag + " (default)" : "", "flag"]]);
  }

  const hist = $("d-history");
  hist.tBodies[0].replaceChildren();
  if (d.card_history === null) {
    row(hist, [["the online store did not answer"]]);
  } else if (d.card_history.length === 0) {
    row(hist, [["no recent transactions in the session state"]]);
  }
  for (const h of d.card_history || []) {
    const tr = row(hist, [
      [fmtTime(h.event_time)],
      [fmtAmount(h.amount), "num"],
      [h.merchant_id],
      [h.country],
      [h.transaction_id],
    ]);
    if (h.transaction_id === d.transaction_id) tr.classList.add("open");
  }

  $("d-features").tBodies[0].replaceChildren();
  for (const [k, v] of Object.entries(d.features)) row($("d-features"), [[k], [fmtNum(v), "num"]]);
}

async function mark(label) {
  const id = $("detail").dataset.id;
  if (!id) return;
  $("mark-fraud").disabled = $("mark-legit").disabled = true;
  const out = await api("v1/review/label", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ transaction_id: id, label }),
  });
  if (!out) {
    $("mark-fraud").disabled = $("mark-legit").disabled = false;
    return;
  }
  say(`${id} marked ${label}` + (out.duplicate ? " (already labelled by an analyst)" : "") + ".");
  await openItem(id);
  await loadList();
}

// The open item's card onto the block list, as this key, naming the transaction.
async function blockCard() {
  const id = $("detail").dataset.id;
  const card = $("block-card").dataset.card;
  if (!id || !card) return;
  $("block-card").disabled = true;
  const out = await api(`v1/lists/${BLOCK_LIST}/items`, {
    method: "PUT",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ items: [{ value: card, reason: `confirmed fraud ${id}` }] }),
  }, true);
  if (!out) {
    $("block-card").disabled = false;
    return;
  }
  say(`card ${card} ` + (out.changed ? "added to " : "was on ") + `${BLOCK_LIST}` +
    (out.changed ? "" : " already (its reason renewed)") + ".");
}

document.addEventListener("DOMContentLoaded", () => {
  $("refresh").addEventListener("click", () => { say(""); loadList(); });
  $("prev").addEventListener("click", () => { offset = Math.max(0, offset - PAGE); loadList(); });
  $("next").addEventListener("click", () => { offset += PAGE; loadList(); });
  $("mark-fraud").addEventListener("click", () => mark("fraud"));
  $("mark-legit").addEventListener("click", () => mark("legitimate"));
  $("block-card").addEventListener("click", blockCard);
  $("forget-key").addEventListener("click", () => {
    sessionStorage.removeItem(KEY);
    location.reload();
  });
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    sessionStorage.setItem(KEY, $("key").value.trim());
    $("key").value = "";
    say("");
    loadList();
  });
  loadList();
});
