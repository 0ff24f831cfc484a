'use strict';
// The HTTP conformance cases (test/http/cases.json, docs/http.md's table as
// data), run against the express app of conformance-app.js over real HTTP on
// 127.0.0.1 and a real server.  The Python package runs the same file
// against its FastAPI app: the two packages answer alike or a test fails.
// Order and state only: a step that waits for another request polls the
// server (pg_locks, pg_stat_activity) until that request is where the case
// says.

const assert = require('node:assert/strict');
const { spawn } = require('node:child_process');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const { after, before, describe, test } = require('node:test');

const pg = require('pg');

const { createApp } = require('./conformance-app');
const { TITLES } = require('../lib/middleware');
const { parseIdempotencyKey } = require('../lib/key');
const { SERVER_OPTIONS, installEdition, isSchemaStatement, scratchDatabase, sleep } = require('./db');

const CASES = JSON.parse(fs.readFileSync(path.join(__dirname, '..', '..', 'test', 'http', 'cases.json'), 'utf8'));
const TYPE_BASE = 'urn:idempotency:problem:';

let s;
let app;
let server;
// where the steps go: base (the app's URL), db (the runner's session),
// gates (a session of its own, which holds the closed gates), dbname
const ctx = {};

before(async () => {
	s = await scratchDatabase('conformance');
	for (const statement of CASES.app.schema.filter(isSchemaStatement)) {	// the extension: scratchDatabase
		await s.db.query(statement);
	}
	app = await createApp(s);
	await new Promise((resolve) => { server = app.app.listen(0, '127.0.0.1', resolve); });
	ctx.base = `http://127.0.0.1:${server.address().port}`;
	ctx.db = s.db;
	ctx.dbname = s.name;
	ctx.gates = new pg.Client({ database: s.name });
	await ctx.gates.connect();
});

after(async () => {
	await ctx.gates?.end().catch(() => {});
	server?.closeAllConnections?.();
	await new Promise((resolve) => server?.close(resolve) ?? resolve());
	await app?.close();
	await s?.drop();
});

async function send(ctx, { route, key, body }) {
	const headers = { 'content-type': 'application/json' };
	if (key !== undefined) {
		headers['idempotency-key'] = key;
	}
	const res = await fetch(`${ctx.base}${route}`, { method: 'POST', headers, body: JSON.stringify(body) });
	return { status: res.status, headers: res.headers, text: await res.text() };
}

// poll the server until `sql` (one row, column n) reaches `n`
async function until(ctx, sql, values, n, what) {
	for (let i = 0; i < 6000; i++) {
		const { rows } = await ctx.db.query(sql, values);
		if (rows[0].n >= n) {
			return;
		}
		await sleep(10);
	}
	throw new Error(`gave up waiting for ${what}`);
}

function check(expect, answer, named, where) {
	const at = `${where}: ${answer.status} ${answer.text.slice(0, 300)}`;
	if (expect.status !== undefined) {
		assert.equal(answer.status, expect.status, at);
	}
	for (const [name, value] of Object.entries(expect.headers ?? {})) {
		assert.equal(answer.headers.get(name), value, `${at}: header ${name}`);
	}
	if (expect.content_type !== undefined) {
		assert.equal((answer.headers.get('content-type') ?? '').split(';')[0].trim(), expect.content_type, at);
	}
	if (expect.problem !== undefined || expect.problem_members !== undefined) {
		const body = JSON.parse(answer.text);
		if (expect.problem !== undefined) {
			assert.equal(body.type, TYPE_BASE + expect.problem, at);
			assert.equal(body.status, answer.status, at);
			assert.equal(typeof body.title, 'string', at);
		}
		for (const member of expect.problem_members ?? []) {
			assert.ok(Object.hasOwn(body, member), `${at}: member ${member}`);
		}
	}
	if (expect.body_text !== undefined) {
		assert.equal(answer.text, expect.body_text, at);
	}
	if (expect.same_text_as !== undefined) {
		assert.ok(named.has(expect.same_text_as), `${where}: no answer named ${expect.same_text_as}`);
		assert.equal(answer.text, named.get(expect.same_text_as).text, `${at}: the same body as ${expect.same_text_as}`);
	}
	if (expect.retry_after !== undefined) {
		const value = answer.headers.get('retry-after');
		assert.match(value ?? '', /^[0-9]+$/, `${at}: Retry-After ${value}`);
		const [min, max] = expect.retry_after;
		assert.ok(Number(value) >= min && Number(value) <= max, `${at}: Retry-After ${value} not in [${min}, ${max}]`);
	}
}

async function runStep(ctx, step, i, named, started) {
	const where = `step ${i + 1}`;
	if (step.concurrent !== undefined) {
		const answers = await Promise.all(Array.from({ length: step.concurrent }, () => send(ctx, step.send)));
		answers.forEach((a, j) => check(step.expect ?? {}, a, named, `${where}, request ${j + 1}`));
		if (step.one_text) {
			assert.deepEqual(new Set(answers.map((a) => a.text)).size, 1, `${where}: one body for all`);
		}
	} else if (step.start !== undefined) {
		started.set(step.as, send(ctx, step.start));
		started.get(step.as).catch(() => {});
	} else if (step.await !== undefined) {
		if (step.expect?.no_answer) {
			await assert.rejects(started.get(step.await), `${where}: ${step.await} got no answer`);
			return;
		}
		const answer = await started.get(step.await);
		named.set(step.await, answer);
		check(step.expect ?? {}, answer, named, where);
	} else if (step.send !== undefined) {
		const answer = await send(ctx, step.send);
		if (step.as) {
			named.set(step.as, answer);
		}
		check(step.expect ?? {}, answer, named, where);
	} else if (step.close_gate !== undefined) {
		await ctx.gates.query('SELECT pg_advisory_lock(4242, $1)', [step.close_gate]);
	} else if (step.open_gate !== undefined) {
		await ctx.gates.query('SELECT pg_advisory_unlock(4242, $1)', [step.open_gate]);
	} else if (step.wait_gate !== undefined) {
		await until(ctx, `SELECT count(*)::int AS n FROM pg_locks
		              WHERE locktype = 'advisory' AND classid = 4242 AND objid = $1 AND NOT granted`,
		[step.wait_gate.gate], step.wait_gate.waiters, `${where}: the gate's waiters`);
	} else if (step.wait_begin !== undefined) {
		await until(ctx, `SELECT count(*)::int AS n FROM pg_stat_activity
		              WHERE datname = current_database() AND pid <> pg_backend_pid() AND state = 'active'
		                AND query LIKE '%idem_begin%' AND wait_event_type IN ('Lock', 'Extension')`,
		[], step.wait_begin.waiters, `${where}: a duplicate waiting in idem_begin`);
	} else if (step.terminate_claims) {
		await ctx.db.query(`SELECT pg_terminate_backend(pid) FROM pg_stat_activity
		                   WHERE datname = current_database() AND application_name = 'conformance-claims'`);
	} else if (step.sql_session !== undefined) {
		const c = new pg.Client({ ...ctx.connection, database: ctx.dbname });
		await c.connect();
		try {
			for (const statement of step.sql_session) {
				await c.query(statement);
			}
		} finally {
			await c.end();
		}
	} else if (step.restart_server) {
		await ctx.own.restart();
		await ctx.reconnect();
	} else if (step.kill_app) {
		await ctx.app.kill();
		ctx.app = await startApp(ctx);
		ctx.base = ctx.app.base;
	} else {
		throw new Error(`${where}: unknown step ${JSON.stringify(step)}`);
	}
}

async function runCase(ctx, c) {
	const named = new Map();
	const started = new Map();
	for (const [i, step] of c.steps.entries()) {
		await runStep(ctx, step, i, named, started);
	}
	for (const [key, kinds] of Object.entries(c.runs ?? {})) {
		const { rows } = await ctx.db.query(
			'SELECT kind, count(*)::int AS n FROM conformance_runs WHERE key = $1 GROUP BY kind', [key]);
		const found = Object.fromEntries(rows.map((r) => [r.kind, r.n]));
		for (const [kind, n] of Object.entries(kinds)) {
			assert.equal(found[kind] ?? 0, n, `runs of ${JSON.stringify(key)}, ${kind}`);
		}
	}
}

for (const c of CASES.cases) {
	test(c.name, () => runCase(ctx, c));
}

test('the problem titles are cases.json\'s, and a malformed bare key is explained in the Python package\'s words', () => {
	assert.deepEqual(TITLES, CASES.titles);
	assert.equal(parseIdempotencyKey('a b').reason, 'The Idempotency-Key header must be a quoted string ' +
		'(Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324") or one run of visible ASCII without quote, backslash, comma or semicolon.');
});

// ------------------------------------------------------ the process cases

// A server of the suite's own (never the shared one: it restarts), from
// PG_BINDIR, on a Unix socket in a temporary directory.
async function ownServer() {
	const bindir = process.env.PG_BINDIR;
	assert.ok(bindir, 'PG_BINDIR must name the PostgreSQL binaries (test/run exports it)');
	const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'idem-node-'));
	const data = path.join(tmp, 'data');
	// the exit status, not the end of the output: the server pg_ctl starts
	// keeps its standard streams open
	const run = (tool, args) => new Promise((resolve, reject) => {
		const child = spawn(path.join(bindir, tool), args, { stdio: ['ignore', 'ignore', 'inherit'] });
		child.once('error', reject);
		child.once('exit', (code) => (code === 0 ? resolve() : reject(new Error(`${tool} ${args.join(' ')}: exit status ${code}`))));
	});
	await run('initdb', ['-D', data, '-A', 'trust', '--no-sync']);
	const log = path.join(tmp, 'log');
	const ctl = (...args) => run('pg_ctl', ['-D', data, '-w', '-l', log, ...args]);
	await ctl('-o', `-k ${tmp} -c listen_addresses= -p 5432 ${SERVER_OPTIONS}`, 'start');
	return {
		connection: { host: tmp, port: 5432 },
		restart: () => ctl('-m', 'fast', 'restart'),
		async stop() {
			try {
				await ctl('-m', 'immediate', 'stop');
			} finally {
				fs.rmSync(tmp, { recursive: true, force: true });
			}
		},
	};
}

// conformance-app.js in a process of its own, for the server and database
// of ctx; resolves once it listens
function startApp(ctx) {
	const child = spawn(process.execPath, [path.join(__dirname, 'conformance-app.js'), '--listen'], {
		env: { ...process.env, PGHOST: ctx.connection.host, PGPORT: String(ctx.connection.port), PGDATABASE: ctx.dbname },
		stdio: ['ignore', 'pipe', 'inherit'],
	});
	const exited = new Promise((resolve) => child.once('exit', resolve));
	return new Promise((resolve, reject) => {
		let out = '';
		child.stdout.on('data', (chunk) => {
			out += chunk;
			if (out.includes('\n')) {
				resolve({
					base: `http://127.0.0.1:${Number(out.split('\n')[0])}`,
					kill: () => { child.kill('SIGKILL'); return exited; },
					stop: () => { child.kill('SIGTERM'); return exited; },
				});
			}
		});
		exited.then((code) => reject(new Error(`the app exited (${code}) before it listened`)));
	});
}

describe('process cases: a server of its own restarted, the app killed', () => {
	const pc = {};
	before(async () => {
		pc.own = await ownServer();
		pc.connection = pc.own.connection;
		pc.dbname = 'conformance';
		const admin = new pg.Client({ ...pc.connection, database: 'postgres' });
		await admin.connect();
		await admin.query(`CREATE DATABASE ${pc.dbname}`);
		await admin.end();
		const install = new pg.Client({ ...pc.connection, database: pc.dbname });
		await install.connect();
		try {
			await installEdition(install, { ...pc.connection, database: pc.dbname });
		} finally {
			await install.end();
		}
		pc.reconnect = async () => {
			for (const name of ['db', 'gates']) {
				await pc[name]?.end().catch(() => {});
				pc[name] = new pg.Client({ ...pc.connection, database: pc.dbname });
				pc[name].on('error', () => {});	// a restart ends it; the next step connects again
				await pc[name].connect();
			}
		};
		await pc.reconnect();
		for (const statement of CASES.app.schema.filter(isSchemaStatement)) {
			await pc.db.query(statement);
		}
	});
	after(async () => {
		await pc.app?.stop();
		await pc.db?.end().catch(() => {});
		await pc.gates?.end().catch(() => {});
		await pc.own?.stop();
	});
	for (const c of CASES.process_cases) {
		test(c.name, async () => {
			pc.app = await startApp(pc);
			pc.base = pc.app.base;
			try {
				await runCase(pc, c);
			} finally {
				await pc.app.stop();
				pc.app = undefined;
			}
		});
	}
});
