// Drives the experiment-history page in Debian's headless Chromium and checks what a user sees.
// Usage: node check.mjs BASE_URL JOB_ID XSS_JOB_ID SCREENSHOT_DIR   (run by tests/browser.rs)
import { chromium } from 'playwright-core';
import { mkdirSync } from 'node:fs';

const [base, jobId, xssId, outDir] = process.argv.slice(2);
const XSS = '<img src=x onerror=alert(1)>';
const CATEGORIES = { params: '#4e79a7', grads: '#f28e2b', optimizer: '#e15759', activations: '#76b7b2', workspace: '#59a14f', fragmentation: '#bab0ac' };
mkdirSync(outDir, { recursive: true });
let failures = 0;
const check = (ok, what) => { console.log(`${ok ? 'ok  ' : 'FAIL'} ${what}`); if (!ok) failures++; };

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
  args: ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run', '--disable-background-networking',
    '--disable-component-update', '--disable-sync'],
});
try {
  const page = await browser.newPage({ viewport: { width: 1280, height: 1000 } });
  let dialogs = 0;
  page.on('dialog', (d) => { dialogs++; d.dismiss(); });
  const errors = [];
  page.on('pageerror', (e) => errors.push(String(e)));

  // Jobs table, with 1000+ jobs in the database: time to a rendered table.
  const t0 = Date.now();
  await page.goto(`${base}/`);
  await page.waitForSelector('#jobs tbody tr');
  const loadMs = Date.now() - t0;
  const total = await page.textContent('.controls .muted');
  console.log(`jobs page rendered in ${loadMs} ms (${total})`);
  check(loadMs < 1000, `jobs page loads in well under a second with ${total} (${loadMs} ms)`);
  await page.fill('#filter', 'squeeze');
  await page.waitForFunction(() => [...document.querySelectorAll('#jobs .job-name')].some((a) => a.textContent === 'squeeze'));
  const rows = await page.$$eval('#jobs tbody tr', (trs) => trs.map((tr) => tr.textContent));
  check(rows.length >= 1 && rows.every((r) => r.includes('squeeze')), `filter finds the job (${rows.length} row)`);
  check(rows[0].includes('finished'), 'the job is listed as finished');
  // Its bar is the configuration it finished on, not the OOM attempts' full capacity; the OOMs
  // are counted beside it.
  const meter = await page.$eval(`#jobs tr[data-job="${jobId}"] .meter`, (m) => ({ f: Number(m.dataset.fraction), hot: m.classList.contains('hot') }));
  check(meter.f > 0 && meter.f < 0.95 && !meter.hot, `the finished job's bar shows its final configuration (${JSON.stringify(meter)})`);
  check((await page.textContent(`#jobs tr[data-job="${jobId}"] .peak`)).includes('2 OOM'), 'the OOM attempts are marked beside it');
  await page.screenshot({ path: `${outDir}/jobs.png`, fullPage: true });

  // Sorting by a column reorders server-side.
  await page.goto(`${base}/#/?sort=name&order=asc`);
  await page.waitForSelector('#jobs tbody tr');
  const names = await page.$$eval('#jobs .job-name', (as) => as.map((a) => a.textContent));
  check(names.join('\n') === [...names].sort().join('\n'), 'sorting by name orders the page');

  // The job page: attempts with outcomes, charts drawn for each category.
  await page.goto(`${base}/#/job/${jobId}`);
  await page.waitForFunction((id) => document.body.dataset.jobLoaded === id, jobId);
  const outcomes = await page.$$eval('#attempts tr.attempt', (trs) => trs.map((tr) => tr.dataset.outcome));
  check(JSON.stringify(outcomes) === JSON.stringify(['oom', 'oom', 'finished']), `attempts with outcomes: ${outcomes}`);
  const why = await page.$$eval('#attempts tr.attempt', (trs) => trs.map((tr) => tr.children[3].textContent));
  check(why[0].includes('out of device memory') && /\d+\.\d\d MiB for activations/.test(why[0]) && !/\d{6}/.test(why[0]),
    `why attempt 1 ended, in binary units: ${why[0]}`);
  // Each OOM attempt: a mark on the timeline and a bar of what was live plus the request.
  check((await page.$$('#timeline .oom-mark')).length === 2, 'both OOM attempts are on the timeline');
  const oomBars = await page.$$eval('#oom-bars .oom-row', (rows) => rows.map((r) => ({
    label: r.querySelector('.oom-label').textContent,
    drawn: [...r.querySelectorAll('.seg')].filter((s) => s.getBoundingClientRect().width > 0).map((s) => s.dataset.category),
  })));
  check(oomBars.length === 2 && oomBars.every((b) => b.drawn.includes('request') && b.drawn.includes('activations') && b.drawn.includes('params')),
    `an OOM bar per attempt with its categories and the request: ${JSON.stringify(oomBars)}`);
  check(oomBars.every((b) => /allocated \+ [\d.]+ (KiB|MiB) (activations|workspace) requested > 12\.00 MiB capacity/.test(b.label)), `OOM bar labels: ${oomBars.map((b) => b.label)}`);
  const diff = await page.$$eval('#attempts tr.attempt', (trs) => trs.map((tr) => tr.children[9].textContent));
  check(diff[1].includes('memory.precision: "fp32" → "bf16"') && !diff[1].includes('micro_batch'), `config diff shows only what changed: ${diff[1]}`);
  check(diff[2].includes('train.micro_batch: 32 → 16'), `config diff of the next step-down: ${diff[2]}`);
  // Each attempt's plan: the configurations considered, the one that ran marked, the newest open.
  const plans = await page.$$eval('details.plan', (ds) => ds.map((d) => ({
    open: d.open, chosen: d.querySelectorAll('tr.verdict-chosen').length, rows: d.querySelectorAll('tr').length,
  })));
  check(plans.length === 3 && plans[2].open && !plans[0].open, `a plan per attempt, the newest open: ${JSON.stringify(plans)}`);
  check(plans.every((p) => p.chosen === 1 && p.rows > 10), `each plan marks the configuration that ran: ${JSON.stringify(plans)}`);
  const legend = await page.$$eval('#chart-memory .u-legend .u-label', (ls) => ls.map((l) => l.textContent));
  for (const c of Object.keys(CATEGORIES)) check(legend.includes(c), `memory chart has a series for ${c}`);
  check(legend.includes('capacity') && legend.some((l) => l.startsWith('preempt')), 'capacity and threshold lines');
  // Pixels of each category's colour on the memory canvas: the bands were really drawn.
  const counts = await page.$eval('#chart-memory canvas', (canvas, cats) => {
    const ctx = canvas.getContext('2d');
    const { data } = ctx.getImageData(0, 0, canvas.width, canvas.height);
    const out = {};
    for (const [name, hex] of Object.entries(cats)) {
      const [r, g, b] = [1, 3, 5].map((i) => parseInt(hex.slice(i, i + 2), 16));
      let n = 0;
      for (let i = 0; i < data.length; i += 4) {
        if (Math.abs(data[i] - r) < 12 && Math.abs(data[i + 1] - g) < 12 && Math.abs(data[i + 2] - b) < 12 && data[i + 3] > 200) n++;
      }
      out[name] = n;
    }
    return out;
  }, CATEGORIES);
  for (const [c, n] of Object.entries(counts)) check(n > 20, `memory chart drew ${c} (${n} px)`);
  // The stack is what was live at each step's peak plus the cache then: never above the peak
  // reserved the trainer measured.
  const mem = await page.$eval('#chart-memory', (d) => ({ stack: Number(d.dataset.maxStack), reserved: Number(d.dataset.maxPeakReserved), ticks: JSON.parse(d.dataset.yTicks), labels: JSON.parse(d.dataset.yLabels) }));
  check(mem.stack > 0 && mem.stack <= mem.reserved, `no stacked value above the peak reserved (${mem.stack} <= ${mem.reserved})`);
  // Axis ticks on binary steps, each label exactly its value.
  const unit = { B: 1, KiB: 1024, MiB: 1024 ** 2, GiB: 1024 ** 3 };
  const exact = mem.labels.every((l, i) => { const [v, u] = l.split(' '); return Number(v) * unit[u] === mem.ticks[i]; });
  const step = mem.ticks[1] - mem.ticks[0];
  check(mem.ticks.length >= 3 && exact && (step & (step - 1)) === 0, `memory axis: binary steps, exact labels (${mem.labels.join(', ')})`);
  // Lines break where training paused.
  const gaps = await page.evaluate(() => withGaps([{ t: 0 }, { t: 1 }, { t: 2 }, { t: 3 }, { t: 300 }, { t: 301 }], (r) => r.t).map((r) => r === null));
  check(JSON.stringify(gaps) === JSON.stringify([false, false, false, false, true, false, false]), `a pause breaks the line: ${gaps}`);
  const lossDrawn = await page.$eval('#chart-loss', (d) => Number(d.dataset.drawn));
  check(lossDrawn >= 30, `loss chart spans the job's steps (${lossDrawn} points)`);
  const stats = await page.$$eval('.stats tr', (trs) => trs.length);
  check(stats > 8, 'min / max / last tables');
  await page.screenshot({ path: `${outDir}/job.png`, fullPage: true });
  // The README's picture (docs/page.png is a copy): plans folded, down to the memory chart.
  await page.$$eval('details.plan', (ds) => ds.forEach((d) => { d.open = false; }));
  const chartBottom = await page.$eval('#chart-memory', (d) => d.getBoundingClientRect().bottom + window.scrollY);
  await page.screenshot({ path: `${outDir}/overview.png`, fullPage: true, clip: { x: 0, y: 0, width: 1280, height: Math.ceil(chartBottom + 60) } });

  // Compare, in the order asked for, each column naming its job.
  const ids = (await (await fetch(`${base}/api/jobs/${jobId}/attempts`)).json()).map((a) => a.id);
  const asked = [ids[2], ids[0]];
  await page.goto(`${base}/#/compare?attempts=${asked.join(',')}`);
  await page.waitForSelector('#compare th[data-attempt]');
  const heads = await page.$$eval('#compare th[data-attempt]', (ths) => ths.map((t) => ({ id: Number(t.dataset.attempt), text: t.textContent })));
  check(JSON.stringify(heads.map((h) => h.id)) === JSON.stringify(asked), `compare keeps the order asked for: ${JSON.stringify(heads)}`);
  check(new Set(heads.map((h) => h.text)).size === heads.length && heads.every((h) => h.text.startsWith(`job ${jobId} squeeze`)), `compare headers name the job: ${heads.map((h) => h.text)}`);
  await page.screenshot({ path: `${outDir}/compare.png`, fullPage: true });

  // A hostile job name is text, never markup.
  await page.goto(`${base}/#/?q=${encodeURIComponent('<img')}`);
  await page.waitForFunction((x) => [...document.querySelectorAll('#jobs .job-name')].some((a) => a.textContent === x), XSS);
  check((await page.$$('#jobs img')).length === 0, 'no <img> element injected in the jobs table');
  await page.goto(`${base}/#/job/${xssId}`);
  await page.waitForFunction((id) => document.body.dataset.jobLoaded === id, xssId);
  check((await page.textContent('#job-title')) === XSS, 'job page shows the name as text');
  check((await page.$$('main img')).length === 0, 'no <img> element injected in the job page');
  await page.screenshot({ path: `${outDir}/xss.png`, fullPage: true });

  await page.goto(`${base}/#/policies`);
  await page.waitForSelector('pre');
  check((await page.textContent('main')).includes('halve-micro-batch'), 'policies page lists rungs');
  await page.goto(`${base}/#/submit`);
  await page.fill('#job-yaml', 'name: x\nbogus: 1');
  await page.click('#submit');
  await page.waitForFunction(() => document.querySelector('#submit-result').textContent.length > 0 && !document.querySelector('#submit-result').textContent.includes('submitting'));
  check((await page.textContent('#submit-result')).includes('bogus'), 'submit form shows the validation error');
  await page.screenshot({ path: `${outDir}/submit.png`, fullPage: true });

  check(dialogs === 0, `no script from job data ran (${dialogs} dialogs)`);
  check(errors.length === 0, `no page errors ${errors.join('; ')}`);
} finally {
  await browser.close();
}
console.log(`${failures === 0 ? 'all browser checks passed' : `${failures} browser checks failed`}; screenshots in ${outDir}`);
process.exit(failures === 0 ? 0 : 1);
