'use strict';
// The HTTP conformance cases (test/http/cases.json, docs/http.md's table as
// data), run against the express app of conformance-app.js over real HTTP on
// 127.0.0.1 and a real server.  The Python package runs the same file
// against its FastAPI app: the two packages answer alike or a test fails.
// Order and state only: a step that waits for another request polls the
// server (pg_locks, pg_stat_activity) until that request is where the case
// says.

const assert = require('node:assert/strict');
const fs = require('node:fs');
const path = require('node:path');
const { after, before, test } = require('node:test');

const pg = require('pg');

const { createApp } = require('./conformance-app');
const { scratchDatabase, sleep } = require('./db');

const CASES = JSON.parse(fs.readFileSync(path.join(__dirname, '..', '..', 'test', 'http', 'cases.json'), 'utf8'));
const TYPE_BASE = 'urn:idempotency:problem:';

let s;
let app;
let server;
let base;
let gates;	// a session of its own, which holds the closed gates

before(async () => {
	s = await scratchDatabase('conformance');
	for (const statement of CASES.app.schema) {
		if (!/^CREATE EXTENSION/i.test(statement)) {	// made by scratchDatabase
			await s.db.query(statement);
		}
	}
	app = await createApp(s);
	await new Promise((resolve) => { server = app.app.listen(0, '127.0.0.1', resolve); });
	base = `http://127.0.0.1:${server.address().port}`;
	gates = new pg.Client({ database: s.name });
	await gates.connect();
});

after(async () => {
	await gates?.end().catch(() => {});
	server?.closeAllConnections?.();
	await new Promise((resolve) => server?.close(resolve) ?? resolve());
	await app?.close();
	await s?.drop();
});

async function send({ route, key, body }) {
	const headers = { 'content-type': 'application/json' };
	if (key !== undefined) {
		headers['idempotency-key'] = key;
	}
	const res = await fetch(`${base}${route}`, { method: 'POST', headers, body: JSON.stringify(body) });
	return { status: res.status, headers: res.headers, text: await res.text() };
}

// poll the server until `sql` (one row, column n) reaches `n`
async function until(sql, values, n, what) {
	for (let i = 0; i < 6000; i++) {
		const { rows } = await s.db.query(sql, values);
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

async function runStep(step, i, named, started) {
	const where = `step ${i + 1}`;
	if (step.concurrent !== undefined) {
		const answers = await Promise.all(Array.from({ length: step.concurrent }, () => send(step.send)));
		answers.forEach((a, j) => check(step.expect ?? {}, a, named, `${where}, request ${j + 1}`));
		if (step.one_text) {
			assert.deepEqual(new Set(answers.map((a) => a.text)).size, 1, `${where}: one body for all`);
		}
	} else if (step.start !== undefined) {
		started.set(step.as, send(step.start));
		started.get(step.as).catch(() => {});
	} else if (step.await !== undefined) {
		const answer = await started.get(step.await);
		named.set(step.await, answer);
		check(step.expect ?? {}, answer, named, where);
	} else if (step.send !== undefined) {
		const answer = await send(step.send);
		if (step.as) {
			named.set(step.as, answer);
		}
		check(step.expect ?? {}, answer, named, where);
	} else if (step.close_gate !== undefined) {
		await gates.query('SELECT pg_advisory_lock(4242, $1)', [step.close_gate]);
	} else if (step.open_gate !== undefined) {
		await gates.query('SELECT pg_advisory_unlock(4242, $1)', [step.open_gate]);
	} else if (step.wait_gate !== undefined) {
		await until(`SELECT count(*)::int AS n FROM pg_locks
		              WHERE locktype = 'advisory' AND classid = 4242 AND objid = $1 AND NOT granted`,
		[step.wait_gate.gate], step.wait_gate.waiters, `${where}: the gate's waiters`);
	} else if (step.wait_begin !== undefined) {
		await until(`SELECT count(*)::int AS n FROM pg_stat_activity
		              WHERE datname = current_database() AND pid <> pg_backend_pid() AND state = 'active'
		                AND query LIKE '%idem_begin%' AND wait_event_type IN ('Lock', 'Extension')`,
		[], step.wait_begin.waiters, `${where}: a duplicate waiting in idem_begin`);
	} else if (step.terminate_claims) {
		await s.db.query(`SELECT pg_terminate_backend(pid) FROM pg_stat_activity
		                   WHERE datname = current_database() AND application_name = 'conformance-claims'`);
	} else if (step.sql_session !== undefined) {
		const c = new pg.Client({ database: s.name });
		await c.connect();
		try {
			for (const statement of step.sql_session) {
				await c.query(statement);
			}
		} finally {
			await c.end();
		}
	} else {
		throw new Error(`${where}: unknown step ${JSON.stringify(step)}`);
	}
}

for (const c of CASES.cases) {
	test(c.name, async () => {
		const named = new Map();
		const started = new Map();
		for (const [i, step] of c.steps.entries()) {
			await runStep(step, i, named, started);
		}
		for (const [key, kinds] of Object.entries(c.runs ?? {})) {
			const { rows } = await s.db.query(
				'SELECT kind, count(*)::int AS n FROM conformance_runs WHERE key = $1 GROUP BY kind', [key]);
			const found = Object.fromEntries(rows.map((r) => [r.kind, r.n]));
			for (const [kind, n] of Object.entries(kinds)) {
				assert.equal(found[kind] ?? 0, n, `runs of ${JSON.stringify(key)}, ${kind}`);
			}
		}
	});
}
