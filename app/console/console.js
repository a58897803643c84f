// llmq console: batches, their lines, jobs and their streams, read from the llmq API.
//
// Plain browser JavaScript, no dependencies and no build step. Rules it keeps:
// - The API key lives in this tab's sessionStorage and travels only in the Authorization
//   header of fetch() calls; it is never put in a URL (so the stream is read with fetch and a
//   ReadableStream reader, not EventSource, which cannot send headers).
// - Text from the API (ids, custom ids, prompts, completions, error messages) is only ever
//   written with textContent or text nodes; the page's Content-Security-Policy requires
//   Trusted Types, so an innerHTML assignment would throw anyway.
// - Every view owns an AbortController: leaving it stops its timers, requests and streams.
"use strict";

(() => {
  const STORAGE_KEY = "llmq.console.key";
  const POLL_MS = 1500;
  const CHART_MS = 10000;
  const CHART_WIDTH = 1200; // the chart's own units (its viewBox): about its size on screen
  const CHART_HEIGHT = 190;
  const REPLAY_MS = 25; // between events when a finished stream is replayed
  const PAGE = 20;
  const LINE_PAGE = 50;
  // The console is served at <api>/console/, so the API is one level up (this also holds
  // behind a proxy that mounts the API under a path).
  const API_ROOT = new URL("../", document.baseURI);
  const JOB_STATUSES = ["queued", "running", "succeeded", "failed", "cancelled", "expired"];
  const BATCH_ACTIVE = ["validating", "in_progress", "finalizing", "cancelling"];
  const JOB_ACTIVE = ["queued", "running"];

  const $ = (id) => document.getElementById(id);
  const enc = encodeURIComponent;

  // --- DOM -----------------------------------------------------------------------------

  /** An element; `props` are attributes, except `text` (textContent), `class` and `on*`
   * (listeners). Children are nodes or strings (added as text nodes, never parsed). */
  function h(tag, props = {}, ...children) {
    const node = document.createElement(tag);
    setProps(node, props);
    add(node, children);
    return node;
  }

  function svg(tag, props = {}, ...children) {
    const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
    setProps(node, props);
    add(node, children);
    return node;
  }

  function setProps(node, props) {
    for (const [name, value] of Object.entries(props)) {
      if (value === null || value === undefined || value === false) continue;
      if (name === "text") node.textContent = String(value);
      else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
      else node.setAttribute(name, value === true ? "" : String(value));
    }
  }

  function add(node, children) {
    for (const child of children.flat()) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
  }

  /** Replaces a node's children (nulls skipped, strings as text). */
  function fill(node, ...children) {
    node.replaceChildren();
    add(node, children);
  }

  function setText(node, value) {
    const text = value === null || value === undefined ? "" : String(value);
    if (node.textContent !== text) node.textContent = text;
  }

  function statusBadge(status) {
    return h("span", { class: `status status-${status}`, text: status.replace("_", " ") });
  }

  function setStatus(node, status) {
    node.className = `status status-${status}`;
    setText(node, status.replace("_", " "));
  }

  function link(href, text, props = {}) {
    return h("a", { href, ...props, text });
  }

  function facts(pairs) {
    const dl = h("dl", { class: "facts" });
    for (const [name, value] of pairs) {
      if (value === null || value === undefined || value === "") continue;
      dl.append(h("dt", { text: name }), h("dd", {}, value));
    }
    return dl;
  }

  // --- formatting ----------------------------------------------------------------------

  const two = (n) => String(n).padStart(2, "0");

  function fmtTime(unix) {
    if (!unix) return "";
    const d = new Date(unix * 1000);
    return `${d.getFullYear()}-${two(d.getMonth() + 1)}-${two(d.getDate())} ` +
      `${two(d.getHours())}:${two(d.getMinutes())}:${two(d.getSeconds())}`;
  }

  function fmtSeconds(seconds) {
    if (seconds === null || seconds === undefined) return "—";
    const s = Math.max(0, Math.round(seconds));
    if (s < 60) return `${s} s`;
    if (s < 3600) return `${Math.floor(s / 60)} min ${two(s % 60)} s`;
    return `${Math.floor(s / 3600)} h ${two(Math.floor((s % 3600) / 60))} min`;
  }

  function fmtNumber(n, digits = 0) {
    if (n === null || n === undefined) return "—";
    return Number(n).toLocaleString("en-US", { maximumFractionDigits: digits });
  }

  function endedAt(job) {
    return job.succeeded_at || job.failed_at || job.cancelled_at || job.expired_at || null;
  }

  function jobDuration(job) {
    const end = endedAt(job);
    return job.started_at && end ? end - job.started_at : null;
  }

  // --- the API -------------------------------------------------------------------------

  class ApiError extends Error {
    constructor(status, error) {
      super(error.message || `HTTP ${status}`);
      this.name = "ApiError";
      this.status = status;
      this.type = error.type || null;
      this.code = error.code || null;
      this.param = error.param || null;
    }
  }

  async function toApiError(response) {
    let body = null;
    try {
      body = await response.json();
    } catch {
      body = null;
    }
    return new ApiError(response.status, (body && body.error) || {});
  }

  function currentKey() {
    return sessionStorage.getItem(STORAGE_KEY);
  }

  /** A call to the API with the tab's key; throws ApiError for any non-2xx answer. */
  async function api(path, { method = "GET", signal, headers = {}, key = currentKey() } = {}) {
    const response = await fetch(new URL(path, API_ROOT), {
      method,
      signal,
      cache: "no-store",
      credentials: "omit",
      headers: { Accept: "application/json", ...headers, Authorization: `Bearer ${key}` },
    });
    if (!response.ok) throw await toApiError(response);
    return response;
  }

  async function apiJson(path, options) {
    return (await api(path, options)).json();
  }

  function isAbort(err) {
    return err && err.name === "AbortError";
  }

  // --- notices, sign in and out ----------------------------------------------------------

  function notice(message, bad = false) {
    const node = $("notice");
    node.hidden = !message;
    node.className = bad ? "notice bad" : "notice";
    setText(node, message || "");
  }

  /** What a failed call means to the user. A refused key ends the session. */
  function report(err) {
    if (isAbort(err)) return;
    if (err instanceof ApiError && err.status === 401) {
      signOut(`The API key was refused: ${err.message}`);
      return;
    }
    notice(err instanceof ApiError ? err.message : `The API could not be reached (${err.message})`, true);
  }

  function signOut(message = "") {
    sessionStorage.removeItem(STORAGE_KEY);
    route();
    setText($("sign-in-error"), message);
  }

  async function signIn(event) {
    event.preventDefault();
    const input = $("key-input");
    const key = input.value.trim();
    const button = $("sign-in-button");
    setText($("sign-in-error"), "");
    if (!key) return;
    button.disabled = true;
    try {
      // Any valid key may list its own batches: the cheapest check that the key works.
      await api("v1/batches?limit=1", { key });
      sessionStorage.setItem(STORAGE_KEY, key);
      input.value = "";
      route();
    } catch (err) {
      setText(
        $("sign-in-error"),
        err instanceof ApiError ? `Sign-in failed: ${err.message}` : `The API could not be reached (${err.message})`,
      );
    } finally {
      button.disabled = false;
    }
  }

  // --- views and routing ---------------------------------------------------------------

  let viewController = null;

  /** Runs `fn` now and then every `ms` until the signal aborts or `fn` returns "stop". A
   * 404 (the object is not this key's, or no longer exists) stops it and calls `gone`. */
  function every(ms, signal, fn, gone = null) {
    let timer = null;
    const tick = async () => {
      if (signal.aborted) return;
      let result = null;
      try {
        result = await fn();
      } catch (err) {
        report(err);
        if (err instanceof ApiError && err.status === 404 && gone) gone(err);
        if (err instanceof ApiError && (err.status === 401 || err.status === 404)) return;
      }
      if (!signal.aborted && result !== "stop") timer = setTimeout(tick, ms);
    };
    signal.addEventListener("abort", () => clearTimeout(timer));
    tick();
  }

  function sleep(ms, signal) {
    return new Promise((resolve) => {
      const timer = setTimeout(resolve, ms);
      signal.addEventListener("abort", () => {
        clearTimeout(timer);
        resolve();
      });
    });
  }

  function parseHash() {
    const [path, query] = location.hash.replace(/^#\/?/, "").split("?");
    let parts = [];
    try {
      parts = path.split("/").filter(Boolean).map(decodeURIComponent);
    } catch {
      parts = [];
    }
    return { parts, params: new URLSearchParams(query || "") };
  }

  function route() {
    if (viewController) viewController.abort();
    viewController = new AbortController();
    const signal = viewController.signal;
    const view = $("view");
    view.replaceChildren();
    notice("");
    const key = currentKey();
    $("sign-in").hidden = Boolean(key);
    $("view").hidden = !key;
    $("nav").hidden = !key;
    $("sign-out").hidden = !key;
    setText($("who"), key ? `key ${key.slice(0, 9)}…` : "");
    if (!key) {
      $("key-input").focus();
      return;
    }
    const { parts, params } = parseHash();
    const section = parts[0] === "jobs" ? "jobs" : "batches";
    for (const a of $("nav").querySelectorAll("a")) {
      a.classList.toggle("current", a.dataset.section === section);
    }
    if (parts[0] === "batches" && parts[1]) batchView(view, parts[1], params, signal);
    else if (parts[0] === "jobs" && parts[1]) jobView(view, parts[1], signal);
    else if (parts[0] === "jobs") jobsView(view, params, signal);
    else batchesView(view, params, signal);
  }

  function pager(base, params, page) {
    const bar = h("div", { class: "toolbar pager" });
    const newest = new URLSearchParams(params);
    newest.delete("after");
    const older = new URLSearchParams(params);
    if (page.last_id) older.set("after", page.last_id);
    if (params.get("after")) bar.append(link(`${base}?${newest}`, "← Newest", { id: "page-newest" }));
    if (page.has_more) bar.append(link(`${base}?${older}`, "Older →", { id: "page-older" }));
    return bar;
  }

  // --- batch actions -------------------------------------------------------------------

  async function download(fileId, filename, button) {
    button.disabled = true;
    try {
      const response = await api(`v1/files/${enc(fileId)}/content`, { headers: { Accept: "*/*" } });
      const url = URL.createObjectURL(await response.blob());
      const a = h("a", { href: url, download: filename, hidden: true });
      document.body.append(a);
      a.click();
      a.remove();
      setTimeout(() => URL.revokeObjectURL(url), 60000);
    } catch (err) {
      report(err);
    } finally {
      button.disabled = false;
    }
  }

  async function cancelBatch(id, after) {
    if (!window.confirm(`Cancel batch ${id}? Lines already finished are kept.`)) return;
    try {
      const batch = await apiJson(`v1/batches/${enc(id)}/cancel`, { method: "POST" });
      notice(`Batch ${batch.id} is ${batch.status.replace("_", " ")}.`);
      if (after) after(batch);
    } catch (err) {
      report(err);
    }
  }

  async function retryBatch(id) {
    try {
      const child = await apiJson(`v1/batches/${enc(id)}/retry`, { method: "POST" });
      location.hash = `#/batches/${enc(child.id)}`;
    } catch (err) {
      report(err);
    }
  }

  function batchDone(batch) {
    const p = batch.x_progress;
    return p.succeeded + p.failed + p.cancelled + p.expired;
  }

  function canRetry(batch) {
    return !BATCH_ACTIVE.includes(batch.status) && batch.request_counts.failed > 0;
  }

  /** A progress bar and its label ("12 / 40 · 30 %"), updated in place. */
  function progressCell() {
    const bar = h("progress", { max: 1, value: 0 });
    const label = h("span", { class: "progress-label" });
    return {
      node: h("span", { class: "progress" }, bar, label),
      update(batch) {
        const total = batch.request_counts.total;
        const done = batchDone(batch);
        bar.max = Math.max(total, 1);
        bar.value = done;
        const pct = total ? Math.floor((100 * done) / total) : 0;
        bar.dataset.percent = String(pct);
        setText(label, `${fmtNumber(done)} / ${fmtNumber(total)} · ${pct} %`);
      },
    };
  }

  /** The buttons of a batch: output and error downloads, cancel, retry. */
  function batchControls(onChange) {
    let batch = null;
    const output = h("button", { type: "button", class: "secondary download-output", text: "Output" });
    const errors = h("button", { type: "button", class: "secondary download-errors", text: "Errors" });
    const cancel = h("button", { type: "button", class: "danger cancel-batch", text: "Cancel" });
    const retry = h("button", { type: "button", class: "secondary retry-batch", text: "Retry failed" });
    output.addEventListener("click", () => download(batch.output_file_id, `${batch.id}_output.jsonl`, output));
    errors.addEventListener("click", () => download(batch.error_file_id, `${batch.id}_errors.jsonl`, errors));
    cancel.addEventListener("click", () => cancelBatch(batch.id, onChange));
    retry.addEventListener("click", () => retryBatch(batch.id));
    return {
      files: [output, errors],
      actions: [cancel, retry],
      update(next) {
        batch = next;
        output.hidden = !batch.output_file_id;
        errors.hidden = !batch.error_file_id;
        cancel.hidden = !["validating", "in_progress"].includes(batch.status);
        retry.hidden = !canRetry(batch);
      },
    };
  }

  // --- the batches page ----------------------------------------------------------------

  function batchRow(onChange) {
    const idLink = h("a", { class: "mono batch-link" });
    const status = h("span");
    const progress = progressCell();
    const counts = h("span", { class: "counts" });
    const rate = h("td", { class: "num tokens-per-second" });
    const eta = h("td", { class: "num eta" });
    const created = h("td", { class: "muted" });
    const controls = batchControls(onChange);
    const tr = h(
      "tr",
      { class: "batch-row" },
      h("td", {}, idLink),
      h("td", {}, status),
      h("td", {}, progress.node),
      h("td", {}, counts),
      rate,
      eta,
      created,
      h("td", {}, controls.files),
      h("td", {}, controls.actions),
    );
    return {
      tr,
      update(batch) {
        tr.dataset.batchId = batch.id;
        idLink.href = `#/batches/${enc(batch.id)}`;
        setText(idLink, batch.id);
        setStatus(status, batch.status);
        progress.update(batch);
        const p = batch.x_progress;
        setText(counts, `${p.succeeded} ok · ${batch.request_counts.failed} failed · ${p.queued + p.running} to go`);
        setText(rate, batch.x_output_tokens_per_second === null ? "—" : fmtNumber(batch.x_output_tokens_per_second, 1));
        setText(eta, BATCH_ACTIVE.includes(batch.status) ? fmtSeconds(batch.x_estimated_seconds_left) : "—");
        setText(created, fmtTime(batch.created_at));
        controls.update(batch);
      },
    };
  }

  function batchesView(view, params, signal) {
    const tbody = h("tbody");
    const empty = h("p", { class: "muted", id: "batches-empty", hidden: true, text: "No batches yet." });
    const pagerSlot = h("div");
    const rows = new Map();
    view.append(
      h("h1", { text: "Batches" }),
      throughputPanel(signal),
      h(
        "section",
        { class: "panel" },
        h(
          "table",
          { id: "batches-table" },
          h(
            "thead",
            {},
            h(
              "tr",
              {},
              ["Batch", "Status", "Progress", "Lines", "Tokens/s", "ETA", "Created", "Files", ""].map((t) =>
                h("th", { class: t === "Tokens/s" || t === "ETA" ? "num" : null, text: t }),
              ),
            ),
          ),
          tbody,
        ),
        empty,
        pagerSlot,
      ),
    );
    const after = params.get("after");
    const refresh = async () => {
      const query = new URLSearchParams({ limit: String(PAGE) });
      if (after) query.set("after", after);
      const page = await apiJson(`v1/batches?${query}`, { signal });
      const seen = new Set();
      page.data.forEach((batch, index) => {
        seen.add(batch.id);
        let row = rows.get(batch.id);
        if (!row) {
          row = batchRow(refresh);
          rows.set(batch.id, row);
        }
        row.update(batch);
        if (tbody.children[index] !== row.tr) tbody.insertBefore(row.tr, tbody.children[index] || null);
      });
      for (const [id, row] of rows) {
        if (!seen.has(id)) {
          row.tr.remove();
          rows.delete(id);
        }
      }
      empty.hidden = page.data.length > 0;
      pagerSlot.replaceChildren(pager("#/batches", params, page));
    };
    every(POLL_MS, signal, refresh);
  }

  // --- the throughput chart ------------------------------------------------------------

  function throughputPanel(signal) {
    const figure = (id, label) => {
      const value = h("strong", { id, text: "—" });
      return { value, node: h("div", {}, value, h("span", { class: "muted", text: label })) };
    };
    const jobs = figure("throughput-jobs", "jobs ended");
    const failed = figure("throughput-failed", "failed");
    const tokens = figure("throughput-tokens", "tokens generated");
    const recent = figure("throughput-recent", "tokens/s, last 5 min");
    const chart = svg("svg", {
      class: "chart",
      id: "throughput-chart",
      viewBox: `0 0 ${CHART_WIDTH} ${CHART_HEIGHT}`,
      role: "img",
      "aria-label": "Output tokens per second, per minute, over the last hour",
    });
    every(CHART_MS, signal, async () => {
      const t = await apiJson("v2/throughput?window_seconds=3600&bucket_seconds=60", { signal });
      const sum = (f) => t.data.reduce((acc, b) => acc + f(b), 0);
      setText(jobs.value, fmtNumber(sum((b) => b.succeeded + b.failed + b.cancelled + b.expired)));
      setText(failed.value, fmtNumber(sum((b) => b.failed)));
      setText(tokens.value, fmtNumber(sum((b) => b.completion_tokens)));
      const last = t.data.slice(-5);
      const seconds = Math.max(1, t.end - last[0].start);
      setText(recent.value, fmtNumber(last.reduce((acc, b) => acc + b.completion_tokens, 0) / seconds, 1));
      drawChart(chart, t);
    });
    return h(
      "section",
      { class: "panel", id: "throughput" },
      h("h2", { text: "Throughput, last hour" }),
      h("div", { class: "chart-summary" }, jobs.node, failed.node, tokens.node, recent.node),
      chart,
    );
  }

  function drawChart(chart, t) {
    const left = 64;
    const right = 8;
    const top = 10;
    const bottom = 24;
    const width = CHART_WIDTH - left - right;
    const height = CHART_HEIGHT - top - bottom;
    const rates = t.data.map((b) => b.output_tokens_per_second);
    const peak = Math.max(1, ...rates);
    const step = width / Math.max(1, t.data.length);
    const nodes = [
      svg("line", { class: "axis", x1: left, y1: top + height, x2: left + width, y2: top + height }),
      svg("line", { class: "axis", x1: left, y1: top, x2: left, y2: top + height }),
      svg("text", { x: left - 6, y: top + 10, "text-anchor": "end", text: fmtNumber(peak, 1) }),
      svg("text", { x: left - 6, y: top + height, "text-anchor": "end", text: "0" }),
      svg("text", { x: left, y: CHART_HEIGHT - 6, text: `-${(t.data.length * t.bucket_seconds) / 60} min` }),
      svg("text", { x: left + width, y: CHART_HEIGHT - 6, "text-anchor": "end", text: "now" }),
      svg("text", { x: 4, y: top + height / 2, text: "tok/s" }),
    ];
    t.data.forEach((b, i) => {
      const ended = b.succeeded + b.failed + b.cancelled + b.expired;
      const barHeight = (b.output_tokens_per_second / peak) * height;
      const rect = svg(
        "rect",
        {
          class: i === t.data.length - 1 ? "bar-rect now" : "bar-rect",
          x: (left + i * step + 0.5).toFixed(1),
          y: (top + height - barHeight).toFixed(1),
          width: Math.max(1, step - 1).toFixed(1),
          height: barHeight.toFixed(1),
          "data-tokens": b.completion_tokens,
        },
        svg("title", {
          text: `${fmtTime(b.start)}: ${fmtNumber(b.output_tokens_per_second, 1)} tok/s, ${ended} jobs ended`,
        }),
      );
      nodes.push(rect);
    });
    chart.replaceChildren(...nodes);
  }

  // --- one batch and its lines ---------------------------------------------------------

  function lineRow(job, { showBatch = false } = {}) {
    const usage = job.usage || {};
    const error = job.error ? job.error.message : "";
    return h(
      "tr",
      { class: "line-row", "data-job-id": job.id, "data-status": job.status },
      h("td", {}, link(`#/jobs/${enc(job.id)}`, job.custom_id || job.id, { class: "mono job-link" })),
      h("td", {}, statusBadge(job.status)),
      showBatch
        ? h("td", {}, job.batch_id ? link(`#/batches/${enc(job.batch_id)}`, job.batch_id, { class: "mono" }) : "—")
        : null,
      h("td", { class: "num" }, usage.prompt_tokens === undefined ? "—" : fmtNumber(usage.prompt_tokens)),
      h("td", { class: "num" }, usage.completion_tokens === undefined ? "—" : fmtNumber(usage.completion_tokens)),
      h("td", { class: "num" }, jobDuration(job) === null ? "—" : fmtSeconds(jobDuration(job))),
      h("td", { class: "muted" }, fmtTime(endedAt(job) || job.created_at)),
      h("td", { class: "error line-error" }, error),
    );
  }

  function linesTable(id, { showBatch = false } = {}) {
    const heads = ["Line", "Status", showBatch ? "Batch" : null, "Prompt tok.", "Output tok.", "Took", "When", "Error"];
    const tbody = h("tbody");
    const table = h(
      "table",
      { id },
      h("thead", {}, h("tr", {}, heads.filter(Boolean).map((t) => h("th", { text: t })))),
      tbody,
    );
    return {
      table,
      fill(jobs) {
        tbody.replaceChildren(...jobs.map((job) => lineRow(job, { showBatch })));
      },
    };
  }

  function statusFilter(id, params, base) {
    const select = h(
      "select",
      { id },
      h("option", { value: "", text: "all" }),
      JOB_STATUSES.map((s) => h("option", { value: s, text: s })),
    );
    select.value = params.get("status") || "";
    select.addEventListener("change", () => {
      const next = new URLSearchParams();
      if (select.value) next.set("status", select.value);
      location.hash = `${base}?${next}`;
    });
    return h("label", { class: "toolbar" }, "Status ", select);
  }

  function batchView(view, id, params, signal) {
    const title = h("h1", {}, "Batch ", h("span", { class: "mono", text: id }));
    const status = h("span");
    const progress = progressCell();
    const controls = batchControls(() => refreshBatch());
    const factsSlot = h("div");
    const usageSlot = h("div");
    const lines = linesTable("lines-table");
    const linesEmpty = h("p", { class: "muted", id: "lines-empty", hidden: true, text: "No lines match." });
    const pagerSlot = h("div");
    view.append(
      title,
      h(
        "div",
        { class: "toolbar" },
        link("#/batches", "← Batches"),
        status,
        progress.node,
        controls.files,
        controls.actions,
      ),
      h("div", { class: "columns" }, h("section", { class: "panel" }, factsSlot), h("section", { class: "panel" }, usageSlot)),
      h(
        "section",
        { class: "panel" },
        h("h2", { text: "Lines" }),
        statusFilter("line-status", params, `#/batches/${enc(id)}`),
        lines.table,
        linesEmpty,
        pagerSlot,
      ),
    );

    let batchStatus = null;
    const refreshBatch = async () => {
      const batch = await apiJson(`v1/batches/${enc(id)}`, { signal });
      batchStatus = batch.status;
      setStatus(status, batch.status);
      progress.update(batch);
      controls.update(batch);
      const p = batch.x_progress;
      factsSlot.replaceChildren(
        facts([
          ["Status", statusBadge(batch.status)],
          ["Model", batch.model],
          ["Endpoint", batch.endpoint],
          ["Lines", `${batch.request_counts.total} (${p.succeeded} succeeded, ${p.failed} failed, ` +
            `${p.cancelled} cancelled, ${p.expired} expired, ${p.running} running, ${p.queued} queued)`],
          ["Tokens/s", batch.x_output_tokens_per_second === null ? null : fmtNumber(batch.x_output_tokens_per_second, 1)],
          ["ETA", BATCH_ACTIVE.includes(batch.status) ? fmtSeconds(batch.x_estimated_seconds_left) : null],
          ["Created", fmtTime(batch.created_at)],
          ["Started", fmtTime(batch.in_progress_at)],
          ["Ended", fmtTime(batch.completed_at || batch.cancelled_at || batch.expired_at || batch.failed_at)],
          ["Deadline", fmtTime(batch.expires_at)],
          ["Window", batch.completion_window],
          ["Retry of", batch.x_parent_batch_id ? link(`#/batches/${enc(batch.x_parent_batch_id)}`, batch.x_parent_batch_id) : null],
          ["Request id", batch.x_request_id ? h("span", { class: "mono", text: batch.x_request_id }) : null],
        ]),
      );
      const usage = batch.usage || {};
      const errors = ((batch.errors && batch.errors.data) || []).map((e) =>
        h("li", { text: `${e.line === null || e.line === undefined ? "" : `line ${e.line}: `}${e.code}: ${e.message}` }),
      );
      fill(
        usageSlot,
        facts([
          ["Input tokens", usage.input_tokens === undefined ? null : fmtNumber(usage.input_tokens)],
          ["Output tokens", usage.output_tokens === undefined ? null : fmtNumber(usage.output_tokens)],
          ["Cached tokens", usage.input_tokens_details ? fmtNumber(usage.input_tokens_details.cached_tokens) : null],
          ["Input file", h("span", { class: "mono", text: batch.input_file_id })],
          ["Output file", batch.output_file_id ? h("span", { class: "mono", text: batch.output_file_id }) : null],
          ["Error file", batch.error_file_id ? h("span", { class: "mono", text: batch.error_file_id }) : null],
          ...Object.entries(batch.metadata || {}).map(([k, v]) => [`metadata.${k}`, v]),
        ]),
        errors.length ? h("ul", { class: "error" }, errors) : null,
      );
    };
    const refreshLines = async () => {
      const query = new URLSearchParams({ batch_id: id, limit: String(LINE_PAGE) });
      for (const name of ["status", "after"]) if (params.get(name)) query.set(name, params.get(name));
      const page = await apiJson(`v2/jobs?${query}`, { signal });
      lines.fill(page.data);
      linesEmpty.hidden = page.data.length > 0;
      pagerSlot.replaceChildren(pager(`#/batches/${enc(id)}`, params, page));
    };
    every(POLL_MS, signal, async () => {
      const wasActive = batchStatus === null || BATCH_ACTIVE.includes(batchStatus);
      await refreshBatch();
      await refreshLines();
      // One last read after the batch ended, then the page stays as it is.
      return wasActive ? null : "stop";
    }, () => fill(view, title, link("#/batches", "← Batches")));
  }

  // --- the jobs page -------------------------------------------------------------------

  function jobsView(view, params, signal) {
    const table = linesTable("jobs-table", { showBatch: true });
    const empty = h("p", { class: "muted", id: "jobs-empty", hidden: true, text: "No jobs match." });
    const pagerSlot = h("div");
    view.append(
      h("h1", { text: "Jobs" }),
      h("section", { class: "panel" }, statusFilter("job-status", params, "#/jobs"), table.table, empty, pagerSlot),
    );
    every(POLL_MS, signal, async () => {
      const query = new URLSearchParams({ limit: String(PAGE) });
      for (const name of ["status", "after"]) if (params.get(name)) query.set(name, params.get(name));
      const page = await apiJson(`v2/jobs?${query}`, { signal });
      table.fill(page.data);
      empty.hidden = page.data.length > 0;
      pagerSlot.replaceChildren(pager("#/jobs", params, page));
    });
  }

  // --- one job and its stream ----------------------------------------------------------

  /** Server-sent events from a fetch() body: yields {id, event, data} per event. */
  async function* sseEvents(body) {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    let event = { id: null, event: null, data: [] };
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) return;
        buffer += decoder.decode(value, { stream: true });
        let end;
        while ((end = buffer.indexOf("\n")) >= 0) {
          const line = buffer.slice(0, end).replace(/\r$/, "");
          buffer = buffer.slice(end + 1);
          if (line === "") {
            if (event.data.length) yield { id: event.id, event: event.event, data: event.data.join("\n") };
            event = { id: null, event: null, data: [] };
          } else if (!line.startsWith(":")) {
            const colon = line.indexOf(":");
            const field = colon < 0 ? line : line.slice(0, colon);
            let text = colon < 0 ? "" : line.slice(colon + 1);
            if (text.startsWith(" ")) text = text.slice(1);
            if (field === "data") event.data.push(text);
            else if (field === "id") event.id = text;
            else if (field === "event") event.event = text;
          }
        }
      }
    } finally {
      reader.cancel().catch(() => {});
    }
  }

  /** Plays a job's stream into `out`: live while the job runs (resuming after a dropped
   * connection with Last-Event-ID), or replayed from the start once it has ended. */
  function streamPlayer(jobId, out, state, signal) {
    let controller = null;
    let choices = new Map();
    let events = 0;

    const choiceText = (index) => {
      if (!choices.has(index)) {
        const pre = h("pre", { class: "stream stream-text", "data-index": index });
        choices.set(index, pre);
        add(out, [choices.size > 1 ? h("h2", { text: `Choice ${index}` }) : null, pre]);
      }
      return choices.get(index);
    };

    const reset = () => {
      choices = new Map();
      events = 0;
      out.replaceChildren();
      choiceText(0);
    };

    const show = (text, live = false) => {
      state.className = live ? "stream-state live" : "stream-state";
      setText(state, text);
    };

    const apply = (chunk) => {
      for (const choice of chunk.choices || []) {
        // Chat chunks carry a delta; text completion chunks carry the text itself.
        const delta = choice.delta || {};
        const piece = (delta.reasoning_content || "") + (delta.content || "") + (choice.text || "");
        if (piece) choiceText(choice.index || 0).append(document.createTextNode(piece));
      }
      events += 1;
    };

    async function play({ paced = false, live = true } = {}) {
      if (controller) controller.abort();
      controller = new AbortController();
      const local = controller.signal;
      const own = controller;
      signal.addEventListener("abort", () => own.abort(), { once: true });
      reset();
      let lastId = null;
      let failures = 0;
      show(live ? "waiting for events…" : "replaying…", live);
      while (!local.aborted) {
        try {
          const headers = { Accept: "text/event-stream" };
          if (lastId) headers["Last-Event-ID"] = lastId;
          const response = await api(`v2/jobs/${enc(jobId)}/stream`, { signal: local, headers });
          for await (const event of sseEvents(response.body)) {
            if (event.id) lastId = event.id;
            if (event.data === "[DONE]") {
              show(`${live ? "ended" : "replayed"} · ${events} events`);
              return;
            }
            const payload = JSON.parse(event.data);
            if (payload.error && payload.error.code === "stream_restarted") {
              // The job restarted on another worker: its new attempt plays from the start.
              reset();
              lastId = null;
              continue;
            }
            if (payload.error) {
              show(`error: ${payload.error.message}`);
              continue;
            }
            apply(payload);
            failures = 0;
            if (live) show(`live · ${events} events`, true);
            if (paced) await sleep(REPLAY_MS, local);
          }
        } catch (err) {
          if (isAbort(err) || local.aborted) return;
          if (err instanceof ApiError) {
            report(err);
            show(`error: ${err.message}`);
            return;
          }
        }
        // The connection ended before [DONE]: resume after the last event seen.
        failures += 1;
        if (failures > 5) {
          show("disconnected");
          return;
        }
        show(`reconnecting (${failures})…`);
        await sleep(500 * failures, local);
      }
    }

    return { play };
  }

  function json(value) {
    return JSON.stringify(value, null, 2);
  }

  function jobView(view, id, signal) {
    const status = h("span");
    const cancel = h("button", { type: "button", class: "danger", id: "cancel-job", text: "Cancel", hidden: true });
    const batchLink = h("span");
    const factsSlot = h("div");
    const statsSlot = h("div");
    const streamState = h("span", { class: "stream-state", id: "stream-state" });
    const replay = h("button", { type: "button", class: "secondary", id: "replay", text: "Replay" });
    const streamOut = h("div", { id: "stream" });
    const requestPre = h("pre", { id: "job-request", text: "…" });
    const responsePre = h("pre", { id: "job-response", text: "—" });
    const errorSlot = h("p", { id: "job-error", class: "error" });
    const title = h("h1", {}, "Job ", h("span", { class: "mono", text: id }));
    view.append(
      title,
      h("div", { class: "toolbar" }, batchLink, status, cancel),
      h("div", { class: "columns" }, h("section", { class: "panel" }, factsSlot), h("section", { class: "panel" }, statsSlot)),
      h(
        "section",
        { class: "panel" },
        h("h2", {}, "Stream", streamState),
        h("div", { class: "toolbar" }, replay),
        streamOut,
      ),
      errorSlot,
      h(
        "div",
        { class: "columns" },
        h("section", { class: "panel" }, h("h2", { text: "Request" }), requestPre),
        h("section", { class: "panel" }, h("h2", { text: "Response" }), responsePre),
      ),
    );
    const player = streamPlayer(id, streamOut, streamState, signal);
    replay.addEventListener("click", () => player.play({ paced: true, live: false }));
    cancel.addEventListener("click", async () => {
      if (!window.confirm(`Cancel job ${id}?`)) return;
      try {
        const job = await apiJson(`v2/jobs/${enc(id)}/cancel`, { method: "POST" });
        notice(`Job ${job.id} is ${job.status}.`);
      } catch (err) {
        report(err);
      }
    });

    apiJson(`v2/jobs/${enc(id)}/request`, { signal })
      .then((r) => setText(requestPre, r.body ? json(r.body) : "(cleared: the batch's output file has expired)"))
      .catch(report);

    let started = false;
    let lastStatus = null;
    every(POLL_MS, signal, async () => {
      const job = await apiJson(`v2/jobs/${enc(id)}`, { signal });
      const active = JOB_ACTIVE.includes(job.status);
      setStatus(status, job.status);
      cancel.hidden = !active;
      batchLink.replaceChildren(
        job.batch_id ? link(`#/batches/${enc(job.batch_id)}`, `← Batch ${job.batch_id}`) : link("#/jobs", "← Jobs"),
      );
      factsSlot.replaceChildren(
        facts([
          ["Status", statusBadge(job.status)],
          ["Model", job.model],
          ["Batch", job.batch_id ? link(`#/batches/${enc(job.batch_id)}`, job.batch_id) : null],
          ["Custom id", job.custom_id ? h("span", { class: "mono", text: job.custom_id }) : null],
          ["Priority", job.priority],
          ["Attempts", job.attempts],
          ["Created", fmtTime(job.created_at)],
          ["Started", fmtTime(job.started_at)],
          ["Ended", fmtTime(endedAt(job))],
          ["Took", jobDuration(job) === null ? null : fmtSeconds(jobDuration(job))],
          ["Worker", job.finished_by || job.lease_owner],
          ["Request id", job.request_id ? h("span", { class: "mono", text: job.request_id }) : null],
          ...Object.entries(job.metadata || {}).map(([k, v]) => [`metadata.${k}`, v]),
        ]),
      );
      const usage = job.usage || {};
      const stats = job.generation_stats || {};
      const power = job.power_usage || {};
      statsSlot.replaceChildren(
        facts([
          ["Queue wait", job.queue_wait_seconds == null ? null : `${fmtNumber(job.queue_wait_seconds, 3)} s`],
          ["First token after", job.ttft_seconds == null ? null : `${fmtNumber(job.ttft_seconds, 3)} s`],
          ["End to end", job.e2e_seconds == null ? null : `${fmtNumber(job.e2e_seconds, 3)} s`],
          ["Prompt tokens", usage.prompt_tokens],
          ["Output tokens", usage.completion_tokens],
          ["Total tokens", usage.total_tokens],
          ["Prompt tok/s", stats.prompt_tps === undefined ? null : fmtNumber(stats.prompt_tps, 1)],
          ["Output tok/s", stats.generation_tps === undefined ? null : fmtNumber(stats.generation_tps, 1)],
          ["Peak memory", stats.peak_memory_usage ? `${fmtNumber(stats.peak_memory_usage.inBytes / 2 ** 20, 1)} MiB` : null],
          ["Energy", power.total_energy_joules ? `${fmtNumber(power.total_energy_joules, 1)} J` : null],
        ]),
      );
      setText(responsePre, job.response ? json(job.response) : "—");
      setText(errorSlot, job.error ? `${job.error.type}${job.error.code ? ` (${job.error.code})` : ""}: ${job.error.message}` : "");
      if (!started) {
        started = true;
        // A running or queued job plays live; an ended one is replayed from its record.
        player.play({ live: active });
      }
      const wasActive = lastStatus === null || JOB_ACTIVE.includes(lastStatus);
      lastStatus = job.status;
      return active || wasActive ? null : "stop";
    }, () => fill(view, title, link("#/jobs", "← Jobs")));
  }

  // --- start ---------------------------------------------------------------------------

  document.addEventListener("DOMContentLoaded", () => {
    $("sign-in-form").addEventListener("submit", signIn);
    $("sign-out").addEventListener("click", () => signOut());
    window.addEventListener("hashchange", route);
    route();
  });
})();
