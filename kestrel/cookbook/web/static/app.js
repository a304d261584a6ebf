// The cookbook page: looks up the precomputed recipe and plan for the chosen options (window.COOKBOOK, written
// by kestrel.cookbook.web) and shows them. It computes nothing but number formatting.
"use strict";

const data = window.COOKBOOK;
const FIELDS = ["model", "hardware", "mode", "strategy", "spec", "hicache", "quant"];
const $ = (id) => document.getElementById(id);

function fillSelect(id, values) {
  const select = $(id);
  for (const value of values) {
    const [key, label] = Array.isArray(value) ? value : [String(value), String(value)];
    select.add(new Option(id === "length" ? Number(key).toLocaleString("en-US") : label, key));
  }
}

const gb = (bytes) => (bytes == null ? "unknown" : (bytes / 1e9).toFixed(2) + " GB");
const int = (n) => (n == null ? "unknown" : Number(n).toLocaleString("en-US"));
const rate = (n) => (n == null ? "unknown" : Math.round(n).toLocaleString("en-US"));

function setText(id, text) { $(id).textContent = text; }

function setList(id, items) {
  const list = $(id);
  list.replaceChildren(...items.map((text) => { const li = document.createElement("li"); li.textContent = text; return li; }));
}

function fillRows(tbody, rows) {
  tbody.replaceChildren(...rows.map((cells) => {
    const tr = document.createElement("tr");
    for (const cell of cells) {
      const td = document.createElement("td");
      const [text, cls] = Array.isArray(cell) ? cell : [cell, ""];
      td.textContent = text;
      if (cls) td.className = cls;
      tr.appendChild(td);
    }
    return tr;
  }));
}

function choice() {
  return Object.fromEntries([...FIELDS, "length"].map((f) => [f, $(f).value]));
}

function showCommand(engine, recipe, numbers) {
  const pre = $("cmd-" + engine);
  const command = recipe.commands[engine];
  if (command) {
    const lines = command.lines.map((i) => data.strings[i].replaceAll(data.ratio_placeholder, numbers.ratio));
    pre.textContent = lines.join("\n\n");
    pre.className = "";
  } else {
    pre.textContent = "No command: " + data.strings[recipe.refusals[engine]];
    pre.className = "refused";
  }
  if ($("image-" + engine)) setText("image-" + engine, command && command.image ? "Image: " + command.image : "");
  if ($("notes-" + engine)) setList("notes-" + engine, command ? command.notes.map((i) => data.strings[i]) : []);
}

function showPlan(plan, numbers) {
  setText("ratio", numbers.ratio);
  setText("device", data.strings[plan.device]);
  setText("memory", data.strings[plan.memory]);
  setText("bandwidth", data.strings[plan.bandwidth]);
  const classes = Object.entries(plan.weights_by_class).filter(([, v]) => v).map(([k, v]) => `${k} ${gb(v)}`);
  setText("weights", `${gb(plan.weights_per_gpu)} (${classes.join(", ")})`);
  setText("kv-per-token", `${int(plan.kv_per_token)} B for the whole model; ${int(plan.kv_per_token_per_rank)} B per rank`);
  setText("state-per-slot", `${int(plan.state_per_slot)} B for the whole model; ${int(plan.state_per_slot_per_rank)} B per rank`);
  setText("slots", `S = ${plan.slots_per_request}, D = ${plan.verify_states}`);
  setText("state-slots", int(numbers.state_slots));
  setText("kv-tokens", int(numbers.kv_tokens));
  setText("admitted", int(numbers.admitted));
  setText("fits", (numbers.fits == null ? "unknown" : numbers.fits ? "yes" : "no") + ": " + data.strings[numbers.fit_reason]);
  setText("min-devices", Object.entries(plan.min_devices).map(([d, n]) => `${d} ${n == null ? "unknown" : n}`).join(", "));
  setText("roofline-caption", data.strings[numbers.roofline_caption]);
  fillRows($("roofline").tBodies[0], numbers.roofline.map(([batch, user, gpu, kv, index]) =>
    [String(batch), rate(user), rate(gpu), kv == null ? "—" : int(kv), index == null ? "— (no indexer)" : int(index)]));
  setList("unknowns", plan.unknowns.map((i) => "Unknown: " + data.strings[i]));
  setList("plan-notes", plan.notes.map((i) => data.strings[i]));
}

function update() {
  const c = choice();
  const key = FIELDS.map((f) => c[f]).join("|");
  const index = data.combinations[key];
  const refused = index < 0;
  $("refusal").hidden = !refused;
  $("recipe").hidden = refused;
  $("calculator").hidden = refused;
  if (refused) {
    setText("refusal", "Not offered: " + data.strings[-1 - index]);
    return;
  }
  const recipe = data.recipes[index];
  const plan = data.plans[recipe.plan];
  const numbers = plan.by_length[c.length];
  setText("recipe-id", recipe.id);
  setText("lane", recipe.lane);
  setText("layout", `${plan.layout}, ${recipe.nodes} × ${recipe.per_node}`);
  setText("status", recipe.status || "—");
  for (const engine of ["sglang", "vllm", "kestrel"]) showCommand(engine, recipe, numbers);
  setList("notes-recipe", recipe.notes.map((i) => data.strings[i]));
  showPlan(plan, numbers);
}

function showTables() {
  fillRows($("matrix-table").tBodies[0], data.matrix.map((r) =>
    [r.recipe, r.lane, [r.badge, "badge-" + r.badge.replace(" ", "-")], r.sglang_status || "—",
     r.evidence.length ? `${r.summary} (evidence/${r.evidence[0]})` : ""]));
  fillRows($("ledger-table").tBodies[0], data.ledger.map((r) =>
    [r.claim, r.source || "no public source found", r.conditions, [r.status, "status-" + r.status], r.reason]));
}

function init() {
  for (const field of FIELDS) fillSelect(field, data.options[field]);
  fillSelect("length", data.options.length);
  $("length").value = String(data.default_length);
  for (const field of [...FIELDS, "length"]) $(field).addEventListener("change", update);
  showTables();
  update();
}

init();
