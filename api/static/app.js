// The rlhf-server dashboard: plain JavaScript, no build step, no framework.
//
// Every data call goes to the HTTP API under /v1 with `Authorization: Bearer <key>`; the key is typed into the
// sign-in form and kept in sessionStorage (or localStorage with "remember"). The live job stream is read with
// fetch() and a ReadableStream, since EventSource cannot send the Authorization header; the SSE frames are parsed
// here and the connection resumes with Last-Event-ID after a network error. Charts are small SVG line charts.
'use strict';

(() => {
  const KEY_NAME = 'rlhf-api-key';
  const FINAL = new Set(['succeeded', 'failed', 'cancelled']);
  const JOBS_REFRESH_MS = 3000;
  const HISTORY_POINTS = 2000;

  const state = { key: null, cleanup: [] };
  // The job types, name → entry of GET /v1/job_types (engine.spec.config.JOB_TYPES): its summary, dataset_kind,
  // output ("policy" or "reward_model"), generates, reward_model, metrics (the charts), hyperparameters (the
  // defaults), builtin_datasets and example (a spec to start from). Loaded once after sign-in (loadJobTypes);
  // everything that differs by type is read from here, so a type the server adds needs no change to this file.
  let jobTypes = new Map();
  let jobTypesLoad = null;
  const $ = (selector, root = document) => root.querySelector(selector);

  // --- DOM helpers (text only: nothing from the API is ever parsed as HTML) -----------------------------------

  function h(tag, attrs, ...children) {
    const el = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (name.startsWith('on')) el.addEventListener(name.slice(2), value);
      else if (name === 'class') el.className = value;
      else if (name in el && typeof value !== 'string') el[name] = value;
      else el.setAttribute(name, value === true ? '' : String(value));
    }
    for (const child of children.flat()) {
      if (child === null || child === undefined || child === false) continue;
      el.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return el;
  }

  // replaceChildren() with nested arrays flattened and null/false children left out, as h() does.
  function fill(el, ...children) {
    el.replaceChildren(...children.flat(Infinity).filter((c) => c !== null && c !== undefined && c !== false));
    return el;
  }

  const SVG_NS = 'http://www.w3.org/2000/svg';
  function svg(tag, attrs, text) {
    const el = document.createElementNS(SVG_NS, tag);
    for (const [name, value] of Object.entries(attrs || {})) el.setAttribute(name, String(value));
    if (text !== undefined) el.textContent = text;
    return el;
  }

  function fmt(value) {
    if (value === null || value === undefined || Number.isNaN(value)) return '–';
    if (typeof value !== 'number') return String(value);
    const abs = Math.abs(value);
    if (abs !== 0 && (abs < 1e-3 || abs >= 1e5)) return value.toExponential(2);
    return Number(value.toPrecision(4)).toString();
  }

  function tick(value) {
    const abs = Math.abs(value);
    if (abs !== 0 && (abs < 1e-3 || abs >= 1e5)) return value.toExponential(1);
    return Number(value.toPrecision(3)).toString();
  }

  function ago(iso) {
    if (!iso) return '';
    const seconds = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
    if (seconds < 60) return `${Math.floor(seconds)}s ago`;
    if (seconds < 3600) return `${Math.floor(seconds / 60)}m ago`;
    if (seconds < 86400) return `${Math.floor(seconds / 3600)}h ago`;
    return `${Math.floor(seconds / 86400)}d ago`;
  }

  function sleep(ms, signal) {
    return new Promise((resolve) => {
      const timer = setTimeout(resolve, ms);
      signal?.addEventListener('abort', () => { clearTimeout(timer); resolve(); }, { once: true });
    });
  }

  function randomKey() {
    const bytes = crypto.getRandomValues(new Uint8Array(12));
    return 'dash-' + Array.from(bytes, (b) => b.toString(16).padStart(2, '0')).join('');
  }

  // --- the API --------------------------------------------------------------------------------------------------

  class ApiError extends Error {
    constructor(status, code, message, param) {
      super(message);
      this.status = status;
      this.code = code;
      this.param = param;
    }
    describe() {
      return this.param ? `${this.message} (param: ${this.param})` : this.message;
    }
  }

  async function api(method, path, body, signal) {
    const headers = { Authorization: `Bearer ${state.key}` };
    let payload;
    if (body instanceof FormData) payload = body;
    else if (body !== undefined) {
      headers['Content-Type'] = 'application/json';
      payload = JSON.stringify(body);
    }
    const response = await fetch(path, { method, headers, body: payload, signal, cache: 'no-store' });
    const text = await response.text();
    let data = null;
    try { data = text ? JSON.parse(text) : null; } catch { data = null; }
    if (!response.ok) {
      const error = (data && data.error) || { code: `http_${response.status}`, message: text || response.statusText };
      if (response.status === 401) signOut('The API refused the key: sign in again.');
      throw new ApiError(response.status, error.code, error.message, error.param || null);
    }
    return data;
  }

  // Server-Sent Events over fetch(): calls onMessage(event, data) per message until `end` or the signal aborts.
  async function followStream(jobId, signal, onMessage, onConnection) {
    let lastEventId = null;
    let ended = false;
    let delay = 1000;
    while (!ended && !signal.aborted) {
      try {
        const headers = { Authorization: `Bearer ${state.key}`, Accept: 'text/event-stream' };
        if (lastEventId) headers['Last-Event-ID'] = lastEventId;
        const response = await fetch(`/v1/jobs/${encodeURIComponent(jobId)}/stream`, { headers, signal, cache: 'no-store' });
        if (response.status === 401) { signOut('The API refused the key: sign in again.'); return; }
        if (!response.ok) throw new Error(`stream answered ${response.status}`);
        onConnection(true);
        delay = 1000;
        const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
        let buffer = '';
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buffer += value;
          buffer = buffer.replace(/\r\n/g, '\n');
          let end;
          while ((end = buffer.indexOf('\n\n')) >= 0) {
            const frame = parseFrame(buffer.slice(0, end));
            buffer = buffer.slice(end + 2);
            if (!frame) continue;
            if (frame.id !== undefined) lastEventId = frame.id;
            if (frame.data === undefined) continue;
            let data;
            try { data = JSON.parse(frame.data); } catch { continue; }
            onMessage(frame.event || 'message', data);
            if (frame.event === 'end') ended = true;
          }
        }
      } catch (e) {
        if (signal.aborted) return;
      }
      onConnection(false);
      if (!ended) {
        await sleep(delay, signal);
        delay = Math.min(delay * 2, 15000);
      }
    }
  }

  function parseFrame(text) {
    const frame = {};
    const data = [];
    for (const line of text.split('\n')) {
      if (line === '' || line.startsWith(':')) continue; // comments: the keep-alive
      const colon = line.indexOf(':');
      const field = colon < 0 ? line : line.slice(0, colon);
      let value = colon < 0 ? '' : line.slice(colon + 1);
      if (value.startsWith(' ')) value = value.slice(1);
      if (field === 'data') data.push(value);
      else if (field === 'event') frame.event = value;
      else if (field === 'id') frame.id = value;
    }
    if (data.length) frame.data = data.join('\n');
    return data.length || frame.id !== undefined ? frame : null;
  }

  // The job types, fetched once per sign-in and shared by every page that needs them (a failed fetch is tried
  // again by the next one).
  function loadJobTypes() {
    if (!jobTypesLoad) {
      const load = api('GET', '/v1/job_types').then((answer) => {
        if (load === jobTypesLoad) jobTypes = new Map(answer.data.map((t) => [t.name, t]));
        return jobTypes;
      });
      load.catch(() => { if (load === jobTypesLoad) jobTypesLoad = null; });
      jobTypesLoad = load;
    }
    return jobTypesLoad;
  }

  // --- sign-in, sign-out, routing -------------------------------------------------------------------------------

  function storedKey() {
    return sessionStorage.getItem(KEY_NAME) || localStorage.getItem(KEY_NAME);
  }

  function signOut(message) {
    state.key = null;
    sessionStorage.removeItem(KEY_NAME);
    localStorage.removeItem(KEY_NAME);
    jobTypes = new Map();
    jobTypesLoad = null;
    teardown();
    showSignIn(message);
  }

  function showSignIn(message) {
    $('#view').hidden = true;
    $('#nav').hidden = true;
    $('#sign-out').hidden = true;
    $('#sign-in').hidden = false;
    const error = $('#sign-in-error');
    error.hidden = !message;
    error.textContent = message || '';
    $('#api-key').focus();
  }

  async function signIn(event) {
    event.preventDefault();
    const key = $('#api-key').value.trim();
    if (!key) return;
    state.key = key;
    try {
      await api('GET', '/v1/jobs?limit=1');
    } catch (e) {
      state.key = null;
      showSignIn(e.status === 401 ? 'That key was refused.' : `Could not reach the API: ${e.message}`);
      return;
    }
    ($('#remember').checked ? localStorage : sessionStorage).setItem(KEY_NAME, key);
    $('#api-key').value = '';
    route();
  }

  function teardown() {
    for (const undo of state.cleanup.splice(0)) undo();
  }

  function setView(name, ...children) {
    $('#sign-in').hidden = true;
    $('#nav').hidden = false;
    $('#sign-out').hidden = false;
    for (const link of document.querySelectorAll('#nav [data-nav]')) {
      link.classList.toggle('active', link.dataset.nav === name);
    }
    const view = $('#view');
    view.hidden = false;
    view.dataset.view = name;
    fill(view, ...children);
    return view;
  }

  function route() {
    teardown();
    if (!state.key) { showSignIn(); return; }
    loadJobTypes();
    const hash = location.hash || '#/jobs';
    const match = hash.match(/^#\/jobs\/([A-Za-z0-9_-]{1,64})$/);
    if (hash === '#/new') renderNewJob();
    else if (match) renderJob(match[1]);
    else renderJobs();
  }

  // --- the jobs list --------------------------------------------------------------------------------------------

  function statusBadge(status) {
    return h('span', { class: `status status-${status}`, 'data-status': status }, status);
  }

  function progress(step, total) {
    const bar = h('span', { class: 'bar' });
    if (total) bar.style.width = `${Math.min(100, (100 * step) / total)}%`;
    return h('span', { class: 'progress', title: total ? `${step} of ${total} steps` : `step ${step}` },
      h('span', { class: 'track' }, bar), h('span', { class: 'steps' }, total ? `${step}/${total}` : `${step}`));
  }

  function renderJobs() {
    const body = h('tbody');
    const error = h('p', { class: 'error', role: 'alert', hidden: true });
    const updated = h('span', { class: 'muted' });
    setView('jobs',
      h('div', { class: 'heading' }, h('h1', {}, 'Jobs'), updated,
        h('a', { class: 'button', href: '#/new' }, 'New job')),
      error,
      h('table', { id: 'jobs-table', class: 'table' },
        h('thead', {}, h('tr', {}, ['Job', 'Type', 'Status', 'Progress', 'Model', 'Created'].map((t) => h('th', {}, t)))),
        body));
    const controller = new AbortController();
    let timer = null;
    state.cleanup.push(() => { controller.abort(); clearTimeout(timer); });

    async function refresh() {
      try {
        const jobs = await api('GET', '/v1/jobs?limit=100', undefined, controller.signal);
        fill(body, ...jobs.data.map((job) => h('tr', { 'data-job-id': job.id, 'data-status': job.status },
          h('td', {}, h('a', { href: `#/jobs/${job.id}` }, job.name || job.id),
            job.name ? h('div', { class: 'muted small' }, job.id) : null),
          h('td', {}, job.type),
          h('td', {}, statusBadge(job.status)),
          h('td', {}, progress(job.step, job.total_steps)),
          h('td', { class: 'mono small' }, job.model),
          h('td', { title: job.created_at }, ago(job.created_at)))));
        if (!jobs.data.length) {
          fill(body, h('tr', {}, h('td', { colspan: 6, class: 'muted' },
            'No jobs yet. ', h('a', { href: '#/new' }, 'Create one.'))));
        }
        error.hidden = true;
        updated.textContent = `updated ${new Date().toLocaleTimeString()}${jobs.has_more ? ' · newest 100 shown' : ''}`;
      } catch (e) {
        if (controller.signal.aborted) return;
        error.hidden = false;
        error.textContent = `Could not load the jobs: ${e.message}`;
      }
      if (!controller.signal.aborted) timer = setTimeout(refresh, JOBS_REFRESH_MS);
    }
    refresh();
  }

  // --- charts ---------------------------------------------------------------------------------------------------

  class Chart {
    constructor(name) {
      this.name = name;
      this.points = []; // [step, value], steps increasing
      this.dirty = false;
      this.value = h('span', { class: 'chart-value' }, '–');
      this.plot = svg('svg', { viewBox: '0 0 360 170', class: 'plot', role: 'img', 'aria-label': name });
      this.el = h('figure', { class: 'chart', 'data-metric': name, 'data-points': '0' },
        h('figcaption', {}, h('span', { class: 'chart-name' }, name), this.value), this.plot);
      this.draw();
    }

    add(step, value) {
      const last = this.points[this.points.length - 1];
      if (last && step <= last[0]) return false; // already shown (history and a replayed stream overlap)
      this.points.push([step, value]);
      this.schedule();
      return true;
    }

    schedule() {
      if (this.dirty) return;
      this.dirty = true;
      requestAnimationFrame(() => { this.dirty = false; this.draw(); });
    }

    draw() {
      const W = 360, H = 170, left = 54, right = 8, top = 8, bottom = 22;
      const points = this.points.filter(([, v]) => v !== null && Number.isFinite(v));
      this.el.dataset.points = String(points.length);
      const last = this.points[this.points.length - 1];
      this.value.textContent = last ? `${fmt(last[1])} @ ${last[0]}` : '–';
      const children = [svg('rect', { x: left, y: top, width: W - left - right, height: H - top - bottom, class: 'frame' })];
      if (!points.length) {
        children.push(svg('text', { x: (W + left) / 2, y: H / 2, class: 'empty', 'text-anchor': 'middle' }, 'no data yet'));
        fill(this.plot, ...children);
        return;
      }
      let x0 = points[0][0], x1 = points[points.length - 1][0];
      let y0 = Math.min(...points.map((p) => p[1])), y1 = Math.max(...points.map((p) => p[1]));
      if (x0 === x1) { x0 -= 1; x1 += 1; }
      if (y0 === y1) { const pad = Math.abs(y0) * 0.1 || 1; y0 -= pad; y1 += pad; }
      const sx = (x) => left + ((x - x0) / (x1 - x0)) * (W - left - right);
      const sy = (y) => top + (1 - (y - y0) / (y1 - y0)) * (H - top - bottom);
      for (const frac of [0, 0.5, 1]) {
        const y = y0 + frac * (y1 - y0);
        children.push(svg('line', { x1: left, x2: W - right, y1: sy(y), y2: sy(y), class: 'grid' }));
        children.push(svg('text', { x: left - 4, y: sy(y) + 4, 'text-anchor': 'end', class: 'tick' }, tick(y)));
      }
      children.push(svg('text', { x: left, y: H - 6, class: 'tick' }, `step ${points[0][0]}`));
      children.push(svg('text', { x: W - right, y: H - 6, 'text-anchor': 'end', class: 'tick' }, `${points[points.length - 1][0]}`));
      const coords = points.map(([x, y]) => `${sx(x).toFixed(1)},${sy(y).toFixed(1)}`).join(' ');
      children.push(svg('polyline', { points: coords, class: 'line' }));
      const [lx, ly] = points[points.length - 1];
      children.push(svg('circle', { cx: sx(lx), cy: sy(ly), r: 2.5, class: 'dot' }));
      fill(this.plot, ...children);
    }
  }

  // --- the job page ---------------------------------------------------------------------------------------------

  async function renderJob(jobId) {
    const controller = new AbortController();
    state.cleanup.push(() => controller.abort());
    setView('job', h('p', { class: 'muted' }, 'Loading…'));
    let job;
    let types;
    try {
      [job, types] = await Promise.all([
        api('GET', `/v1/jobs/${jobId}`, undefined, controller.signal),
        loadJobTypes().catch(() => new Map()), // without them every metric is charted under "More metrics"
      ]);
    } catch (e) {
      if (!controller.signal.aborted) setView('job', h('p', { class: 'error' }, `Could not load job ${jobId}: ${e.message}`));
      return;
    }
    if (controller.signal.aborted) return;
    const info = types.get(job.type);
    const headline = info ? info.metrics : [];

    // Header, status and controls.
    const status = h('span', { id: 'job-status' });
    const stepText = h('span', { id: 'job-step', class: 'mono' });
    const live = h('span', { id: 'live', class: 'live', title: 'live stream' }, 'offline');
    const errorBox = h('p', { id: 'job-error', class: 'error', hidden: true });
    const controlError = h('p', { class: 'error', role: 'alert', hidden: true });
    const buttons = {
      pause: h('button', { type: 'button', id: 'pause', class: 'secondary', onclick: () => control('pause') }, 'Pause'),
      resume: h('button', { type: 'button', id: 'resume', class: 'secondary', onclick: () => control('resume') }, 'Resume'),
      cancel: h('button', { type: 'button', id: 'cancel', class: 'danger', onclick: () => control('cancel') }, 'Cancel'),
    };
    const alerts = h('div', { id: 'alerts', class: 'alerts', hidden: true });
    const chartGrid = h('div', { class: 'charts', id: 'charts' });
    const moreGrid = h('div', { class: 'charts' });
    const more = h('details', { class: 'more', hidden: true }, h('summary', {}, 'More metrics'), moreGrid);
    const eventsBody = h('tbody');
    const alertCount = h('span', { class: 'badge alert-badge', hidden: true });
    const checkpointsBody = h('tbody');
    const tryBox = tryItBox(job, info);
    const spec = job.spec || {};
    // PPO and GRPO keep some rollouts every log_samples_every steps (the types whose hyperparameters have it)
    const sampled = spec.hyperparameters && 'log_samples_every' in spec.hyperparameters;
    const samples = sampled ? samplesPanel(jobId, spec.hyperparameters.log_samples_every, controller.signal) : null;

    setView('job',
      h('div', { class: 'heading' },
        h('h1', {}, job.name || job.id),
        h('span', { class: 'badge', title: info && info.summary }, job.type), status, live),
      h('div', { class: 'meta' },
        h('span', { class: 'mono' }, job.id),
        h('span', {}, 'model ', h('code', {}, job.model)),
        spec.reward_model ? h('span', {}, 'reward model ', h('code', {}, spec.reward_model)) : null,
        spec.reward ? graderSummary('reward', 'job-reward', spec.reward) : null,
        spec.eval_reward ? graderSummary('eval reward', 'job-eval-reward', spec.eval_reward) : null,
        h('span', {}, 'dataset ', h('code', {}, spec.dataset || '')),
        h('span', {}, 'step ', stepText),
        h('span', { title: job.created_at }, `created ${new Date(job.created_at).toLocaleString()}`)),
      alerts,
      errorBox,
      h('div', { class: 'controls' }, buttons.pause, buttons.resume, buttons.cancel), controlError,
      h('h2', {}, 'Metrics'), chartGrid, more,
      samples ? samples.el : null,
      h('div', { class: 'columns' },
        h('section', {}, h('h2', {}, 'Events ', alertCount),
          h('div', { class: 'scroll' }, h('table', { id: 'events', class: 'table small' },
            h('thead', {}, h('tr', {}, h('th', {}, 'Time'), h('th', {}, 'Kind'), h('th', {}, 'Message'))), eventsBody))),
        h('section', {}, h('h2', {}, 'Checkpoints'),
          h('div', { class: 'scroll' }, h('table', { id: 'checkpoints', class: 'table small' },
            h('thead', {}, h('tr', {}, h('th', {}, 'Step'), h('th', {}, 'Metrics'), h('th', {}, 'Saved'))),
            checkpointsBody)))),
      tryBox.el);

    function showJob(current) {
      job = current;
      fill(status, statusBadge(job.status));
      status.dataset.status = job.status;
      stepText.textContent = job.total_steps ? `${job.step} / ${job.total_steps}` : String(job.step);
      errorBox.hidden = !job.error;
      errorBox.textContent = job.error ? `${job.error.code}: ${job.error.message}` : '';
      const s = job.status;
      buttons.pause.disabled = !(s === 'running' || s === 'queued');
      buttons.resume.disabled = s !== 'paused';
      buttons.cancel.disabled = !['waiting', 'queued', 'running', 'pausing', 'paused'].includes(s);
    }
    showJob(job);

    // The stream's status messages are the newest word on the job: a response to a request sent before the
    // latest of them (a fast job may pause before the pause request's own answer arrives) keeps that status.
    let streamStatuses = 0;
    function showAnswer(answer, statusesBefore) {
      const stale = statusesBefore !== streamStatuses;
      showJob(stale ? { ...answer, status: job.status, error: job.error } : answer);
    }

    async function control(action) {
      controlError.hidden = true;
      for (const b of Object.values(buttons)) b.disabled = true;
      const before = streamStatuses;
      try {
        showAnswer(await api('POST', `/v1/jobs/${jobId}/${action}`), before);
      } catch (e) {
        controlError.hidden = false;
        controlError.textContent = `Could not ${action}: ${e.describe ? e.describe() : e.message}`;
        showJob(job);
      }
    }

    async function refreshJob() {
      const before = streamStatuses;
      try {
        showAnswer(await api('GET', `/v1/jobs/${jobId}`, undefined, controller.signal), before);
      } catch { /* the stream shows it */ }
    }

    // Charts: the job type's headline metrics first (empty until data comes), then any other under "More metrics".
    const charts = new Map();
    for (const name of headline) {
      const chart = new Chart(name);
      charts.set(name, chart);
      chartGrid.append(chart.el);
    }
    function addPoint(name, step, value) {
      let chart = charts.get(name);
      if (!chart) {
        chart = new Chart(name);
        charts.set(name, chart);
        moreGrid.append(chart.el);
        more.hidden = false;
      }
      chart.add(step, value);
    }
    function onStep(step) {
      if (step > job.step) {
        job.step = step;
        stepText.textContent = job.total_steps ? `${step} / ${job.total_steps}` : String(step);
      }
    }

    // Events, with training-health alerts (warning events whose data carry "alert") shown above everything.
    const seenEvents = new Set();
    let alertTotal = 0;
    function addEvent(event) {
      if (seenEvents.has(event.id)) return;
      seenEvents.add(event.id);
      const data = event.data || {};
      const isAlert = event.kind === 'warning' && data.alert !== undefined;
      eventsBody.prepend(h('tr', { class: `event event-${event.kind}${isAlert ? ' event-alert' : ''}`, 'data-event-id': event.id },
        h('td', { class: 'nowrap', title: event.created_at }, new Date(event.created_at).toLocaleTimeString()),
        h('td', {}, isAlert ? h('span', { class: 'badge alert-badge' }, 'alert') : event.kind),
        h('td', {}, event.message)));
      if (isAlert) {
        alertTotal += 1;
        alertCount.hidden = false;
        alertCount.textContent = `${alertTotal} alert${alertTotal > 1 ? 's' : ''}`;
        alerts.hidden = false;
        const details = [`value ${fmt(data.value)}`];
        if (data.baseline !== undefined) details.push(`baseline ${fmt(data.baseline)}`);
        alerts.prepend(h('div', { class: 'alert', role: 'alert', 'data-alert': String(data.alert) },
          h('strong', {}, `Training-health alert: ${data.alert}`),
          data.step !== undefined ? ` at step ${data.step}` : '', ` (${details.join(', ')}). `, event.message));
      }
      if (event.kind === 'checkpoint') refreshCheckpoints();
    }

    async function refreshCheckpoints() {
      try {
        const checkpoints = (await api('GET', `/v1/jobs/${jobId}/checkpoints`, undefined, controller.signal)).data;
        fill(checkpointsBody, ...checkpoints.slice().reverse().map((cp) => {
          const names = headline.filter((n) => cp.metrics[n] !== undefined).slice(0, 3);
          return h('tr', { 'data-step': cp.step },
            h('td', { class: 'mono' }, cp.step),
            h('td', { class: 'small' }, names.map((n) => `${n} ${fmt(cp.metrics[n])}`).join(' · ')),
            h('td', { title: cp.created_at, class: 'nowrap' }, ago(cp.created_at)));
        }));
        if (!checkpoints.length) fill(checkpointsBody, h('tr', {}, h('td', { colspan: 3, class: 'muted' }, 'none yet')));
        tryBox.setCheckpoints(checkpoints.map((cp) => cp.step));
      } catch { /* kept as it was */ }
    }

    // History first, then the live stream (which starts from the beginning: what history showed is skipped).
    try {
      const [metrics, events] = await Promise.all([
        api('GET', `/v1/jobs/${jobId}/metrics?max_points=${HISTORY_POINTS}`, undefined, controller.signal),
        loadEvents(jobId, controller.signal),
      ]);
      for (const [name, points] of Object.entries(metrics.data)) {
        for (const p of points) addPoint(name, p.step, p.value);
      }
      for (const event of events) addEvent(event);
    } catch (e) {
      if (controller.signal.aborted) return;
    }
    refreshCheckpoints();
    if (samples) samples.refresh();
    const view = $('#view');
    followStream(jobId, controller.signal, (kind, data) => {
      if (kind === 'metrics') {
        for (const [name, value] of Object.entries(data.metrics)) addPoint(name, data.step, value);
        onStep(data.step);
        if (samples) samples.onStep(data.step);
      } else if (kind === 'event') {
        addEvent(data);
      } else if (kind === 'status') {
        streamStatuses += 1;
        const changed = data.status !== job.status;
        showJob({ ...job, status: data.status, error: data.error, step: Math.max(job.step, data.step) });
        if (changed) refreshJob();
      } else if (kind === 'end') {
        view.dataset.streamEnded = 'true';
        refreshJob();
      }
    }, (connected) => {
      live.textContent = connected ? 'live' : (FINAL.has(job.status) ? 'finished' : 'reconnecting…');
      live.classList.toggle('on', connected);
    }).then(() => {
      if (!controller.signal.aborted) { live.textContent = 'finished'; live.classList.remove('on'); }
    });
  }

  // --- rollout samples (GET /v1/jobs/{id}/samples) ----------------------------------------------------------------

  // The "Samples" panel of a PPO or GRPO job: a step picker (the logged steps, following the newest unless another
  // is picked), a histogram of the step's rewards and a table of its samples. onStep(step) is told of every
  // step the live stream reports, and reloads once a step that keeps samples (step 1, every `every`) has come.
  function samplesPanel(jobId, every, signal) {
    const picker = h('select', { id: 'sample-step', 'aria-label': 'step', onchange: () => load(Number(picker.value)) });
    const histogram = h('figure', { id: 'reward-histogram', class: 'chart histogram', 'data-bins': '0' });
    const head = h('thead');
    const body = h('tbody');
    const note = h('p', { class: 'muted small', id: 'samples-note' },
      every ? `Kept at step 1 and every ${every} steps; none yet.` : 'log_samples_every is off: no samples are kept.');
    const el = h('section', { id: 'samples-panel', class: 'samples-panel' },
      h('h2', {}, 'Samples ', picker), note,
      h('div', { class: 'samples-body' }, histogram,
        h('div', { class: 'scroll samples-scroll' }, h('table', { id: 'samples', class: 'table small samples' }, head, body))));
    let newest = null;
    let shown = null;
    let loading = null;

    async function load(step) {
      const query = step === undefined || step === null ? '' : `?step=${step}`;
      let page;
      try {
        page = await api('GET', `/v1/jobs/${jobId}/samples${query}`, undefined, signal);
      } catch { return; } // kept as it was
      newest = page.steps.length ? page.steps[page.steps.length - 1] : null;
      shown = page.step;
      fill(picker, ...page.steps.slice().reverse().map((s) =>
        h('option', { value: s, selected: s === page.step }, s === newest ? `step ${s} (newest)` : `step ${s}`)));
      picker.disabled = !page.steps.length;
      note.hidden = page.steps.length > 0;
      show(page);
    }

    function show(page) {
      const names = page.reward_names;
      fill(head, h('tr', {}, h('th', {}, '#'), h('th', {}, 'Prompt'), h('th', {}, 'Response'),
        names.map((n) => h('th', { class: 'num' }, n)), h('th', { class: 'num' }, 'KL'), h('th', { class: 'num' }, 'Length')));
      fill(body, page.data.map((sample) => h('tr', { 'data-position': sample.position },
        h('td', { class: 'mono' }, sample.position),
        h('td', { class: 'prompt' }, sample.prompt),
        h('td', { class: 'response' }, sample.response),
        names.map((n) => h('td', { class: 'num mono' }, fmt(sample.rewards[n]))),
        h('td', { class: 'num mono' }, fmt(sample.kl)),
        h('td', { class: 'num mono' }, sample.length))));
      const name = ['total', 'score'].find((n) => names.includes(n)) || names[0];
      drawHistogram(histogram, name, name ? page.data.map((sample) => sample.rewards[name]) : [], page.step);
    }

    // Reloads the newest step (when it was shown: a picked older step stays), one request at a time.
    function refresh() {
      if (loading) return loading;
      const following = shown === null || shown === newest;
      loading = load(following ? undefined : shown).finally(() => { loading = null; });
      return loading;
    }

    function onStep(step) {
      if (every && (step === 1 || step % every === 0) && step !== newest) refresh();
    }

    return { el, refresh, onStep };
  }

  // An SVG histogram of `values` (a step's rewards named `name`) in up to 10 equal bins.
  function drawHistogram(figure, name, values, step) {
    const W = 300, H = 150, left = 28, right = 8, top = 8, bottom = 22;
    const finite = values.filter((v) => typeof v === 'number' && Number.isFinite(v));
    const plot = svg('svg', { viewBox: `0 0 ${W} ${H}`, class: 'plot', role: 'img' });
    const caption = h('figcaption', {}, h('span', { class: 'chart-name' }, name ? `${name} at step ${step}` : 'rewards'),
      h('span', { class: 'chart-value' }, `${finite.length} samples`));
    const children = [svg('rect', { x: left, y: top, width: W - left - right, height: H - top - bottom, class: 'frame' })];
    let lo = Math.min(...finite), hi = Math.max(...finite);
    const bins = finite.length ? (lo === hi ? 1 : Math.min(10, finite.length)) : 0;
    const counts = new Array(bins).fill(0);
    for (const v of finite) counts[Math.min(bins - 1, Math.floor(((v - lo) / (hi - lo || 1)) * bins))] += 1;
    if (bins) {
      const most = Math.max(...counts);
      const width = (W - left - right) / bins;
      counts.forEach((count, i) => {
        const height = (count / most) * (H - top - bottom);
        const from = lo + (i * (hi - lo)) / bins, to = lo + ((i + 1) * (hi - lo)) / bins;
        const bar = svg('rect', { x: left + i * width + 1, y: H - bottom - height, width: Math.max(1, width - 2), height, class: 'bar' });
        bar.append(svg('title', {}, `${tick(from)} – ${tick(to)}: ${count}`));
        children.push(bar);
      });
      children.push(svg('text', { x: left - 4, y: top + 10, 'text-anchor': 'end', class: 'tick' }, String(most)));
      children.push(svg('text', { x: left, y: H - 6, class: 'tick' }, tick(lo)));
      children.push(svg('text', { x: W - right, y: H - 6, 'text-anchor': 'end', class: 'tick' }, tick(hi)));
    } else {
      children.push(svg('text', { x: (W + left) / 2, y: H / 2, class: 'empty', 'text-anchor': 'middle' }, 'no samples yet'));
    }
    fill(plot, ...children);
    figure.dataset.bins = String(bins);
    figure.dataset.step = String(step);
    fill(figure, caption, plot);
  }

  // A reward grader of a spec in a line: its type and name (a multi grader: its components' keys); the whole
  // grader on hover.
  function graderSummary(label, id, grader) {
    const names = grader.type === 'multi' ? `(${Object.keys(grader.graders || {}).join(', ')})` : grader.name;
    return h('span', { id, title: JSON.stringify(grader, null, 2) },
      `${label} `, h('code', {}, grader.type), names ? ` ${names}` : null);
  }

  async function loadEvents(jobId, signal) {
    const events = [];
    let after = 0;
    for (let page = 0; page < 20; page++) {
      const batch = await api('GET', `/v1/jobs/${jobId}/events?limit=1000&after=${after}`, undefined, signal);
      events.push(...batch.data);
      if (!batch.has_more || !batch.data.length) break;
      after = batch.data[batch.data.length - 1].id;
    }
    return events;
  }

  // "Try it": sample prompts from one checkpoint (or two, side by side), optionally scored by the job's reward
  // model. `info` is the job's type (undefined if the types could not be loaded: then the server decides).
  // A job rewarded by graders (spec.reward) has no reward model to score with: the server refuses `score` then.
  function tryItBox(job, info) {
    if (info && !info.generates) {
      return {
        el: h('section', { class: 'card' }, h('h2', {}, 'Try it'),
          h('p', { class: 'muted' },
            'A reward model scores text but does not generate it: try the policies trained from it or with it.')),
        setCheckpoints() {},
      };
    }
    const scores = Boolean(job.spec && job.spec.reward_model); // the job has a reward model to score with
    const prompts = h('textarea', { id: 'try-prompts', rows: 3, placeholder: 'One prompt per line' },
      'i went to see the film and honestly it was\ni streamed the comedy and overall it was');
    const checkpoint = h('select', { id: 'try-checkpoint' }, h('option', { value: 'latest' }, 'latest'));
    const compare = h('select', { id: 'try-compare' }, h('option', { value: '' }, '—'));
    const maxTokens = h('input', { id: 'try-max-tokens', type: 'number', min: 1, max: 512, value: 24 });
    const temperature = h('input', { id: 'try-temperature', type: 'number', min: 0, max: 5, step: 0.1, value: 0.7 });
    const score = h('input', { id: 'try-score', type: 'checkbox', checked: scores });
    const button = h('button', { type: 'submit', id: 'try-run' }, 'Generate');
    const error = h('p', { class: 'error', role: 'alert', hidden: true });
    const results = h('div', { id: 'try-results' });

    async function run(event) {
      event.preventDefault();
      error.hidden = true;
      const lines = prompts.value.split('\n').map((l) => l.trim()).filter(Boolean);
      if (!lines.length) { error.hidden = false; error.textContent = 'Write at least one prompt.'; return; }
      const picks = [checkpoint.value, compare.value].filter(Boolean);
      const body = {
        prompts: lines,
        max_new_tokens: Number(maxTokens.value),
        temperature: Number(temperature.value),
        score: scores && score.checked,
      };
      button.disabled = true;
      button.textContent = 'Generating…';
      try {
        const answers = await Promise.all(picks.map((pick) => api('POST', `/v1/jobs/${job.id}/generate`,
          { ...body, checkpoint: pick === 'latest' ? 'latest' : Number(pick) })));
        fill(results, h('table', { class: 'table completions' },
          h('thead', {}, h('tr', {}, h('th', {}, 'Prompt'),
            answers.map((a, i) => h('th', {}, `${picks[i] === 'latest' ? 'latest: ' : ''}step ${a.checkpoint}`)))),
          h('tbody', {}, lines.map((prompt, row) => h('tr', {},
            h('td', { class: 'prompt' }, prompt),
            answers.map((a) => {
              const c = a.completions[row];
              return h('td', { class: 'completion', 'data-finish': c.finish_reason },
                h('span', { class: 'prompt-echo' }, c.prompt), h('span', { class: 'generated' }, c.text),
                h('div', { class: 'small muted' }, c.finish_reason,
                  c.score !== undefined && c.score !== null ? h('span', { class: 'badge score' }, `score ${fmt(c.score)}`) : null));
            }))))));
      } catch (e) {
        error.hidden = false;
        error.textContent = e.describe ? e.describe() : e.message;
      } finally {
        button.disabled = false;
        button.textContent = 'Generate';
      }
    }

    const el = h('section', { class: 'card', id: 'try-it' }, h('h2', {}, 'Try it'),
      h('form', { class: 'try-form', onsubmit: run },
        h('label', { class: 'wide' }, 'Prompts', prompts),
        h('div', { class: 'row' },
          h('label', {}, 'Checkpoint', checkpoint),
          h('label', {}, 'Compare with', compare),
          h('label', {}, 'Max tokens', maxTokens),
          h('label', {}, 'Temperature', temperature),
          scores ? h('label', { class: 'inline' }, score, ' Score with the reward model') : null,
          button)),
      error, results);

    return {
      el,
      setCheckpoints(steps) {
        for (const select of [checkpoint, compare]) {
          const keep = select.value;
          const first = select.options[0];
          fill(select, first, ...steps.slice().reverse().map((s) => h('option', { value: String(s) }, `step ${s}`)));
          if ([...select.options].some((o) => o.value === keep)) select.value = keep;
        }
      },
    };
  }

  // --- the new-job form -----------------------------------------------------------------------------------------

  // A field of the spec that cannot be read, named by its param (shown next to the field, as a 422's param is).
  class SpecFieldError extends Error {
    constructor(param, message) {
      super(`${param}: ${message}`);
      this.param = param;
    }
  }

  // The JSON object typed into a field of the form; a SpecFieldError if it is not one.
  function jsonObject(param, text) {
    let value;
    try { value = JSON.parse(text); } catch (e) { throw new SpecFieldError(param, `not valid JSON (${e.message})`); }
    if (value === null || typeof value !== 'object' || Array.isArray(value)) throw new SpecFieldError(param, 'must be a JSON object');
    return value;
  }

  // Built from the job types: the type select lists them; the chosen one gives the example hyperparameters and
  // reward, the built-in datasets, the uploaded files of its dataset kind, the jobs its model and reward model may
  // name, and whether it takes a reward at all (a reward model, or a reward grader: one of the two).
  async function renderNewJob() {
    const controller = new AbortController();
    state.cleanup.push(() => controller.abort());
    const heading = h('div', { class: 'heading' }, h('h1', {}, 'New job'));
    setView('new', heading, h('p', { class: 'muted' }, 'Loading…'));
    let types;
    try {
      types = await loadJobTypes();
    } catch (e) {
      if (controller.signal.aborted) return;
      setView('new', heading, h('p', { class: 'error' }, `Could not load the job types: ${e.message}`));
      return;
    }
    if (controller.signal.aborted) return;
    const type = h('select', { id: 'job-type' },
      [...types.values()].map((t) => h('option', { value: t.name, title: t.summary }, t.name)));
    const typeSummary = h('p', { id: 'job-type-summary', class: 'muted small' });
    const name = h('input', { id: 'job-name', type: 'text', maxlength: 200, placeholder: 'optional' });
    const modelPick = h('select', { id: 'model-pick' });
    const model = h('input', { id: 'model', type: 'text', value: 'builtin:tiny', spellcheck: false });
    const rewardPick = h('select', { id: 'reward-pick' });
    const rewardModel = h('input', { id: 'reward-model', type: 'text', spellcheck: false });
    // Graders in OpenAI's grader JSON (engine/rewards/graders.py): the reward instead of a reward model, and what scores
    // the eval dataset's samples.
    const reward = h('textarea', { id: 'reward', rows: 6, spellcheck: false, placeholder: 'none: the reward model above' });
    const rewardNote = h('p', { id: 'reward-error', class: 'error small', role: 'alert', hidden: true });
    const evalReward = h('textarea', { id: 'eval-reward', rows: 3, spellcheck: false, placeholder: 'none: the reward' });
    const evalRewardNote = h('p', { id: 'eval-reward-error', class: 'error small', role: 'alert', hidden: true });
    const dataset = h('select', { id: 'dataset' });
    const evalDataset = h('select', { id: 'eval-dataset' });
    const upload = h('input', { id: 'upload-file', type: 'file', accept: '.jsonl,application/jsonl,text/plain' });
    const uploadButton = h('button', { type: 'button', class: 'secondary', id: 'upload' }, 'Upload');
    const uploadStatus = h('span', { class: 'small', id: 'upload-status', role: 'status' });
    const hyper = h('textarea', { id: 'hyperparameters', rows: 6, spellcheck: false });
    const seed = h('input', { id: 'seed', type: 'number', min: 0, value: 0 });
    const checkpointEvery = h('input', { id: 'checkpoint-every', type: 'number', min: 1, placeholder: 'default (50)' });
    const extra = h('textarea', { id: 'extra', rows: 2, spellcheck: false },
      '{}');
    const preview = h('pre', { id: 'spec-preview', class: 'preview' });
    const submit = h('button', { type: 'submit', id: 'create' }, 'Create job');
    const formError = h('p', { id: 'form-error', class: 'error', role: 'alert', hidden: true });
    const field = (label, id, ...control) => h('div', { class: 'field' }, h('label', { for: id }, label), ...control);
    const rewardRows = [
      field('Reward model', 'reward-model', h('div', { class: 'pick' }, rewardPick, rewardModel)),
      field('Reward (grader JSON)', 'reward', reward, rewardNote),
      field('Eval reward (grader JSON, optional)', 'eval-reward', evalReward, evalRewardNote),
    ];

    const info = () => types.get(type.value); // the chosen type
    const outputOf = (j) => (types.get(j.type) || {}).output;
    let jobs = [];
    let files = [];
    let lastDefault = '';
    let lastRewardDefault = '';
    let idempotencyKey = randomKey();
    let previewText = '';

    // The server's rule (jobs/store/refs.py): a job starts from any policy, or from a model of its own output (a
    // reward model trained further); a reward_model is a reward model.
    function fillModelPickers() {
      const own = info().output;
      const succeeded = jobs.filter((j) => j.status === 'succeeded');
      const label = (j) => `job:${j.id} — ${j.type}${j.name ? ` ${j.name}` : ''}`;
      const options = (list) => list.map((j) => h('option', { value: `job:${j.id}` }, label(j)));
      for (const [select, ...children] of [
        [modelPick, h('option', { value: 'builtin:tiny' }, 'builtin:tiny'),
          options(succeeded.filter((j) => outputOf(j) === 'policy' || outputOf(j) === own))],
        [rewardPick, options(succeeded.filter((j) => outputOf(j) === 'reward_model'))],
      ]) {
        const keep = select.value;
        fill(select, h('option', { value: '' }, 'pick…'), ...children);
        if ([...select.options].some((o) => o.value === keep)) select.value = keep;
      }
    }

    function fillDatasets() {
      const { dataset_kind: kind, builtin_datasets: builtins } = info();
      const ours = files.filter((f) => f.kind === kind);
      for (const [select, withNone] of [[dataset, false], [evalDataset, true]]) {
        const keep = select.value;
        fill(select,
          withNone ? h('option', { value: '' }, '(none)') : null,
          h('optgroup', { label: 'Built-in' }, builtins.map((d) => h('option', { value: d }, d))),
          ours.length ? h('optgroup', { label: 'Uploaded' },
            ours.map((f) => h('option', { value: f.id }, `${f.id} — ${f.filename} (${f.rows} rows)`))) : null);
        if ([...select.options].some((o) => o.value === keep)) select.value = keep;
      }
    }

    function onType() {
      const { summary, reward_model: takesReward, example } = info();
      typeSummary.textContent = summary;
      for (const row of rewardRows) row.hidden = !takesReward;
      const hyperparameters = JSON.stringify(example.hyperparameters || {}, null, 2);
      if (!hyper.value.trim() || hyper.value === lastDefault) hyper.value = hyperparameters;
      lastDefault = hyperparameters;
      // The example's reward, if it has one, instead of a reward model (the server takes one of the two).
      const exampleReward = example.reward ? JSON.stringify(example.reward, null, 2) : '';
      if (!reward.value.trim() || reward.value === lastRewardDefault) reward.value = exampleReward;
      lastRewardDefault = exampleReward;
      if (example.reward) { rewardPick.value = ''; rewardModel.value = ''; }
      fillModelPickers();
      fillDatasets();
      // A built-in dataset is the type's own: it becomes the example's (an uploaded file that fits is kept).
      for (const [select, field] of [[dataset, 'dataset'], [evalDataset, 'eval_dataset']]) {
        const wanted = example[field] || '';
        const fits = [...select.options].some((o) => o.value === wanted);
        if (fits && !select.value.startsWith('file-')) select.value = wanted;
      }
      updatePreview();
    }

    function buildSpec() {
      const spec = { type: type.value };
      if (name.value.trim()) spec.name = name.value.trim();
      spec.model = model.value.trim();
      spec.dataset = dataset.value;
      if (evalDataset.value) spec.eval_dataset = evalDataset.value;
      if (info().reward_model) {
        if (rewardModel.value.trim()) spec.reward_model = rewardModel.value.trim();
        if (reward.value.trim()) spec.reward = jsonObject('reward', reward.value);
        if (evalReward.value.trim()) spec.eval_reward = jsonObject('eval_reward', evalReward.value);
      }
      spec.hyperparameters = jsonObject('hyperparameters', hyper.value || '{}');
      spec.seed = seed.value === '' ? 0 : Number(seed.value);
      if (checkpointEvery.value !== '') spec.checkpoint_every = Number(checkpointEvery.value);
      return { ...spec, ...jsonObject('more fields', extra.value || '{}') };
    }

    // A problem with the field `param` names (a 422's, or one found here): marked on the field (on "more fields"
    // when the form has none for it), and told next to it where it has a note. Returns the field.
    const FIELD_OF = {
      type, name, model, dataset, eval_dataset: evalDataset, reward_model: rewardModel, reward, eval_reward: evalReward,
      hyperparameters: hyper, seed, checkpoint_every: checkpointEvery,
    };
    const NOTE_OF = { reward: rewardNote, eval_reward: evalRewardNote };
    function markField(param, message) {
      const top = param.split(/[.[]/)[0];
      const el = FIELD_OF[top] || extra;
      el.classList.add('invalid');
      if (NOTE_OF[top]) {
        NOTE_OF[top].hidden = false;
        NOTE_OF[top].textContent = message;
      }
      return el;
    }

    function updatePreview() {
      for (const el of document.querySelectorAll('.invalid')) el.classList.remove('invalid');
      for (const note of Object.values(NOTE_OF)) note.hidden = true;
      try {
        const text = JSON.stringify(buildSpec(), null, 2);
        if (text !== previewText) idempotencyKey = randomKey(); // a changed spec is a new job
        previewText = text;
        preview.textContent = text;
        preview.classList.remove('bad');
        submit.disabled = false;
      } catch (e) {
        preview.textContent = e.message;
        preview.classList.add('bad');
        submit.disabled = true;
        if (e instanceof SpecFieldError) markField(e.param, e.message);
      }
    }

    async function doUpload() {
      const file = upload.files[0];
      if (!file) { uploadStatus.textContent = 'Choose a .jsonl file first.'; return; }
      const form = new FormData();
      form.append('file', file);
      form.append('purpose', info().dataset_kind);
      uploadButton.disabled = true;
      uploadStatus.textContent = 'uploading…';
      uploadStatus.className = 'small';
      try {
        const stored = await api('POST', '/v1/files', form);
        files.unshift(stored);
        fillDatasets();
        dataset.value = stored.id;
        uploadStatus.textContent = `${stored.id}: ${stored.rows} rows`;
        updatePreview();
      } catch (e) {
        uploadStatus.className = 'small error';
        uploadStatus.textContent = e.describe ? e.describe() : e.message;
      } finally {
        uploadButton.disabled = false;
      }
    }

    async function create(event) {
      event.preventDefault();
      formError.hidden = true;
      let spec;
      try {
        spec = buildSpec();
      } catch (e) {
        formError.hidden = false;
        formError.textContent = e.message;
        if (e instanceof SpecFieldError) markField(e.param, e.message).focus();
        return;
      }
      submit.disabled = true;
      try {
        const response = await fetch('/v1/jobs', {
          method: 'POST',
          headers: { Authorization: `Bearer ${state.key}`, 'Content-Type': 'application/json', 'Idempotency-Key': idempotencyKey },
          body: JSON.stringify(spec),
        });
        const data = await response.json().catch(() => null);
        if (response.status === 401) { signOut('The API refused the key: sign in again.'); return; }
        if (!response.ok) {
          const err = (data && data.error) || { message: `HTTP ${response.status}` };
          formError.hidden = false;
          fill(formError, h('strong', {}, `Rejected (${response.status} ${err.code || ''}): `), err.message,
            err.param ? h('span', { class: 'param' }, ' — param: ', h('code', { id: 'error-param' }, err.param)) : null);
          if (err.param) markField(err.param, `${err.param}: ${err.message}${err.code ? ` (${err.code})` : ''}`).focus();
          return;
        }
        location.hash = `#/jobs/${data.id}`;
      } catch (e) {
        formError.hidden = false;
        formError.textContent = `Could not create the job: ${e.message}`;
      } finally {
        submit.disabled = false;
      }
    }

    setView('new',
      heading,
      h('div', { class: 'columns' },
        h('form', { id: 'new-job', class: 'card form', oninput: updatePreview, onchange: updatePreview, onsubmit: create },
          field('Type', 'job-type', type, typeSummary),
          field('Name', 'job-name', name),
          field('Model', 'model', h('div', { class: 'pick' }, modelPick, model)),
          rewardRows,
          field('Dataset', 'dataset', dataset,
            h('div', { class: 'upload' }, upload, uploadButton, uploadStatus)),
          field('Eval dataset', 'eval-dataset', evalDataset),
          field('Hyperparameters (JSON)', 'hyperparameters', hyper),
          h('div', { class: 'row' }, field('Seed', 'seed', seed), field('Checkpoint every', 'checkpoint-every', checkpointEvery)),
          field('More spec fields (JSON, e.g. {"lora": {"r": 8}})', 'extra', extra),
          submit, formError),
        h('section', { class: 'card' }, h('h2', {}, 'Spec'),
          h('p', { class: 'muted small' }, 'Exactly what is sent as the body of POST /v1/jobs.'), preview)));

    type.addEventListener('change', onType);
    modelPick.addEventListener('change', () => { if (modelPick.value) model.value = modelPick.value; updatePreview(); });
    rewardPick.addEventListener('change', () => { if (rewardPick.value) rewardModel.value = rewardPick.value; updatePreview(); });
    uploadButton.addEventListener('click', doUpload);
    onType();

    try {
      const [jobList, fileList] = await Promise.all([
        api('GET', '/v1/jobs?limit=100', undefined, controller.signal),
        api('GET', '/v1/files?limit=100', undefined, controller.signal),
      ]);
      jobs = jobList.data;
      files = fileList.data;
      fillModelPickers();
      fillDatasets();
      updatePreview();
    } catch { /* the pickers stay with the built-ins; free text still works */ }
  }

  // --- start ----------------------------------------------------------------------------------------------------

  document.addEventListener('DOMContentLoaded', () => {
    $('#sign-in-form').addEventListener('submit', signIn);
    $('#sign-out').addEventListener('click', () => signOut());
    window.addEventListener('hashchange', route);
    state.key = storedKey();
    route();
  });
})();
