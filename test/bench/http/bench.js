// test/bench/http/bench.js: the correctness cases and the throughput slices
// of `test/run bench http`; test/bench/http/run prepares the database and
// Redis and calls it.  Prints the report (markdown) on stdout, progress on
// stderr, and writes results.json into BENCH_WORK.
//
// Environment: PG* (a database with the extension and schema.sql),
// REDIS_SOCKET, REDIS_PID, BENCH_WORK, and the knobs of test/bench/http/run.

import { spawn } from 'node:child_process';
import { readFileSync, readdirSync, writeFileSync } from 'node:fs';
import http from 'node:http';
import net from 'node:net';
import { fileURLToPath } from 'node:url';

import pg from 'pg';

import { postJson } from '../../../examples/payments-api/test/client.js';

const HERE = fileURLToPath(new URL('.', import.meta.url));
const env = process.env;
const ROUNDS = Number(env.BENCH_HTTP_ROUNDS ?? 5);
const SECONDS = Number(env.BENCH_HTTP_SECONDS ?? 3);
const CONNECTIONS = Number(env.BENCH_HTTP_CONNECTIONS ?? 16);
const REPLAY_KEYS = 200;
const LEASE_S = 3; // the extension's lease in the kill -9 case
// extbefore, extbeforeckpt: ext and extckpt with the Node package and the
// example of another revision (BENCH_HTTP_BEFORE_DIR), in the same rounds
const BEFORE = env.BENCH_HTTP_BEFORE_DIR;
const CONTENDERS = ['base', 'ext', 'expidem', 'nodeidem', ...(BEFORE ? ['extbefore'] : [])];
// extckpt: the example with CHECKPOINT=on (a checkpoint in the claim's
// statement, for a provider that must not be called twice), in the
// correctness cases and on /charges; extlease: the example with
// RECOVERY=off (1.3's path: a leased claim, no checkpoint), throughput on
// /charges only (/orders does not use recovery)
const CASE_CONTENDERS = ['base', 'ext', 'extckpt', 'expidem', 'nodeidem'];
const LABEL = {
	base: 'baseline (no idempotency)',
	ext: 'this extension (examples/payments-api)',
	extckpt: 'this extension, CHECKPOINT=on',
	extlease: 'this extension, RECOVERY=off (lease only, no checkpoint)',
	expidem: 'express-idempotency + redis',
	nodeidem: '@node-idempotency/core + redis',
	...(BEFORE ? {
		extbefore: `this extension, before (${env.BENCH_HTTP_BEFORE_REV ?? BEFORE})`,
		extbeforeckpt: `this extension, before (${env.BENCH_HTTP_BEFORE_REV ?? BEFORE}), CHECKPOINT=on`,
	} : {}),
};
const CLK_TCK = 100;
const BODY = { customer: 'cus_bench', amount: 1000, currency: 'EUR' };

const log = (...a) => console.error(`[http ${new Date().toISOString().slice(11, 19)}]`, ...a);
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const db = new pg.Client();
const children = new Set();
const results = { cases: {}, slices: [] };

// ------------------------------------------------------------ services

function freePort() {
	return new Promise((resolve, reject) => {
		const s = net.createServer();
		s.once('error', reject);
		s.listen(0, '127.0.0.1', () => {
			const { port } = s.address();
			s.close(() => resolve(port));
		});
	});
}

async function startService(contender, extra = {}) {
	const port = await freePort();
	const as = {
		extlease: { CONTENDER: 'ext', RECOVERY: 'off' },
		extckpt: { CONTENDER: 'ext', CHECKPOINT: 'on' },
		extbefore: { CONTENDER: 'ext', EXAMPLE_DIR: `${BEFORE}/examples/payments-api` },
		extbeforeckpt: { CONTENDER: 'ext', CHECKPOINT: 'on', EXAMPLE_DIR: `${BEFORE}/examples/payments-api` },
	}[contender] ?? { CONTENDER: contender };
	const proc = spawn(process.execPath, [`${HERE}/service.js`], {
		env: { ...env, ...as, PORT: String(port), ...extra },
		stdio: ['ignore', 'pipe', 'pipe'],
	});
	children.add(proc);
	proc.once('exit', () => children.delete(proc));
	proc.stderr.on('data', (d) => process.stderr.write(`[${contender} :${port}] ${d}`));
	await new Promise((resolve, reject) => {
		let out = '';
		const timer = setTimeout(() => reject(new Error(`${contender} did not start`)), 15000);
		proc.stdout.on('data', (d) => {
			out += d;
			if (out.includes('listening')) {
				clearTimeout(timer);
				resolve();
			}
		});
		proc.once('exit', (code) => reject(new Error(`${contender} exited (${code}) before listening`)));
	});
	return { proc, port, url: `http://127.0.0.1:${port}` };
}

function stopService(s, signal = 'SIGTERM') {
	return new Promise((resolve) => {
		if (s.proc.exitCode !== null || s.proc.signalCode !== null) {
			return resolve();
		}
		s.proc.once('exit', resolve);
		s.proc.kill(signal);
	});
}

// the example's test client: {status, text, replayed}, or {status: 'gave
// up'} / {status: 'no answer'}
const post = (url, path, key, body, options) => postJson(`${url}${path}`, key, body, options);

async function ledger(key) {
	const { rows } = await db.query(
		'SELECT coalesce(sum(calls), 0)::int AS calls, count(*)::int AS charges FROM provider_charges WHERE provider_key = $1', [key]);
	return rows[0];
}

async function orders(key) {
	const { rows } = await db.query('SELECT count(*)::int AS n FROM orders WHERE idempotency_key = $1', [key]);
	return rows[0].n;
}

const tally = (rs) => Object.entries(rs.reduce((m, r) => ({ ...m, [r.status]: (m[r.status] ?? 0) + 1 }), {}))
	.map(([s, n]) => (n > 1 ? `${n}× ${s}` : `${s}`)).join(', ');

// --------------------------------------------------- correctness cases
//
// Each case returns { double, note }: double = the provider calls (or order
// rows) beyond the first for the key -- each a second charge at a provider
// that does not deduplicate by key -- and what the clients saw.

const CASES = {
	async seed(svc, c) {
		// the client gives up after 50 ms and retries during the 300 ms charge
		const key = `seed-${c}-${Date.now()}`;
		const first = await post(svc.url, '/charges', key, BODY, { timeoutMs: 50 });
		const retry = await post(svc.url, '/charges', key, BODY);
		await sleep(400);
		const l = await ledger(key);
		return { double: Math.max(0, l.calls - 1), note: `first ${first.status}, retry ${retry.status}${retry.replayed ? ' (replayed)' : ''}` };
	},
	async dup12(svc, c, path = '/charges') {
		// 12 keep-alive connections, opened beforehand, then 12 requests at once
		const agents = Array.from({ length: 12 }, () => new http.Agent({ keepAlive: true, maxSockets: 1 }));
		await Promise.all(agents.map((agent) => post(svc.url, path, '', {}, { agent })));
		const key = `dup-${c}-${path.slice(1)}-${Date.now()}`;
		const rs = await Promise.all(agents.map((agent) => post(svc.url, path, key, BODY, { agent })));
		agents.forEach((a) => a.destroy());
		await sleep(400);
		const n = path === '/orders' ? await orders(key) : (await ledger(key)).calls;
		return { double: Math.max(0, n - 1), note: tally(rs) };
	},
	dup12orders(svc, c) {
		return CASES.dup12(svc, c, '/orders');
	},
	async reuse(svc, c) {
		const key = `reuse-${c}-${Date.now()}`;
		const first = await post(svc.url, '/charges', key, BODY);
		const other = await post(svc.url, '/charges', key, { ...BODY, amount: 5 });
		const l = await ledger(key);
		return { double: Math.max(0, l.calls - 1), note: `first ${first.status}, amount 5: ${other.status}` };
	},
	async error(svc, c) {
		// the provider times out (charging nothing); the retry must charge
		const key = `error-${c}-${Date.now()}`;
		const body = { ...BODY, customer: 'cus_flaky' };
		const first = await post(svc.url, '/charges', key, body);
		const retry = await post(svc.url, '/charges', key, body);
		const l = await ledger(key);
		const note = `first ${first.status}, retry ${retry.status}${retry.replayed ? ' (replayed)' : ''}`;
		return { double: Math.max(0, l.calls - 1), note: l.charges === 0 ? `${note}: never charged` : note };
	},
	async kill(_svc, c) {
		// kill -9 of the service mid-charge, restart, retry every 250 ms for 8 s
		const extra = { PROVIDER: 'ledger', LEASE: `${LEASE_S} s` };
		const svc = await startService(c, extra);
		const key = `kill-${c}-${Date.now()}`;
		const lost = post(svc.url, '/charges', key, BODY);
		for (let i = 0; (await ledger(key)).calls === 0; i++) {
			if (i > 600) {
				throw new Error('the provider was never called');
			}
			await sleep(5);
		}
		await stopService(svc, 'SIGKILL');
		await lost;
		const again = await startService(c, extra);
		const t0 = performance.now();
		const seen = [];
		let ok = null;
		while (performance.now() - t0 < 8000 && !ok) {
			const r = await post(again.url, '/charges', key, BODY, { timeoutMs: 8000 });
			seen.push(r);
			if (typeof r.status === 'number' && r.status < 300) {
				ok = { ...r, s: (performance.now() - t0) / 1000 };
			} else {
				await sleep(250);
			}
		}
		await stopService(again);
		const l = await ledger(key);
		const answer = ok ? `retry ${ok.status} after ${ok.s.toFixed(1)} s` : `no 2xx in 8 s (${tally(seen)})`;
		return { double: Math.max(0, l.calls - 1), note: `${answer}; charges with the provider's dedup: ${l.charges}` };
	},
};

const CASE_LABEL = {
	seed: 'seed: client gives up after 50 ms, retries during the 300 ms charge',
	dup12: '12 duplicates at once on open keep-alive connections (/charges)',
	dup12orders: '12 duplicates at once on open keep-alive connections (/orders, in-transaction)',
	reuse: 'key reused with another amount',
	error: 'provider times out, then the retry',
	kill: `kill -9 of the service mid-charge, restart, retry for 8 s (extension lease ${LEASE_S} s)`,
};

async function correctness() {
	for (const c of CASE_CONTENDERS) {
		const svc = await startService(c, { PROVIDER: 'ledger', PROVIDER_DELAY_MS: '300', PROVIDER_FLAKY_CUSTOMERS: 'cus_flaky' });
		results.cases[c] = {};
		for (const [name, run] of Object.entries(CASES)) {
			const r = await run(svc, c);
			results.cases[c][name] = r;
			log(`case ${name} ${c}: ${r.double} double, ${r.note}`);
		}
		await stopService(svc);
	}
}

// ---------------------------------------------------------- throughput

// utime + stime of a process, in clock ticks; for the postmaster also its
// reaped children's
function procTicks(pid, withChildren = false) {
	try {
		const s = readFileSync(`/proc/${pid}/stat`, 'utf8');
		const f = s.slice(s.lastIndexOf(')') + 2).split(' ');
		// f[0] is field 3 (state): utime = field 14, stime 15, cutime 16, cstime 17
		return Number(f[11]) + Number(f[12]) + (withChildren ? Number(f[13]) + Number(f[14]) : 0);
	} catch {
		return 0;
	}
}

function ppidOf(pid) {
	try {
		const s = readFileSync(`/proc/${pid}/stat`, 'utf8');
		return Number(s.slice(s.lastIndexOf(')') + 2).split(' ')[1]);
	} catch {
		return -1;
	}
}

// the whole server: the postmaster, its children, and those it reaped
function pgTicks(pm) {
	let t = procTicks(pm, true);
	for (const d of readdirSync('/proc')) {
		if (/^[0-9]+$/.test(d) && ppidOf(d) === pm) {
			t += procTicks(d);
		}
	}
	return t;
}

function wrk(url, args) {
	return new Promise((resolve, reject) => {
		const p = spawn('wrk', ['-t1', `-c${CONNECTIONS}`, `-d${SECONDS}s`, '--timeout', '10s',
			'-s', `${HERE}/load.lua`, url, '--', ...args], { stdio: ['ignore', 'pipe', 'pipe'] });
		let out = '';
		p.stdout.on('data', (d) => { out += d; });
		p.stderr.on('data', (d) => { out += d; });
		p.once('exit', (code) => {
			const m = /^RESULT (\d+) (\d+) (\d+) (\d+) (\d+) (\d+)$/m.exec(out);
			if (code !== 0 || !m) {
				return reject(new Error(`wrk failed (${code}): ${out}`));
			}
			const [requests, durUs, p50, p99, non2xx, sockErr] = m.slice(1).map(Number);
			resolve({ requests, rps: requests / (durUs / 1e6), p50: p50 / 1000, p99: p99 / 1000, non2xx, sockErr });
		});
	});
}

const WORKLOADS = [
	{ name: 'charges-new', path: '/charges', mode: 'new', label: 'external call (/charges), new keys' },
	{ name: 'orders-new', path: '/orders', mode: 'new', label: 'in-transaction (/orders), new keys' },
	{ name: 'charges-replay', path: '/charges', mode: 'replay', label: 'external call (/charges), replays' },
	{ name: 'orders-replay', path: '/orders', mode: 'replay', label: 'in-transaction (/orders), replays' },
];

async function slice(svc, pm, c, w, round) {
	const prefix = w.mode === 'new' ? `${w.name}-${c}-r${round}-${Date.now()}` : `${w.name}-${c}`;
	const before = { node: procTicks(svc.proc.pid), pg: pgTicks(pm), redis: procTicks(Number(env.REDIS_PID)) };
	const r = await wrk(svc.url, [w.mode, w.path, prefix, String(REPLAY_KEYS)]);
	const after = { node: procTicks(svc.proc.pid), pg: pgTicks(pm), redis: procTicks(Number(env.REDIS_PID)) };
	const us = (k) => ((after[k] - before[k]) * 1e6) / CLK_TCK / Math.max(1, r.requests);
	const row = { workload: w.name, contender: c, round, ...r, cpu: { node: us('node'), pg: us('pg'), redis: c.endsWith('idem') ? us('redis') : 0 } };
	results.slices.push(row);
	log(`round ${round} ${w.name} ${c}: ${r.rps.toFixed(0)} req/s, p50 ${r.p50.toFixed(2)} ms, p99 ${r.p99.toFixed(2)} ms, ` +
		`CPU us/req node ${row.cpu.node.toFixed(0)} pg ${row.cpu.pg.toFixed(0)} redis ${row.cpu.redis.toFixed(0)}` +
		(r.non2xx || r.sockErr ? `; ${r.non2xx} non-2xx, ${r.sockErr} socket errors` : ''));
}

const rotate = (a, n) => a.map((_, i) => a[(i + n) % a.length]);

async function throughput() {
	const { rows } = await db.query(`SELECT setting FROM pg_settings WHERE name = 'data_directory'`);
	const pm = Number(readFileSync(`${rows[0].setting}/postmaster.pid`, 'utf8').split('\n')[0]);
	// with the two "before" contenders, RECOVERY=off stays out: the server's
	// 100 connections hold only so many pools of 10
	const all = [...CONTENDERS, 'extckpt', ...(BEFORE ? ['extbeforeckpt'] : ['extlease'])];
	const contendersOf = (w) => (w.path === '/charges' ? all : CONTENDERS);
	const svcs = {};
	for (const c of all) {
		svcs[c] = await startService(c, { PROVIDER: 'memory' });
	}
	log(`warm-up, and ${REPLAY_KEYS} completed keys per contender and route for the replays`);
	for (const c of all) {
		for (const w of WORKLOADS.filter((x) => x.mode === 'replay' && contendersOf(x).includes(c))) {
			for (let i = 0; i < REPLAY_KEYS; i += 20) {
				await Promise.all(Array.from({ length: 20 },
					(_, j) => post(svcs[c].url, w.path, `${w.name}-${c}-${i + j}`, BODY)));
			}
		}
		await wrk(svcs[c].url, ['new', '/charges', `warm-${c}-${Date.now()}`]);
	}
	for (let round = 1; round <= ROUNDS; round++) {
		for (const w of WORKLOADS) {
			// the baseline has nothing to replay: with the replays' keys it
			// charges every time, which is what it is compared with
			for (const c of rotate(contendersOf(w), round - 1)) {
				await slice(svcs[c], pm, c, w, round);
			}
		}
	}
	await Promise.all(Object.values(svcs).map((s) => stopService(s)));
}

// -------------------------------------------------------------- report

function median(xs) {
	const v = xs.filter((x) => Number.isFinite(x)).sort((a, b) => a - b);
	if (v.length === 0) {
		return NaN;
	}
	return v.length % 2 ? v[(v.length - 1) / 2] : (v[v.length / 2 - 1] + v[v.length / 2]) / 2;
}

function stat(workload, c, f) {
	return median(results.slices.filter((s) => s.workload === workload && s.contender === c).map(f));
}

// the median over rounds of f(contender's slice) / f(baseline's slice in
// the same round and workload): less sensitive to the machine's load
// drifting between rounds than the ratio of medians
function paired(workload, c, f, base = 'base') {
	const of = (who) => new Map(results.slices.filter((s) => s.workload === workload && s.contender === who)
		.map((s) => [s.round, f(s)]));
	const a = of(c);
	const b = of(base);
	return median([...a].filter(([r]) => b.has(r)).map(([r, v]) => v / b.get(r)));
}

const cpuTotal = (s) => s.cpu.node + s.cpu.pg + s.cpu.redis;

const fix = (x, d = 2) => (Number.isFinite(x) ? x.toFixed(d) : '—');

function report(meta) {
	const out = [];
	const p = (s = '') => out.push(s);
	p(`## HTTP benchmark (${new Date().toISOString().slice(0, 16).replace('T', ' ')} UTC)`);
	p();
	p(meta);
	p();
	p('### Correctness: double charges per case');
	p();
	p('A double charge is a provider call (an order row) beyond the first for one key: what a provider');
	p('that does not deduplicate by key charges twice. The simulated provider does deduplicate; the kill -9');
	p('row also says how many charges remained with that.');
	p();
	p(`| case | ${CASE_CONTENDERS.map((c) => LABEL[c]).join(' | ')} |`);
	p(`|---|${CASE_CONTENDERS.map(() => '---').join('|')}|`);
	for (const name of Object.keys(CASES)) {
		p(`| ${CASE_LABEL[name]} | ${CASE_CONTENDERS.map((c) => {
			const r = results.cases[c]?.[name];
			return r ? `**${r.double}** — ${r.note}` : '—';
		}).join(' | ')} |`);
	}
	p();
	p(`### Throughput (${ROUNDS} interleaved rounds of ${SECONDS} s slices, wrk -t1 -c${CONNECTIONS}, medians)`);
	p();
	p('Ratios are to the baseline in the same round and workload, the median over the rounds (the baseline has');
	p('no replays: with the replays\' keys it charges every time). CPU: microseconds per request of the service\'s');
	p('node process, of the whole PostgreSQL server (backends and background processes), and of redis-server;');
	p('"CPU ratio" is the baseline\'s total CPU per request over this one\'s: the req/s ratio the machine would');
	p('give if CPU were all that limited it, which other tenants\' load moves less than req/s.');
	p();
	p('| workload | contender | req/s | / baseline | p50 ms | / baseline | p99 ms | / baseline | CPU µs/req: node | postgres | redis | CPU ratio | non-2xx |');
	p('|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|');
	for (const w of WORKLOADS) {
		for (const c of Object.keys(LABEL)) {
			const rows = results.slices.filter((s) => s.workload === w.name && s.contender === c);
			if (rows.length === 0) {
				continue;
			}
			const rps = stat(w.name, c, (s) => s.rps);
			const p50 = stat(w.name, c, (s) => s.p50);
			const p99 = stat(w.name, c, (s) => s.p99);
			const bad = rows.reduce((n, s) => n + s.non2xx + s.sockErr, 0);
			p(`| ${w.label} | ${LABEL[c]} | ${fix(rps, 0)} | ${fix(paired(w.name, c, (s) => s.rps))} | ` +
				`${fix(p50)} | ${fix(paired(w.name, c, (s) => s.p50))} | ${fix(p99)} | ${fix(paired(w.name, c, (s) => s.p99))} | ` +
				`${fix(stat(w.name, c, (s) => s.cpu.node), 0)} | ${fix(stat(w.name, c, (s) => s.cpu.pg), 0)} | ` +
				`${c.endsWith('idem') ? fix(stat(w.name, c, (s) => s.cpu.redis), 0) : '—'} | ` +
				`${fix(stat(w.name, 'base', cpuTotal) / stat(w.name, c, cpuTotal))} | ${bad} |`);
		}
	}
	p();
	if (BEFORE) {
		// this tree against the other revision, paired by round
		p('| workload | this / before | req/s (paired rounds) | CPU µs/req: node | postgres | total |');
		p('|---|---|---:|---:|---:|---:|');
		for (const w of WORKLOADS) {
			for (const [c, b] of [['ext', 'extbefore'], ['extckpt', 'extbeforeckpt']]) {
				if (!results.slices.some((s) => s.workload === w.name && s.contender === b)) {
					continue;
				}
				const cpu = (f) => `${fix(stat(w.name, c, f), 0)} / ${fix(stat(w.name, b, f), 0)}`;
				p(`| ${w.label} | ${LABEL[c]} | ${fix(paired(w.name, c, (s) => s.rps, b))} | ${cpu((s) => s.cpu.node)} | ` +
					`${cpu((s) => s.cpu.pg)} | ${cpu(cpuTotal)} |`);
			}
		}
		p();
	}
	// ratios to the baseline: paired; to the faster Redis library (by its
	// median): paired with that library
	const toBase = (w) => paired(w, 'ext', (s) => s.rps);
	const faster = (w) => (stat(w, 'expidem', (s) => s.rps) > stat(w, 'nodeidem', (s) => s.rps) ? 'expidem' : 'nodeidem');
	const toRedis = (w) => paired(w, 'ext', (s) => s.rps, faster(w));
	// The example's default calls the provider again after a kill -9, with
	// the same key (one charge at a provider that deduplicates by key): its
	// kill row does not count here; CHECKPOINT=on's does, and must be 0.
	const doubles = Object.entries(results.cases.ext ?? {})
		.reduce((n, [name, r]) => n + (name === 'kill' ? 0 : r.double), 0) + (results.cases.extckpt?.kill?.double ?? 0);
	const extKill = results.cases.ext?.kill;
	const targets = [
		['extension: double charges in every case (kill -9: CHECKPOINT=on; the default relies on the provider\'s dedup)',
			results.cases.ext ? `${doubles}${extKill ? ` (default, kill -9: ${extKill.double} call more; ${extKill.note})` : ''}`
				: 'not run', '0',
			results.cases.ext ? doubles === 0 : null],
		['external call, new keys: extension / baseline', fix(toBase('charges-new')), '≥ 0.75', toBase('charges-new') >= 0.75],
		['in-transaction, new keys: extension / baseline', fix(toBase('orders-new')), '≥ 0.90', toBase('orders-new') >= 0.9],
		['in-transaction, new keys: extension / faster Redis library', fix(toRedis('orders-new')), '≥ 1.00', toRedis('orders-new') >= 1],
		['external call, replays: extension / faster Redis library', fix(toRedis('charges-replay')), '≥ 0.90', toRedis('charges-replay') >= 0.9],
		['in-transaction, replays: extension / faster Redis library', fix(toRedis('orders-replay')), '≥ 0.90', toRedis('orders-replay') >= 0.9],
	];
	// issue 42: CPU per request of every process against the faster Redis
	// library's, and the claim with a checkpoint against the one without
	const cpuTo = (w, c, b) => paired(w, c, cpuTotal, b);
	const atMost = (name, x, bound) => [name, fix(x), `≤ ${bound.toFixed(2)}`, x <= bound];
	const atLeast = (name, x, bound) => [name, fix(x), `≥ ${bound.toFixed(2)}`, x >= bound];
	const targets42 = [
		atMost('external call, new keys (the example, recovery on): CPU per request, extension / faster Redis library',
			cpuTo('charges-new', 'ext', faster('charges-new')), 1),
		atLeast('external call, new keys: req/s, extension / baseline', toBase('charges-new'), 0.9),
		...[['charges-replay', 'external call'], ['orders-replay', 'in-transaction']].flatMap(([w, shape]) => [
			atLeast(`${shape}, replays: req/s, extension / faster Redis library`, toRedis(w), 1),
			atMost(`${shape}, replays: CPU per request, extension / faster Redis library`, cpuTo(w, 'ext', faster(w)), 1),
		]),
		atMost('external call, new keys: CPU per request, CHECKPOINT=on / the example',
			cpuTo('charges-new', 'extckpt', 'ext'), 1.2),
	];
	for (const [issue, list] of [['issue 22.6', targets], ['issue 42; paired rounds', targets42]]) {
		p(`| target (${issue}) | measured | required | met? |`);
		p('|---|---|---|---|');
		for (const [name, m, req, ok] of list) {
			// '—' when that part did not run
			p(`| ${name} | ${m} | ${req} | ${ok === null || m === '—' ? '—' : ok ? 'yes' : '**NO**'} |`);
		}
		p();
	}
	return out.join('\n');
}

// ---------------------------------------------------------------- main

async function main() {
	await db.connect();
	const only = (env.BENCH_HTTP_PARTS ?? 'cases,throughput').split(',');
	if (only.includes('cases')) {
		log('correctness cases');
		await correctness();
	}
	if (only.includes('throughput')) {
		log(`throughput: ${ROUNDS} rounds`);
		await throughput();
	}
	writeFileSync(`${env.BENCH_WORK}/results.json`, JSON.stringify(results, null, 1));
	console.log(report(env.BENCH_META ?? ''));
	await db.end();
}

process.on('exit', () => children.forEach((p) => p.kill('SIGKILL')));
main().catch((err) => {
	console.error(err);
	process.exit(1);
});
