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
// An axis label that is exact: ticks fall on binary steps (binarySplits), so a value in its
// largest whole unit needs at most a few binary decimals (1.5 MiB, 768 KiB), never a rounding.
function bytesExact(b) {
  if (b === null || b === undefined) return '';
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let v = b, u = 0;
  while (Math.abs(v) >= 1024 && u < units.length - 1) { v /= 1024; u++; }
  return `${Number(v.toFixed(3))} ${units[u]}`;
}
// Ticks at multiples of a power of two bytes (at most ~8 on the axis).
function binarySplits(u, axisIdx, min, max) {
  const span = Math.max(1, max - min);
  let step = 1;
  while (span / step > 8) step *= 2;
  const out = [];
  for (let v = Math.ceil(min / step) * step; v <= max + 1e-9; v += step) out.push(v);
  return out;
}
// The y range of a bytes axis: from 0 to a binary step above the largest value.
function binaryRange(u, min, max) {
  let step = 1;
  while (max / step > 8) step *= 2;
  return [0, Math.max(step, Math.ceil((max * 1.02) / step) * step)];
}
const BYTES_AXIS = {
  splits: binarySplits, size: 80,
  values: (u, vals) => {
    const labels = vals.map(bytesExact);
    // The labels are drawn on the canvas; kept on the chart's box for the browser test too.
    Object.assign(u.root.parentElement.dataset, { yTicks: JSON.stringify(vals), yLabels: JSON.stringify(labels) });
    return labels;
  },
};
// Rows with a null row between two whose times are further apart than a pause in training
// (the daemon down, a job queued, an attempt starting): charts break the line there.
function withGaps(rows, t) {
  if (rows.length < 3) return rows;
  const dts = rows.slice(1).map((r, i) => t(r) - t(rows[i])).sort((a, b) => a - b);
  const limit = Math.max(5, 10 * dts[Math.floor(dts.length / 2)]);
  const out = [rows[0]];
  for (let i = 1; i < rows.length; i++) {
    if (t(rows[i]) - t(rows[i - 1]) > limit) out.push(null);
    out.push(rows[i]);
  }
  return out;
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
  ['peak_reserved', 'peak reserved vs capacity', true], ['mean_tokens_per_s', 'tokens/s', true], ['created_at', 'created', true],
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
  // The configuration it runs or ended on (its newest attempt that did not run out of memory);
  // OOM attempts are counted beside it, not drawn as the job's peak.
  const frac = j.capacity && j.peak_reserved ? j.peak_reserved / j.capacity : null;
  const meter = el('span', { class: 'meter' + (frac > 0.95 ? ' hot' : ''), 'data-fraction': frac === null ? '' : frac.toFixed(4) },
    el('span', { style: `width:${Math.min(100, (frac || 0) * 100)}%` }));
  const ooms = j.ooms ? el('span', { class: 'oom-count', title: 'attempts that ran out of memory' }, ` ${j.ooms} OOM`) : null;
  return el('tr', { 'data-job': j.id },
    el('td', { class: 'num' }, el('a', { href: `#/job/${j.id}` }, String(j.id))),
    el('td', {}, el('a', { href: `#/job/${j.id}`, class: 'job-name' }, j.name)),
    el('td', { class: `status-${j.status}` }, j.status),
    el('td', {}, j.policy),
    el('td', {}, j.rung),
    el('td', { class: 'num' }, String(j.attempts)),
    el('td', { class: 'num' }, `${j.steps_done} / ${j.steps_requested}`),
    el('td', { class: 'peak' }, meter, frac === null ? '' : `${bytes(j.peak_reserved)} / ${bytes(j.capacity)}`, ooms),
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
      const from = a.resumed_from_step || 0;
      if (a.outcome === 'oom' && !(a.last_step > from)) {
        // Out of memory before finishing a step: a mark where it failed.
        bar.appendChild(el('span', {
          class: 'oom-mark', 'data-attempt': String(a.number), style: `left:${(from / total) * 100}%`,
          title: `attempt ${a.number}: ${a.rung}, out of memory at step ${from + 1}`,
        }, `#${a.number} oom`));
        return;
      }
      if (!a.last_step) return;
      bar.appendChild(el('span', {
        'data-attempt': String(a.number),
        style: `left:${(from / total) * 100}%;width:${((a.last_step - from) / total) * 100}%;background:${RUNG_COLORS[i % RUNG_COLORS.length]}`,
        title: `attempt ${a.number}: ${a.rung}, steps ${from + 1}-${a.last_step}, ${a.outcome || 'running'}`,
      }, `#${a.number} ${a.rung}`));
    });
    container.appendChild(bar);
    drawOoms(container, attempts);
    const rows = attempts.map((a, i) => {
      const cfg = JSON.parse(a.config_json);
      const prev = i > 0 ? JSON.parse(attempts[i - 1].config_json) : null;
      const cmp = el('input', { type: 'checkbox', title: 'add to compare' });
      cmp.checked = compareSet().has(a.id);
      cmp.addEventListener('change', () => toggleCompare(a.id, cmp.checked));
      return el('tr', { class: 'attempt', 'data-outcome': a.outcome || 'running' },
        el('td', { class: 'num' }, String(a.number)), el('td', {}, a.rung),
        el('td', { class: `outcome outcome-${a.outcome || 'running'}` }, a.outcome || 'running'),
        el('td', {}, whyEnded(a)),
        el('td', { class: 'num' }, a.last_step ? `${(a.resumed_from_step || 0) + 1}–${a.last_step}` : '—'),
        el('td', { class: 'num' }, `${cfg.train.micro_batch} × ${cfg.train.global_batch / cfg.train.micro_batch / (cfg.memory.world_size || 1)}`),
        el('td', { class: 'num' }, bytes(a.peak_allocated)), el('td', { class: 'num' }, bytes(a.peak_reserved)),
        el('td', { class: 'num' }, num(a.mean_tokens_per_s)),
        el('td', {}, prev ? configDiff(prev, cfg) : el('span', { class: 'muted' }, 'as submitted')),
        el('td', { class: 'num' }, bytes(a.predicted_allocated)), el('td', { class: 'num' }, num(a.predicted_tokens_per_s)),
        el('td', {}, cmp));
    });
    container.appendChild(el('table', { id: 'attempts' },
      el('tr', {}, ['#', 'rung', 'outcome', 'why it ended', 'steps', 'micro × accum', 'peak allocated', 'peak reserved', 'tokens/s', 'config change', 'predicted peak allocated', 'predicted tokens/s', 'compare'].map((h) => el('th', {}, h))),
      rows));
    drawPlans(container, attempts);
  }

  // Why an attempt ended, in words and binary units (an OOM from its recorded figures).
  function whyEnded(a) {
    if (a.outcome !== 'oom' || a.oom_requested === null || a.oom_requested === undefined) return a.message || '';
    const live = oomLive(a);
    return `out of device memory: ${bytes(a.oom_requested)} for ${a.oom_category} did not fit — ` +
      `${bytes(live.allocated)} allocated, ${bytes(live.reserved)} reserved of ${bytes(a.capacity)}`;
  }

  // What an OOM attempt held when its request failed (recorded since migration 0004; older rows
  // only have each category's peak, which is the best there is).
  function oomLive(a) {
    const exact = a.oom_params !== null && a.oom_params !== undefined;
    const parts = CATEGORIES.slice(0, 5).map((c) => (exact ? a[`oom_${c}`] : a[`peak_${c}`]) || 0);
    return { exact, parts, allocated: parts.reduce((x, y) => x + y, 0), reserved: exact ? a.oom_reserved : a.peak_reserved };
  }

  // Each OOM attempt as a bar: what each category held when it failed, then the request that
  // did not fit, against the capacity.
  function drawOoms(container, attempts) {
    const ooms = attempts.filter((a) => a.outcome === 'oom' && a.oom_requested !== null && a.oom_requested !== undefined);
    if (!ooms.length) return;
    container.appendChild(el('h3', {}, 'Out-of-memory attempts: what was allocated when the request failed'));
    const box = el('div', { id: 'oom-bars' });
    for (const a of ooms) {
      const live = oomLive(a);
      const scale = Math.max(a.capacity || 0, live.allocated + a.oom_requested, 1);
      const pct = (v) => `${(100 * v) / scale}%`;
      const segs = CATEGORIES.slice(0, 5).map((c, i) => el('span', {
        class: 'seg', 'data-category': c, style: `width:${pct(live.parts[i])};background:${COLORS[c]}`,
        title: `${c}: ${bytes(live.parts[i])}`,
      }));
      const request = el('span', { class: 'seg request', 'data-category': 'request', style: `width:${pct(a.oom_requested)}`,
        title: `the ${a.oom_category} request that did not fit: ${bytes(a.oom_requested)}` });
      const cap = el('span', { class: 'capacity-mark', style: `left:${pct(a.capacity || 0)}`, title: `capacity ${bytes(a.capacity)}` });
      box.appendChild(el('div', { class: 'oom-row', 'data-attempt': String(a.number) },
        el('div', { class: 'oom-label' }, `#${a.number} ${a.rung}: ${bytes(live.allocated)} allocated + ${bytes(a.oom_requested)} ${a.oom_category} requested > ${bytes(a.capacity)} capacity${live.exact ? '' : ' (category peaks: recorded before the failure moment was)'}`),
        el('div', { class: 'oom-bar' }, segs, request, cap)));
    }
    box.appendChild(el('div', { class: 'oom-legend muted' },
      CATEGORIES.slice(0, 5).map((c) => el('span', {}, el('i', { style: `background:${COLORS[c]}` }), c)),
      el('span', {}, el('i', { class: 'request' }), 'request that did not fit'), el('span', {}, el('i', { class: 'cap' }), 'capacity')));
    container.appendChild(box);
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
          el('tr', {}, ['rung', 'micro × accum', 'knobs', 'predicted peak allocated', 'predicted tokens/s', 'verdict'].map((h) => el('th', {}, h))),
          p.candidates.map((x) => el('tr', { class: `verdict-${x.verdict}` },
            el('td', {}, x.rung), el('td', { class: 'num' }, `${x.micro_batch} × ${x.grad_accum}`), el('td', {}, x.knobs),
            el('td', { class: 'num' }, bytes(x.predicted_allocated)), el('td', { class: 'num' }, num(x.predicted_tokens_per_s)),
            el('td', {}, x.verdict)))));
      if (i === planned.length - 1) details.open = true;
      container.appendChild(details);
    });
  }

  function drawCharts(container, attempts, samples, job) {
    const trained = samples.filter((s) => s.loss !== null);
    const t0 = trained.length ? trained[0].t : 0;
    // A null row where training paused (daemon down, queued, between attempts): lines break.
    const steps = withGaps(trained, (s) => s.t);
    const at = (s, f) => (s === null ? null : f(s));
    const x = steps.map((s, i) => (s === null ? (steps[i - 1].t + steps[i + 1].t) / 2 - t0 : s.t - t0));
    // Memory by category, stacked, as it was at each step's peak: the categories' bytes when the
    // step's allocated total peaked (they sum to it), then the pool's cache on top — so the top
    // of the stack is what was reserved at that moment, never above the step's peak reserved.
    // (Samples from before the trainer reported the composition fall back to each category's
    // own high-water mark.)
    const composed = (s) => s.at_peak_params !== null && s.at_peak_params !== undefined;
    const layers = CATEGORIES.map((c) => steps.map((s) => at(s, (s) => {
      if (c === 'fragmentation') return composed(s) ? Math.max(0, s.at_peak_reserved - s.allocated) : s.fragmentation || 0;
      return (composed(s) ? s[`at_peak_${c}`] : s[c]) || 0;
    })));
    const cumulative = [];
    let run = x.map(() => 0);
    for (const l of layers) { run = run.map((v, i) => (l[i] === null ? null : v + l[i])); cumulative.push(run); }
    const stackTop = cumulative[cumulative.length - 1];
    const peakReserved = steps.map((s) => at(s, (s) => s.reserved));
    const cap = steps.map((s) => at(s, (s) => s.capacity || job.capacity));
    const memSeries = [{ label: 'seconds' }];
    CATEGORIES.forEach((c, i) => memSeries.push({ label: c, stroke: COLORS[c], width: 2, fill: COLORS[c] + '99', value: (u, v, si, di) => (di === null ? '' : bytes(layers[i][di])) }));
    memSeries.push({ label: 'peak reserved', stroke: COLORS.capacity, width: 1, dash: [1, 3], value: (u, v) => bytes(v) });
    memSeries.push({ label: 'capacity', stroke: COLORS.capacity, width: 2, value: (u, v) => bytes(v) });
    const memData = [x, ...cumulative, peakReserved, cap];
    if (thresholds) {
      memSeries.push({ label: `warn ${Math.round(thresholds.warn * 100)}%`, stroke: COLORS.warn, dash: [6, 4], value: (u, v) => bytes(v) });
      memSeries.push({ label: `preempt ${Math.round(thresholds.preempt * 100)}%`, stroke: COLORS.preempt, dash: [2, 3], value: (u, v) => bytes(v) });
      memData.push(cap.map((c) => (c === null ? null : c * thresholds.warn)), cap.map((c) => (c === null ? null : c * thresholds.preempt)));
    }
    const mem = chart(container, 'chart-memory', "Device memory at each step's peak, by category (stacked)", {
      height: 340,
      series: memSeries, scales: { x: { time: false }, y: { range: binaryRange } },
      axes: [{ label: 'seconds since the first step' }, BYTES_AXIS],
      bands: CATEGORIES.slice(1).map((_, i) => ({ series: [i + 2, i + 1] })),
    }, memData);
    // For the browser test: the highest stacked value and the highest peak reserved.
    const most = (v) => v.reduce((m, y) => (y === null ? m : Math.max(m, y)), 0);
    mem.root.parentElement.dataset.maxStack = String(most(stackTop));
    mem.root.parentElement.dataset.maxPeakReserved = String(most(peakReserved));
    mem.root.parentElement.dataset.gaps = String(steps.filter((s) => s === null).length);
    container.appendChild(statsTable(CATEGORIES.map((c) => [c, bytes]).concat([['peak reserved', bytes], ['capacity', bytes]]), [...layers, peakReserved, cap]));

    const tps = steps.map((s) => at(s, (s) => s.tokens_per_s));
    chart(container, 'chart-throughput', 'Throughput (tokens/s)', {
      series: [{ label: 'seconds' }, { label: 'tokens/s', stroke: COLORS.tokens }],
      scales: { x: { time: false } }, axes: [{ label: 'seconds since the first step' }, { size: 70 }],
    }, [x, tps]);
    container.appendChild(statsTable([['tokens/s', (v) => v.toFixed(0)]], [tps]));

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
  // Each attempt by its id, then its job, in the order asked for (`?attempts=` or the order
  // they were ticked); one that no longer exists is named and left out.
  const found = [];
  for (const id of wanted) {
    try {
      const a = (await api(`/api/attempts/${id}`)).body;
      const job = (await api(`/api/jobs/${a.job_id}`)).body;
      found.push({ job, a, cfg: flatten(JSON.parse(a.config_json)) });
    } catch (e) { app.appendChild(el('p', { class: 'error' }, `attempt ${id}: ${e.message}`)); }
  }
  const keys = [...new Set(found.flatMap((f) => Object.keys(f.cfg)))].sort();
  // Job id, name and attempt: two jobs of one name stay apart.
  const head = el('tr', {}, el('th', {}, ''), found.map((f) => el('th', { 'data-attempt': String(f.a.id) },
    el('a', { href: `#/job/${f.job.id}` }, `job ${f.job.id}`), ` ${f.job.name} · attempt #${f.a.number} (${f.a.rung})`)));
  const rows = keys.map((k) => {
    const vals = found.map((f) => f.cfg[k]);
    const differs = new Set(vals).size > 1;
    return el('tr', { class: differs ? 'diff-changed' : '' }, el('td', {}, k), vals.map((v) => el('td', {}, v ?? '—')));
  });
  const metric = (label, f) => el('tr', {}, el('th', {}, label), found.map((x) => el('td', { class: 'num' }, f(x.a))));
  app.appendChild(el('table', { id: 'compare' }, head,
    metric('outcome', (a) => a.outcome || 'running'),
    ['params', 'grads', 'optimizer', 'activations', 'workspace'].map((c) => metric(`peak ${c} (its own high-water mark)`, (a) => bytes(a[`peak_${c}`]))),
    metric('peak allocated (most live at once)', (a) => bytes(a.peak_allocated)),
    metric('peak reserved', (a) => bytes(a.peak_reserved)),
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
