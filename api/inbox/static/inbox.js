/* The approvals inbox: plain JavaScript, no library, served by the API.
   Hooks tests and people may rely on: article[data-approval-id],
   button[data-action="approve"|"reject"|"edit"|"extend"]. */
"use strict";

(function () {
  const meta = document.querySelector('meta[name="csrf-token"]');
  const csrf = meta ? meta.content : "";
  const announcer = document.getElementById("announce");
  /* How long an entry that left the list stays to show its outcome: long
     enough to read (and for a loaded test browser to see), not forever. */
  const OUTCOME_SHOWN_MS = 8000;

  function announce(text) {
    if (announcer) announcer.textContent = text;
  }

  async function post(url, body) {
    let response;
    try {
      response = await fetch(url, {
        method: "POST",
        credentials: "same-origin",
        headers: { "Content-Type": "application/json", "X-CSRF-Token": csrf },
        body: JSON.stringify(body),
      });
    } catch (err) {
      return { ok: false, status: 0, data: { detail: "the server did not answer" } };
    }
    let data = {};
    try {
      data = await response.json();
    } catch (err) {
      data = {};
    }
    return { ok: response.ok, status: response.status, data: data };
  }

  function refusal(result) {
    const detail = (result.data && result.data.detail) || "no reason given";
    if (result.status === 409) {
      if (result.data && result.data.code === "attempt_may_be_running") {
        return "Refused, nothing changed: the attempt may still be running (" + detail +
          "). Try again after " + (result.data.retry_at || "its lease ends") + ".";
      }
      return "Too late, nothing changed: " + detail + ".";
    }
    if (result.status === 404) return "Not found: it is gone or not yours. Nothing changed.";
    if (result.status === 401) return "You are signed out. Sign in again; nothing changed.";
    if (result.status === 403) return "Refused, nothing changed: " + detail + ".";
    if (result.status === 422) return "Not sent, fix this first: " + detail + ".";
    if (result.status === 503) return "Temporal is unavailable, nothing changed: " + detail + ".";
    return "Failed (" + result.status + "), nothing changed: " + detail + ".";
  }

  function say(entry, text, failed) {
    const box = entry.querySelector(".outcome");
    if (!box) return;
    box.textContent = (failed ? "⚠ " : "✔ ") + text;
    box.dataset.result = failed ? "refused" : "done";
    entry.dataset.shownAt = String(Date.now());
    announce(text);
  }

  /* An entry the live list dropped: at once, or, when it shows an outcome
     (a decision made here), once that outcome has been up OUTCOME_SHOWN_MS;
     the stream drops a decided approval within a second of its answer, which
     would otherwise flash the outcome too briefly to read. */
  function leave(entry) {
    if (entry.dataset.leaving === "yes") return;
    entry.dataset.leaving = "yes";
    const shown = Number(entry.dataset.shownAt || 0);
    const wait = shown ? shown + OUTCOME_SHOWN_MS - Date.now() : 0;
    if (wait <= 0) {
      entry.remove();
      announce("An approval left the list (decided or expired).");
      return;
    }
    window.setTimeout(function () { entry.remove(); }, wait);
  }

  function busy(entry, on) {
    entry.querySelectorAll("button, input, select, textarea").forEach(function (el) {
      el.disabled = on;
    });
  }

  /* ---------------------------------------------------------------- countdowns */

  function left(ms) {
    if (ms <= 0) return "expired";
    const s = Math.floor(ms / 1000);
    const h = Math.floor(s / 3600);
    const m = Math.floor((s % 3600) / 60);
    const sec = String(s % 60).padStart(2, "0");
    return "expires in " + (h ? h + "h " + String(m).padStart(2, "0") + "m " : m + "m ") + sec + "s";
  }

  function tick() {
    document.querySelectorAll("time.countdown").forEach(function (el) {
      const at = Date.parse(el.getAttribute("datetime"));
      if (isNaN(at)) return;
      const ms = at - Date.now();
      el.textContent = left(ms) + " (" + new Date(at).toLocaleTimeString() + ")";
      el.dataset.urgent = ms < 5 * 60 * 1000 ? "yes" : "no";
    });
  }

  /* ---------------------------------------------------------------- the live list */

  function fragment(html) {
    const t = document.createElement("template");
    t.innerHTML = html.trim();
    return t.content.firstElementChild;
  }

  function follow(section) {
    const source = new EventSource(section.dataset.live);
    source.addEventListener("pending", function (event) {
      const data = JSON.parse(event.data);
      const keep = new Set(data.ids);
      section.querySelectorAll("article[data-approval-id]").forEach(function (el) {
        if (!keep.has(el.dataset.approvalId)) {
          if (el.dataset.deciding === "yes") {
            /* Our own decision, its answer not here yet: it leaves once its
               outcome has been shown (decide() below). */
            el.dataset.gone = "yes";
            return;
          }
          leave(el);
        }
      });
      let previous = null;
      data.ids.forEach(function (id) {
        let el = section.querySelector('article[data-approval-id="' + CSS.escape(id) + '"]');
        const fresh = fragment(data.html[id]);
        if (!el) {
          el = fresh;
          announce("A new approval: " + el.querySelector(".tool").textContent + ".");
        } else if (el.dataset.expiresAt !== fresh.dataset.expiresAt) {
          el.dataset.expiresAt = fresh.dataset.expiresAt;
          const t = el.querySelector("time.countdown");
          t.setAttribute("datetime", fresh.dataset.expiresAt);
        }
        if (previous) previous.after(el);
        else section.prepend(el);
        previous = el;
      });
      const empty = document.querySelector("p.empty");
      if (empty) empty.hidden = data.ids.length > 0;
      tick();
    });
    source.addEventListener("signed-out", function () {
      source.close();
      window.location.assign("/inbox/login");
    });
  }

  /* ---------------------------------------------------------------- the edit form */

  function resolve(schema, root) {
    if (schema && schema.$ref && schema.$ref.indexOf("#/$defs/") === 0) {
      return (root.$defs || {})[schema.$ref.slice(8)] || {};
    }
    if (schema && schema.anyOf) {
      const real = schema.anyOf.filter(function (s) { return s.type !== "null"; });
      if (real.length === 1) return Object.assign({ nullable: true }, resolve(real[0], root));
    }
    return schema || {};
  }

  function kind(prop) {
    if (prop.enum) return "enum";
    if (prop.type === "string") return "string";
    if (prop.type === "integer" || prop.type === "number") return "number";
    if (prop.type === "boolean") return "boolean";
    return "json";
  }

  function buildEditor(entry, spec) {
    const box = entry.querySelector(".editor");
    const id = entry.dataset.approvalId;
    const props = spec.schema.properties || {};
    const required = new Set(spec.schema.required || []);
    const form = document.createElement("form");
    form.className = "edit-form";
    form.noValidate = true;
    const intro = document.createElement("p");
    intro.className = "help";
    intro.textContent = "Edit the arguments of " + spec.tool_name +
      ". They are checked against the tool's schema here and again by the server.";
    form.appendChild(intro);
    Object.keys(props).forEach(function (name) {
      const prop = resolve(props[name], spec.schema);
      const k = kind(prop);
      const fid = "edit-" + id + "-" + name;
      const row = document.createElement("div");
      row.className = "field";
      const label = document.createElement("label");
      label.htmlFor = fid;
      label.textContent = name + (required.has(name) ? " (required)" : "") +
        (prop.description ? ": " + prop.description : "");
      row.appendChild(label);
      let input;
      const value = spec.arguments[name];
      const secret = spec.redacted.indexOf(name) >= 0;
      if (k === "enum") {
        input = document.createElement("select");
        prop.enum.forEach(function (v) {
          const o = document.createElement("option");
          o.value = JSON.stringify(v);
          o.textContent = String(v);
          input.appendChild(o);
        });
        if (value !== undefined && !secret) input.value = JSON.stringify(value);
      } else if (k === "boolean") {
        input = document.createElement("input");
        input.type = "checkbox";
        input.checked = value === true;
      } else if (k === "json") {
        input = document.createElement("textarea");
        input.rows = 4;
        input.value = value === undefined || secret ? "" : JSON.stringify(value, null, 2);
      } else {
        input = document.createElement("input");
        input.type = k === "number" ? "number" : "text";
        input.value = value === undefined || secret ? "" : String(value);
      }
      input.id = fid;
      input.dataset.name = name;
      input.dataset.kind = k;
      row.appendChild(input);
      if (secret) {
        const note = document.createElement("p");
        note.className = "help";
        note.textContent = "A secret value (shown redacted): enter it again, or the edit is refused.";
        row.appendChild(note);
      }
      form.appendChild(row);
    });
    const errors = document.createElement("div");
    errors.className = "edit-errors";
    errors.setAttribute("role", "alert");
    form.appendChild(errors);
    const diff = document.createElement("div");
    diff.className = "edit-diff";
    diff.setAttribute("aria-live", "polite");
    form.appendChild(diff);
    const review = document.createElement("button");
    review.type = "button";
    review.dataset.action = "review-edit";
    review.textContent = "Review changes";
    form.appendChild(review);
    const send = document.createElement("button");
    send.type = "submit";
    send.dataset.action = "submit-edit";
    send.textContent = "Approve with these edits";
    send.disabled = true;
    form.appendChild(send);
    const cancel = document.createElement("button");
    cancel.type = "button";
    cancel.dataset.action = "cancel-edit";
    cancel.textContent = "Cancel";
    form.appendChild(cancel);
    box.replaceChildren(form);
    box.hidden = false;
    form.addEventListener("input", function () { send.disabled = true; diff.replaceChildren(); });
    review.addEventListener("click", function () { reviewEdit(entry, spec, form); });
    cancel.addEventListener("click", function () {
      box.hidden = true;
      box.replaceChildren();
      entry.querySelector('[data-action="edit"]').setAttribute("aria-expanded", "false");
    });
    form.addEventListener("submit", function (event) {
      event.preventDefault();
      const checked = reviewEdit(entry, spec, form);
      if (checked) decide(entry, { decision: "approved", arguments: checked });
    });
    const first = form.querySelector("input, select, textarea");
    if (first) first.focus();
  }

  function readForm(form, spec) {
    const out = {};
    const problems = [];
    form.querySelectorAll("[data-name]").forEach(function (input) {
      const name = input.dataset.name;
      const k = input.dataset.kind;
      if (k === "boolean") { out[name] = input.checked; return; }
      const raw = input.value;
      if (raw === "" && k !== "string") return;
      if (raw === "" && k === "string" && (spec.schema.required || []).indexOf(name) < 0) return;
      if (k === "enum") { out[name] = JSON.parse(raw); return; }
      if (k === "number") {
        const n = Number(raw);
        if (raw.trim() === "" || isNaN(n)) problems.push(name + ": not a number");
        else out[name] = n;
        return;
      }
      if (k === "json") {
        try { out[name] = JSON.parse(raw); } catch (err) { problems.push(name + ": not valid JSON"); }
        return;
      }
      out[name] = raw;
    });
    return { value: out, problems: problems };
  }

  function typeOf(v) {
    if (v === null) return "null";
    if (Array.isArray(v)) return "array";
    if (typeof v === "number") return Number.isInteger(v) ? "integer" : "number";
    return typeof v;
  }

  function check(value, schema, root, path, problems) {
    const s = resolve(schema, root);
    if (value === null && s.nullable) return;
    if (s.type) {
      const types = Array.isArray(s.type) ? s.type : [s.type];
      const t = typeOf(value);
      if (!types.some(function (w) { return w === t || (w === "number" && t === "integer"); })) {
        problems.push(path + ": must be " + types.join(" or ") + ", not " + t);
        return;
      }
    }
    if (s.enum && !s.enum.some(function (v) { return JSON.stringify(v) === JSON.stringify(value); })) {
      problems.push(path + ": must be one of " + s.enum.join(", "));
    }
    if (typeof value === "string") {
      if (s.minLength !== undefined && value.length < s.minLength) {
        problems.push(path + ": needs at least " + s.minLength + " character(s)");
      }
      if (s.maxLength !== undefined && value.length > s.maxLength) {
        problems.push(path + ": at most " + s.maxLength + " characters");
      }
      if (s.pattern) {
        /* The pattern is the tool's (Python) regex: one this browser cannot
           compile is left to the server, which checks every edit anyway. */
        let re = null;
        try { re = new RegExp(s.pattern, "u"); } catch (err) { re = null; }
        if (re && !re.test(value)) problems.push(path + ": does not match " + s.pattern);
      }
    }
    if (typeof value === "number") {
      if (s.minimum !== undefined && value < s.minimum) problems.push(path + ": at least " + s.minimum);
      if (s.maximum !== undefined && value > s.maximum) problems.push(path + ": at most " + s.maximum);
    }
    if (typeOf(value) === "object") {
      const keys = Object.keys(value);
      if (s.minProperties !== undefined && keys.length < s.minProperties) {
        problems.push(path + ": needs at least " + s.minProperties + " entr" +
          (s.minProperties === 1 ? "y" : "ies"));
      }
      if (s.maxProperties !== undefined && keys.length > s.maxProperties) {
        problems.push(path + ": at most " + s.maxProperties + " entries");
      }
      (s.required || []).forEach(function (r) {
        if (!(r in value)) problems.push((path ? path + "." : "") + r + ": required");
      });
      const props = s.properties || {};
      keys.forEach(function (k) {
        const sub = path ? path + "." + k : k;
        if (props[k]) check(value[k], props[k], root, sub, problems);
        else if (s.additionalProperties === false) problems.push(sub + ": not allowed");
        else if (typeof s.additionalProperties === "object") {
          check(value[k], s.additionalProperties, root, sub, problems);
        }
      });
    }
    if (Array.isArray(value)) {
      if (s.minItems !== undefined && value.length < s.minItems) {
        problems.push(path + ": needs at least " + s.minItems + " item(s)");
      }
      if (s.items) value.forEach(function (v, i) { check(v, s.items, root, path + "." + i, problems); });
    }
  }

  function reviewEdit(entry, spec, form) {
    const errors = form.querySelector(".edit-errors");
    const diff = form.querySelector(".edit-diff");
    const send = form.querySelector('[data-action="submit-edit"]');
    const read = readForm(form, spec);
    const problems = read.problems.slice();
    if (!problems.length) check(read.value, spec.schema, spec.schema, "", problems);
    spec.redacted.forEach(function (name) {
      if (!(name in read.value)) problems.push(name + ": a secret value, enter it again");
    });
    errors.replaceChildren();
    diff.replaceChildren();
    if (problems.length) {
      const p = document.createElement("p");
      p.textContent = "The edit does not fit the tool's schema; nothing was sent:";
      const ul = document.createElement("ul");
      problems.forEach(function (text) {
        const li = document.createElement("li");
        li.textContent = text.replace(/^: /, "(arguments): ");
        ul.appendChild(li);
      });
      errors.append(p, ul);
      send.disabled = true;
      return null;
    }
    const names = new Set(Object.keys(spec.arguments).concat(Object.keys(read.value)));
    const rows = [];
    names.forEach(function (name) {
      const before = spec.arguments[name];
      const after = read.value[name];
      if (JSON.stringify(before) !== JSON.stringify(after)) {
        rows.push([name, before === undefined ? "(absent)" : JSON.stringify(before),
          after === undefined ? "(absent)" : (spec.redacted.indexOf(name) >= 0 ? "[new secret value]" : JSON.stringify(after))]);
      }
    });
    const heading = document.createElement("p");
    heading.textContent = rows.length ? "Changes you are about to approve:" : "No changes.";
    diff.appendChild(heading);
    if (rows.length) {
      const table = document.createElement("table");
      table.className = "diff";
      table.innerHTML = "<thead><tr><th scope='col'>Field</th><th scope='col'>Before</th>" +
        "<th scope='col'>After</th></tr></thead>";
      const body = document.createElement("tbody");
      rows.forEach(function (r) {
        const tr = document.createElement("tr");
        r.forEach(function (c) {
          const td = document.createElement("td");
          td.textContent = c;
          tr.appendChild(td);
        });
        body.appendChild(tr);
      });
      table.appendChild(body);
      diff.appendChild(table);
    }
    send.disabled = false;
    return read.value;
  }

  /* ---------------------------------------------------------------- decisions */

  async function decide(entry, body) {
    const id = entry.dataset.approvalId;
    body.arguments_digest = entry.dataset.digest;
    busy(entry, true);
    entry.dataset.deciding = "yes";
    const result = await post("/inbox/approvals/" + encodeURIComponent(id) + "/decision", body);
    delete entry.dataset.deciding;
    if (result.ok) {
      const edited = body.arguments ? " with your edits" : "";
      say(entry, body.decision === "approved"
        ? "Approved" + edited + ": the write runs now."
        : "Rejected: the seat is told your reason.", false);
    } else {
      busy(entry, false);
      say(entry, refusal(result), true);
    }
    /* The live list dropped it meanwhile: show the outcome, then let it go. */
    if (entry.dataset.gone === "yes") leave(entry);
  }

  async function act(entry, action) {
    const id = entry.dataset.approvalId;
    if (action === "approve") return decide(entry, { decision: "approved" });
    if (action === "reject") {
      const reason = entry.querySelector('[data-field="reason"]');
      if (!reason.value.trim()) {
        say(entry, "Write the reason the seat is told first.", true);
        reason.focus();
        return;
      }
      return decide(entry, { decision: "rejected", reason: reason.value.trim() });
    }
    if (action === "extend") {
      const seconds = Number(entry.querySelector('[data-field="seconds"]').value);
      busy(entry, true);
      const result = await post("/inbox/approvals/" + encodeURIComponent(id) + "/extend",
        { seconds: seconds });
      busy(entry, false);
      if (result.ok) {
        entry.dataset.expiresAt = result.data.expires_at;
        entry.querySelector("time.countdown").setAttribute("datetime", result.data.expires_at);
        tick();
        say(entry, "Extended: it now expires at " +
          new Date(Date.parse(result.data.expires_at)).toLocaleString() + ".", false);
      } else {
        say(entry, refusal(result), true);
      }
      return;
    }
    if (action === "edit") {
      const button = entry.querySelector('[data-action="edit"]');
      const response = await fetch("/inbox/approvals/" + encodeURIComponent(id) + "/edit",
        { credentials: "same-origin" });
      let data = {};
      try { data = await response.json(); } catch (err) { data = {}; }
      if (!response.ok) {
        say(entry, refusal({ status: response.status, data: data }), true);
        return;
      }
      button.setAttribute("aria-expanded", "true");
      buildEditor(entry, data);
    }
  }

  document.addEventListener("click", function (event) {
    const button = event.target.closest("button[data-action]");
    if (!button) return;
    const entry = button.closest("article[data-approval-id]");
    const action = button.dataset.action;
    if (!entry || ["approve", "reject", "extend", "edit"].indexOf(action) < 0) return;
    event.preventDefault();
    act(entry, action);
  });

  /* ---------------------------------------------------------------- reconcile */

  document.addEventListener("submit", async function (event) {
    const form = event.target.closest("form.reconcile");
    if (!form) return;
    event.preventDefault();
    const entry = form.closest("article");
    const outcome = form.querySelector('input[name="outcome"]:checked');
    const note = form.querySelector('input[name="note"]');
    if (!outcome || !note.value.trim()) {
      say(entry, "Choose what happened and write a note first.", true);
      return;
    }
    busy(entry, true);
    const result = await post(
      "/inbox/actions/" + encodeURIComponent(form.dataset.actionId) + "/reconcile",
      { outcome: outcome.value, note: note.value.trim() });
    if (result.ok) {
      say(entry, "Reconciled as " + result.data.status + ": the target is free again.", false);
      entry.dataset.reconciled = result.data.status;
      return;
    }
    busy(entry, false);
    say(entry, refusal(result), true);
  });

  /* ---------------------------------------------------------------- start */

  tick();
  window.setInterval(tick, 1000);
  const live = document.querySelector("#approvals[data-live]");
  if (live && window.EventSource) follow(live);
})();
