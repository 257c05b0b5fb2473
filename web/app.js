// headroom experiment history: jobs, job pages with attempts and charts, compare, policies,
// submit. Every piece of job-provided text goes into the page through textContent (never HTML).
'use strict';

const CATEGORIES = ['params', 'grads', 'optimizer', 'activations', 'workspace', 'fragmentation'];
const COLORS = { params: '#4e79a7', grads: '#f28e2b', optimizer: '#e15759', activations: '#76b7b2',
  workspace: '#59a14f', fragmentation: '#bab0ac', capacity: '#1d2330', warn: '#a15c00', preempt: '#b3261e',
  loss: '#0b57d0', val_loss: '#e15759', tokens: '#59a14f' };
const RUNG_COLORS = ['#4e79a7', '#f28e2b', '#76b7b2', '#59a14f', '#edc948', '#b07aa1', '#ff9da7', '#9c755f'];
const app = document.getElementById('app');
let cleanup = [];

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === 'class') e.className = v;
    else if (k.startsWith('on')) e.addEventListener(k.slice(2), v);
    else if (v !== undefined && v !== null) e.setAttribute(k, v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined) continue;
    e.appendChild(typeof c === 'string' || typeof c === 'number' ? document.createTextNode(String(c)) : c);
  }
  return e;
}

function bytes(b) {
  if (b === null || b === undefined) return '';
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let v = b, u = 0;
  while (v >= 1024 && u < units.length - 1) { v /= 1024; u++; }
  return u === 0 ? `${b} B` : `${v.toFixed(2)} ${units[u]}`;
}
const num = (x, d = 0) => (x === null || x === undefined ? '' : Number(x).toFixed(d));
const when = (t) => (t ? new Date(t * 1000).toLocaleString() : '');

async function api(path, opts) {
  const r = await fetch(path, opts);
  const body = await r.json().catch(() => null);
  if (!r.ok) throw new Error((body && body.error) || `${r.status}`);
  return { body, headers: r.headers };
}

function route() {
  for (const f of cleanup) f();
  cleanup = [];
  const hash = location.hash || '#/';
  const [path, query] = hash.slice(1).split('?');
  const params = new URLSearchParams(query || '');
  const m = path.match(/^\/job\/(\d+)$/);
  if (m) return jobPage(Number(m[1]));
  if (path === '/compare') return comparePage(params);
  if (path === '/policies') return policiesPage();
  if (path === '/submit') return submitPage();
  return jobsPage(params);
}
window.addEventListener('hashchange', route);

// ---------------------------------------------------------------- jobs table

const JOB_COLUMNS = [
  ['id', 'id', true], ['name', 'name', true], ['status', 'status', true], ['policy', 'policy', true],
  ['rung', 'rung', true], ['attempts', 'attempts', true], ['steps_done', 'steps', true],
  ['peak_reserved', 'peak vs capacity', true], ['mean_tokens_per_s', 'tokens/s', true], ['created_at', 'created', true],
];

async function jobsPage(params) {
  const state = {
    q: params.get('q') || '', status: params.get('status') || '', sort: params.get('sort') || 'id',
    order: params.get('order') || 'desc', offset: Number(params.get('offset') || 0), limit: 50,
  };
  const search = el('input', { type: 'search', placeholder: 'filter by name', value: state.q, id: 'filter' });
  const status = el('select', { id: 'status-filter' },
    ['', 'queued', 'running', 'finished', 'failed', 'cancelled'].map((s) => {
      const o = el('option', { value: s }, s || 'any status');
      if (s === state.status) o.selected = true;
      return o;
    }));
  const info = el('span', { class: 'muted' });
  const pager = el('span', { class: 'pager' });
  const thead = el('tr', {});
  const tbody = el('tbody', {});
  const table = el('table', { id: 'jobs' }, el('thead', {}, thead), tbody);
  app.replaceChildren(el('h1', {}, 'Jobs'), el('div', { class: 'controls' }, search, status, info, pager), table);

  const go = () => {
    const p = new URLSearchParams();
    for (const k of ['q', 'status', 'sort', 'order']) if (state[k]) p.set(k, state[k]);
    if (state.offset) p.set('offset', state.offset);
    history.replaceState(null, '', '#/?' + p.toString());
    load();
  };
  let timer;
  search.addEventListener('input', () => { clearTimeout(timer); timer = setTimeout(() => { state.q = search.value; state.offset = 0; go(); }, 250); });
  status.addEventListener('change', () => { state.status = status.value; state.offset = 0; go(); });
  for (const [key, label, sortable] of JOB_COLUMNS) {
    const th = el('th', { class: sortable ? 'sortable' : '' }, label);
    if (key === state.sort) th.classList.add('sorted', ...(state.order === 'asc' ? ['asc'] : []));
    th.addEventListener('click', () => {
      if (state.sort === key) state.order = state.order === 'asc' ? 'desc' : 'asc';
      else { state.sort = key; state.order = 'desc'; }
      const p = new URLSearchParams();
      for (const k of ['q', 'status', 'sort', 'order']) if (state[k]) p.set(k, state[k]);
      location.hash = '#/?' + p.toString();
    });
    thead.appendChild(th);
  }

  async function load() {
    const p = new URLSearchParams({ limit: state.limit, offset: state.offset, sort: state.sort, order: state.order });
    if (state.q) p.set('q', state.q);
    if (state.status) p.set('status', state.status);
    let res;
    try { res = await api('/api/jobs?' + p.toString()); } catch (e) { info.textContent = e.message; return; }
    const total = Number(res.headers.get('x-total-count') || res.body.length);
    tbody.replaceChildren(...res.body.map(jobRow));
    info.textContent = `${total} job${total === 1 ? '' : 's'}`;
    const prev = el('button', { onclick: () => { state.offset = Math.max(0, state.offset - state.limit); go(); } }, '‹ prev');
    const next = el('button', { onclick: () => { state.offset += state.limit; go(); } }, 'next ›');
    prev.disabled = state.offset === 0;
    next.disabled = state.offset + state.limit >= total;
    pager.replaceChildren(prev, ` ${total ? state.offset + 1 : 0}–${Math.min(total, state.offset + state.limit)} `, next);
    document.body.dataset.jobsLoaded = String(performance.now());
  }
  load();
  const iv = setInterval(load, 3000);
  cleanup.push(() => clearInterval(iv));
}

function jobRow(j) {
  const frac = j.capacity && j.peak_reserved ? j.peak_reserved / j.capacity : null;
  const meter = el('span', { class: 'meter' + (frac > 0.95 ? ' hot' : '') }, el('span', { style: `width:${Math.min(100, (frac || 0) * 100)}%` }));
  return el('tr', { 'data-job': j.id },
    el('td', { class: 'num' }, el('a', { href: `#/job/${j.id}` }, String(j.id))),
    el('td', {}, el('a', { href: `#/job/${j.id}`, class: 'job-name' }, j.name)),
    el('td', { class: `status-${j.status}` }, j.status),
    el('td', {}, j.policy),
    el('td', {}, j.rung),
    el('td', { class: 'num' }, String(j.attempts)),
    el('td', { class: 'num' }, `${j.steps_done} / ${j.steps_requested}`),
    el('td', {}, meter, frac === null ? '' : `${bytes(j.peak_reserved)} / ${bytes(j.capacity)}`),
    el('td', { class: 'num' }, num(j.mean_tokens_per_s)),
    el('td', {}, when(j.created_at)));
}

// ---------------------------------------------------------------- job page

function flatten(obj, prefix = '', out = {}) {
  for (const [k, v] of Object.entries(obj || {})) {
    const key = prefix ? `${prefix}.${k}` : k;
    if (v && typeof v === 'object' && !Array.isArray(v)) flatten(v, key, out);
    else out[key] = JSON.stringify(v);
  }
  return out;
}

function configDiff(prev, cur) {
  const a = flatten(prev), b = flatten(cur);
  const keys = [...new Set([...Object.keys(a), ...Object.keys(b)])].filter((k) => a[k] !== b[k]).sort();
  if (!keys.length) return el('span', { class: 'muted' }, 'no change');
  return el('span', { class: 'diff' }, keys.map((k) => el('div', { class: 'diff-changed' }, `${k}: ${a[k] ?? '—'} → ${b[k] ?? '—'}`)));
}

function statsTable(names, data) {
  // data: array of series (arrays, may hold null); min / max / last of each.
  return el('table', { class: 'stats' },
    el('tr', {}, el('th', {}, 'series'), el('th', { class: 'num' }, 'min'), el('th', { class: 'num' }, 'max'), el('th', { class: 'num' }, 'last')),
    names.map(([name, fmt], i) => {
      const vals = (data[i] || []).filter((v) => v !== null && v !== undefined && !Number.isNaN(v));
      const f = (v) => (vals.length ? fmt(v) : '');
      return el('tr', {}, el('td', {}, name), el('td', { class: 'num' }, f(Math.min(...vals))),
        el('td', { class: 'num' }, f(Math.max(...vals))), el('td', { class: 'num' }, f(vals[vals.length - 1])));
    }));
}

function chart(container, id, title, opts, data) {
  const box = el('div', { class: 'chart', id, 'data-series': String(opts.series.length - 1) });
  container.appendChild(el('h2', {}, title));
  container.appendChild(box);
  const width = Math.min(900, app.clientWidth - 20);
  const plot = new uPlot({ width, height: opts.height || 260, ...opts }, data, box);
  box.dataset.drawn = String(data[0].length);
  cleanup.push(() => plot.destroy());
  return plot;
}

async function jobPage(id) {
  const header = el('div', {});
  const body = el('div', {});
  app.replaceChildren(header, body);
  let thresholds = null;
  let rendering = false, pending = false;

  async function render() {
    if (rendering) { pending = true; return; }
    rendering = true;
    try {
      const [job, attempts, samples, events] = await Promise.all([
        api(`/api/jobs/${id}`), api(`/api/jobs/${id}/attempts`), api(`/api/jobs/${id}/samples`), api(`/api/jobs/${id}/events`),
      ]).then((rs) => rs.map((r) => r.body));
      if (!thresholds) {
        thresholds = await api(`/api/policies/${encodeURIComponent(job.policy)}`).then((r) => r.body.policy.thresholds).catch(() => null);
      }
      header.replaceChildren(
        el('h1', {}, el('span', { id: 'job-title' }, job.name), ' ', el('span', { class: `status-${job.status}` }, `(${job.status})`)),
        el('p', {}, `policy ${job.policy} · rung ${job.rung} · ${job.steps_done} / ${job.steps_requested} steps · capacity ${bytes(job.capacity)}`),
        ...(job.reason ? [el('p', { class: 'error' }, job.reason)] : []));
      body.replaceChildren();
      drawAttempts(body, attempts);
      drawCharts(body, attempts, samples, job);
      body.appendChild(el('h2', {}, 'Events'));
      body.appendChild(el('table', { class: 'events' }, events.map((e) =>
        el('tr', {}, el('td', { class: 'muted' }, when(e.t)), el('td', {}, e.kind), el('td', {}, e.message)))));
      document.body.dataset.jobLoaded = String(id);
    } catch (e) {
      app.replaceChildren(el('p', { class: 'error' }, `job ${id}: ${e.message}`));
    } finally {
      rendering = false;
      if (pending) { pending = false; render(); }
    }
  }

  function drawAttempts(container, attempts) {
    container.appendChild(el('h2', {}, 'Attempts'));
    const total = Math.max(1, ...attempts.map((a) => a.last_step || 0));
    const bar = el('div', { class: 'timeline', id: 'timeline' });
    attempts.forEach((a, i) => {
      if (!a.last_step) return;
      const from = a.resumed_from_step || 0;
      bar.appendChild(el('span', {
        style: `left:${(from / total) * 100}%;width:${((a.last_step - from) / total) * 100}%;background:${RUNG_COLORS[i % RUNG_COLORS.length]}`,
        title: `attempt ${a.number}: ${a.rung}, steps ${from + 1}-${a.last_step}, ${a.outcome || 'running'}`,
      }, `#${a.number} ${a.rung}`));
    });
    container.appendChild(bar);
    const rows = attempts.map((a, i) => {
      const cfg = JSON.parse(a.config_json);
      const prev = i > 0 ? JSON.parse(attempts[i - 1].config_json) : null;
      const cmp = el('input', { type: 'checkbox', title: 'add to compare' });
      cmp.checked = compareSet().has(a.id);
      cmp.addEventListener('change', () => toggleCompare(a.id, cmp.checked));
      return el('tr', { class: 'attempt', 'data-outcome': a.outcome || 'running' },
        el('td', { class: 'num' }, String(a.number)), el('td', {}, a.rung),
        el('td', { class: `outcome outcome-${a.outcome || 'running'}` }, a.outcome || 'running'),
        el('td', {}, a.message || ''),
        el('td', { class: 'num' }, a.last_step ? `${(a.resumed_from_step || 0) + 1}–${a.last_step}` : '—'),
        el('td', { class: 'num' }, `${cfg.train.micro_batch} × ${cfg.train.global_batch / cfg.train.micro_batch / (cfg.memory.world_size || 1)}`),
        el('td', { class: 'num' }, bytes(a.peak_allocated)), el('td', { class: 'num' }, bytes(a.peak_reserved)),
        el('td', { class: 'num' }, num(a.mean_tokens_per_s)),
        el('td', {}, prev ? configDiff(prev, cfg) : el('span', { class: 'muted' }, 'as submitted')),
        el('td', { class: 'num' }, bytes(a.predicted_allocated)), el('td', { class: 'num' }, num(a.predicted_tokens_per_s)),
        el('td', {}, cmp));
    });
    container.appendChild(el('table', { id: 'attempts' },
      el('tr', {}, ['#', 'rung', 'outcome', 'why it ended', 'steps', 'micro × accum', 'peak alloc', 'peak reserved', 'tokens/s', 'config change', 'predicted alloc', 'predicted tokens/s', 'compare'].map((h) => el('th', {}, h))),
      rows));
    drawPlans(container, attempts);
  }

  // Each attempt's plan (supervisor/planner.rs): every configuration considered before it, its
  // predicted peak and tokens/s, and the verdict; the newest one open.
  function drawPlans(container, attempts) {
    const planned = attempts.filter((a) => a.plan && a.plan.candidates);
    if (!planned.length) return;
    container.appendChild(el('h2', {}, 'Plans'));
    planned.forEach((a, i) => {
      const p = a.plan;
      const c = p.calibration || {};
      const details = el('details', { class: 'plan', 'data-attempt': String(a.number) },
        el('summary', {}, `attempt ${a.number} (${p.strategy}): ${p.candidates.filter((x) => x.verdict === 'fits' || x.verdict === 'chosen').length} of ${p.candidates.length} configurations predicted to fit · limit ${bytes(p.limit)} of ${bytes(p.capacity)} · margin ${num(100 * c.margin, 1)}% (${c.margin_from}) · tokens/s × ${num(c.speed_scale, 3)} (${c.speed_from})`),
        el('table', {},
          el('tr', {}, ['rung', 'micro × accum', 'knobs', 'predicted alloc', 'predicted tokens/s', 'verdict'].map((h) => el('th', {}, h))),
          p.candidates.map((x) => el('tr', { class: `verdict-${x.verdict}` },
            el('td', {}, x.rung), el('td', { class: 'num' }, `${x.micro_batch} × ${x.grad_accum}`), el('td', {}, x.knobs),
            el('td', { class: 'num' }, bytes(x.predicted_allocated)), el('td', { class: 'num' }, num(x.predicted_tokens_per_s)),
            el('td', {}, x.verdict)))));
      if (i === planned.length - 1) details.open = true;
      container.appendChild(details);
    });
  }

  function drawCharts(container, attempts, samples, job) {
    const steps = samples.filter((s) => s.loss !== null);
    const t0 = steps.length ? steps[0].t : 0;
    const x = steps.map((s) => s.t - t0);
    // Memory by category, stacked: cumulative sums drawn as filled bands.
    const layers = CATEGORIES.map((c) => steps.map((s) => s[c] || 0));
    const cumulative = [];
    let run = x.map(() => 0);
    for (const l of layers) { run = run.map((v, i) => v + l[i]); cumulative.push(run); }
    const cap = steps.map((s) => s.capacity || job.capacity);
    const mib = (v) => (v === null ? '' : (v / 1048576).toFixed(1) + ' MiB');
    const memSeries = [{ label: 'seconds' }];
    CATEGORIES.forEach((c, i) => memSeries.push({ label: c, stroke: COLORS[c], width: 2, fill: COLORS[c] + '99', value: (u, v, si, di) => (di === null ? '' : mib(layers[i][di])) }));
    memSeries.push({ label: 'capacity', stroke: COLORS.capacity, width: 2, value: (u, v) => mib(v) });
    const memData = [x, ...cumulative, cap];
    if (thresholds) {
      memSeries.push({ label: `warn ${Math.round(thresholds.warn * 100)}%`, stroke: COLORS.warn, dash: [6, 4], value: (u, v) => mib(v) });
      memSeries.push({ label: `preempt ${Math.round(thresholds.preempt * 100)}%`, stroke: COLORS.preempt, dash: [2, 3], value: (u, v) => mib(v) });
      memData.push(cap.map((c) => c * thresholds.warn), cap.map((c) => c * thresholds.preempt));
    }
    chart(container, 'chart-memory', 'Device memory by category (stacked)', {
      height: 340,
      series: memSeries, scales: { x: { time: false } },
      axes: [{ label: 'seconds since the first step' }, { values: (u, vals) => vals.map((v) => (v / 1048576).toFixed(0) + ' MiB'), size: 70 }],
      bands: CATEGORIES.slice(1).map((_, i) => ({ series: [i + 2, i + 1] })),
    }, memData);
    container.appendChild(statsTable(CATEGORIES.map((c) => [c, bytes]).concat([['capacity', bytes]]), [...layers, cap]));

    chart(container, 'chart-throughput', 'Throughput (tokens/s)', {
      series: [{ label: 'seconds' }, { label: 'tokens/s', stroke: COLORS.tokens }],
      scales: { x: { time: false } }, axes: [{ label: 'seconds since the first step' }, { size: 70 }],
    }, [x, steps.map((s) => s.tokens_per_s)]);
    container.appendChild(statsTable([['tokens/s', (v) => v.toFixed(0)]], [steps.map((s) => s.tokens_per_s)]));

    // Train and validation loss on one step axis across attempts (resumed attempts continue).
    const byStep = new Map();
    for (const s of samples) {
      const e = byStep.get(s.step) || { loss: null, val: null };
      if (s.loss !== null) e.loss = s.loss;
      if (s.val_loss !== null) e.val = s.val_loss;
      byStep.set(s.step, e);
    }
    const stepAxis = [...byStep.keys()].sort((a, b) => a - b);
    const loss = stepAxis.map((k) => byStep.get(k).loss);
    const val = stepAxis.map((k) => byStep.get(k).val);
    chart(container, 'chart-loss', 'Loss across attempts', {
      series: [{ label: 'step' }, { label: 'train loss', stroke: COLORS.loss }, { label: 'val loss', stroke: COLORS.val_loss, points: { show: true, size: 6 }, spanGaps: true }],
      scales: { x: { time: false } }, axes: [{ label: 'optimizer step' }, { size: 60 }],
    }, [stepAxis, loss, val]);
    container.appendChild(statsTable([['train loss', (v) => v.toFixed(4)], ['val loss', (v) => v.toFixed(4)]], [loss, val]));
  }

  await render();
  const source = new EventSource(`/api/jobs/${id}/events`);
  let timer = null;
  const kick = () => { if (!timer) timer = setTimeout(() => { timer = null; render(); }, 500); };
  for (const kind of ['attempt_started', 'attempt_ended', 'oom', 'preempt', 'step_down', 'plan', 'warm_start', 'warn', 'finished', 'failed', 'cancelled', 'retry', 'end']) {
    source.addEventListener(kind, kind === 'end' ? () => { source.close(); kick(); } : kick);
  }
  const iv = setInterval(() => { if (document.querySelector('.status-running')) render(); }, 3000);
  cleanup.push(() => { source.close(); clearInterval(iv); });
}

// ---------------------------------------------------------------- compare

function compareSet() { return new Set(JSON.parse(localStorage.getItem('headroom.compare') || '[]')); }
function toggleCompare(id, on) {
  const s = compareSet();
  if (on) s.add(id); else s.delete(id);
  localStorage.setItem('headroom.compare', JSON.stringify([...s]));
}

async function comparePage(params) {
  const wanted = (params.get('attempts') || [...compareSet()].join(',')).split(',').map(Number).filter(Boolean);
  app.replaceChildren(el('h1', {}, 'Compare attempts'));
  if (!wanted.length) {
    app.appendChild(el('p', { class: 'muted' }, 'Tick "compare" on attempts in job pages, then come back here.'));
    return;
  }
  // Attempts are fetched per job; find each attempt's job through the jobs list.
  const jobs = (await api('/api/jobs?limit=1000')).body;
  const found = [];
  for (const j of jobs) {
    if (found.length === wanted.length) break;
    const atts = (await api(`/api/jobs/${j.id}/attempts`)).body;
    for (const a of atts) if (wanted.includes(a.id)) found.push({ job: j, a, cfg: flatten(JSON.parse(a.config_json)) });
  }
  const keys = [...new Set(found.flatMap((f) => Object.keys(f.cfg)))].sort();
  const head = el('tr', {}, el('th', {}, ''), found.map((f) => el('th', {}, `${f.job.name} #${f.a.number} (${f.a.rung})`)));
  const rows = keys.map((k) => {
    const vals = found.map((f) => f.cfg[k]);
    const differs = new Set(vals).size > 1;
    return el('tr', { class: differs ? 'diff-changed' : '' }, el('td', {}, k), vals.map((v) => el('td', {}, v ?? '—')));
  });
  const metric = (label, f) => el('tr', {}, el('th', {}, label), found.map((x) => el('td', { class: 'num' }, f(x.a))));
  app.appendChild(el('table', { id: 'compare' }, head,
    metric('outcome', (a) => a.outcome || 'running'),
    ['params', 'grads', 'optimizer', 'activations', 'workspace', 'allocated', 'reserved'].map((c) => metric(`peak ${c}`, (a) => bytes(a[`peak_${c}`]))),
    metric('tokens/s', (a) => num(a.mean_tokens_per_s)), rows));
  app.appendChild(el('p', {}, el('button', { onclick: () => { localStorage.removeItem('headroom.compare'); location.hash = '#/compare'; route(); } }, 'clear selection')));
}

// ---------------------------------------------------------------- policies, submit

async function policiesPage() {
  app.replaceChildren(el('h1', {}, 'Policies'));
  const list = (await api('/api/policies')).body;
  for (const p of list) {
    const detail = await api(`/api/policies/${encodeURIComponent(p.name)}`).then((r) => r.body).catch((e) => ({ error: e.message }));
    app.appendChild(el('h2', {}, p.name));
    if (detail.error) { app.appendChild(el('p', { class: 'error' }, detail.error)); continue; }
    app.appendChild(el('ol', {}, detail.policy.rungs.map((r) => el('li', {}, `${r.name}${r.repeat ? ' (repeats)' : ''}: ${JSON.stringify(r.set)}`))));
    app.appendChild(el('pre', {}, detail.yaml));
  }
}

function submitPage() {
  const text = el('textarea', { id: 'job-yaml', spellcheck: 'false' });
  text.value = 'name: my-job\nmodel: { n_layer: 2, n_head: 4, n_embd: 64, block_size: 64, vocab: bytes }\n' +
    'data: { path: data/shakespeare-tiny.txt }\ntrain: { steps: 100, global_batch: 32, micro_batch: 32, lr: 3.0e-3 }\n' +
    'device: { kind: cpu, device_memory: 12MiB }\npolicy: default\n';
  const token = el('input', { type: 'password', placeholder: 'API token (if the daemon has one)', id: 'token' });
  const out = el('p', { id: 'submit-result' });
  const submit = async () => {
    out.className = '';
    out.textContent = 'submitting…';
    const headers = { 'Content-Type': 'application/yaml' };
    if (token.value) headers.Authorization = `Bearer ${token.value}`;
    try {
      const r = await api('/api/jobs', { method: 'POST', body: text.value, headers });
      location.hash = `#/job/${r.body.id}`;
    } catch (e) { out.className = 'error'; out.textContent = e.message; }
  };
  app.replaceChildren(el('h1', {}, 'Submit a job'), text, el('div', { class: 'controls' }, token, el('button', { onclick: submit, id: 'submit' }, 'Submit')), out);
}

route();
