// End-to-end test of the payments example: real API processes, real HTTP,
// real concurrency, against a PostgreSQL server with the idempotency
// extension installed.
//
// The server comes from the libpq environment (PGHOST, PGPORT, PGUSER,
// PGPASSWORD); IDEM_EXTENSION_VERSION picks the extension's version (default:
// the installed default_version); PGDATABASE (default postgres) is only used to create and
// finally drop a scratch database for this run.  The API processes listen
// on 127.0.0.1, on ports from API_PORT_MIN..API_PORT_MAX (default
// 56600..56699).
//
// Run: node --test test/*.test.js

import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { randomUUID } from 'node:crypto';
import { readFile } from 'node:fs/promises';
import http from 'node:http';
import net from 'node:net';
import { after, before, test } from 'node:test';
import { fileURLToPath } from 'node:url';

import pg from 'pg';

import { postJson } from './client.js';

const APP_DIR = fileURLToPath(new URL('..', import.meta.url));
const PROVIDER_DELAY_MS = 300;
const PORT_MIN = Number(process.env.API_PORT_MIN ?? 56600);
const PORT_MAX = Number(process.env.API_PORT_MAX ?? 56699);
const DB = `idem_example_${process.pid}_${Date.now() % 100000}`;

let admin;			// connection to PGDATABASE, to create and drop DB
let db;				// connection to DB, to look at the charges
let waitApi;		// the API with in_flight = wait (the default)
let raiseApi;		// the same API with in_flight = raise
const apis = {};	// the two by mode: apis.wait, apis.raise
const MODES = ['wait', 'raise'];
const children = [];
const apiOutput = new Map();	// base URL -> what the API printed until it listened
// what the tests expect in the end: rows in charges, provider calls
const expected = { charges: 0, calls: 0 };

// ------------------------------------------------------------- helpers

function newKey(label) {
	return `${label}-${randomUUID()}`;
}

function portIsFree(port) {
	return new Promise((resolve) => {
		const s = net.createServer();
		s.once('error', () => resolve(false));
		s.listen(port, '127.0.0.1', () => s.close(() => resolve(true)));
	});
}

async function pickPort(taken) {
	const span = PORT_MAX - PORT_MIN + 1;
	const start = Math.floor(Math.random() * span);
	for (let i = 0; i < span; i++) {
		const port = PORT_MIN + ((start + i) % span);
		if (!taken.has(port) && await portIsFree(port)) {
			return port;
		}
	}
	throw new Error(`no free port in ${PORT_MIN}..${PORT_MAX}`);
}

const usedPorts = new Set();

// startApi(env): a `node server.js` process; resolves to its base URL once
// it listens.  Retries on another port if the one picked got taken.
async function startApi(env) {
	for (let attempt = 1; ; attempt++) {
		const port = await pickPort(usedPorts);
		usedPorts.add(port);
		try {
			return await spawnApi(port, env);
		} catch (err) {
			if (attempt >= 3 || !/EADDRINUSE/.test(err.message)) {
				throw err;
			}
		}
	}
}

function spawnApi(port, env) {
	return new Promise((resolve, reject) => {
		const child = spawn(process.execPath, ['server.js'], {
			cwd: APP_DIR,
			env: {
				...process.env,
				PGDATABASE: DB,
				HOST: '127.0.0.1',
				PORT: String(port),
				PROVIDER_DELAY_MS: String(PROVIDER_DELAY_MS),
				PROVIDER_FLAKY_CUSTOMERS: 'cus_flaky',
				...env,
			},
			stdio: ['ignore', 'pipe', 'pipe'],
		});
		children.push(child);
		let out = '';
		let err = '';
		const timer = setTimeout(() => reject(new Error(`API did not start in 10 s:\n${out}${err}`)), 10000);
		child.stdout.on('data', (d) => {
			out += d;
			if (out.includes('listening on')) {
				clearTimeout(timer);
				apiOutput.set(`http://127.0.0.1:${port}`, out);
				resolve(`http://127.0.0.1:${port}`);
			}
		});
		// the API logs unexpected errors on stderr: show them
		child.stderr.on('data', (d) => {
			err += d;
			process.stderr.write(`[api :${port}] ${d}`);
		});
		child.once('exit', (code) => {
			clearTimeout(timer);
			reject(new Error(`API exited with status ${code}:\n${out}${err}`));
		});
	});
}

// post(base, {key, rawKey, body, timeoutMs}): POST /charges.  key is sent as
// an RFC 8941 String ("..."), rawKey verbatim; neither: no header.
async function post(base, { key, rawKey, body, timeoutMs = 15000, headers = {}, path = '/charges' }) {
	const h = { 'content-type': 'application/json', ...headers };
	if (key !== undefined) {
		h['idempotency-key'] = `"${key.replace(/[\\"]/g, '\\$&')}"`;
	} else if (rawKey !== undefined) {
		h['idempotency-key'] = rawKey;
	}
	const t0 = performance.now();
	const res = await fetch(`${base}${path}`, {
		method: 'POST',
		headers: h,
		body: typeof body === 'string' ? body : JSON.stringify(body),
		signal: AbortSignal.timeout(timeoutMs),
	});
	const text = await res.text();
	return {
		status: res.status,
		headers: res.headers,
		text,
		json: text ? JSON.parse(text) : null,
		ms: performance.now() - t0,
		doneAt: performance.now(),
	};
}

// The API's charges for a key; and the provider's calls with the key, which
// a provider that did not deduplicate by key would each have charged.
async function chargesFor(key) {
	const { rows } = await db.query(
		'SELECT id, customer, amount, currency FROM charges WHERE idempotency_key = $1 ORDER BY id', [key]);
	return rows;
}

async function providerCalls(key) {
	const { rows } = await db.query(
		'SELECT coalesce(sum(calls), 0)::int AS n FROM provider_charges WHERE provider_key = $1', [key]);
	return rows[0].n;
}

async function ordersFor(key) {
	const { rows } = await db.query('SELECT id FROM orders WHERE idempotency_key = $1', [key]);
	return rows;
}

// The state of the key's record (idem_inspect), once there is one: polls
// for up to 3 s; null if none appeared.
async function claimState(key) {
	return (await claimStates([key]))[0];
}

// The states of several keys' records, read by one statement (one
// snapshot), once every key has one; nulls after 3 s without.
async function claimStates(keys) {
	const deadline = performance.now() + 3000;
	for (;;) {
		const { rows } = await db.query(
			`SELECT k.ord, i.state
			   FROM unnest($1::text[]) WITH ORDINALITY AS k(key, ord),
			        LATERAL idem_inspect('payment.charge', k.key) AS i
			  ORDER BY k.ord`, [keys]);
		if (rows.length === keys.length) {
			return rows.map((r) => r.state);
		}
		if (performance.now() > deadline) {
			return keys.map(() => null);
		}
		await sleep(5);
	}
}

async function fingerprintHex(customer, amount, currency) {
	const { rows } = await db.query(
		`SELECT encode(idem_fingerprint($1::text, $2::bigint, $3::text), 'hex') AS fp`,
		[customer, amount, currency]);
	return rows[0].fp;
}

// A replay must be the original response: same status, same body bytes,
// same headers (but for Idempotent-Replayed).
function assertSameResponse(actual, expected) {
	assert.equal(actual.status, expected.status);
	assert.equal(actual.text, expected.text);
	assert.equal(actual.headers.get('content-type'), expected.headers.get('content-type'));
	assert.equal(actual.headers.get('location'), expected.headers.get('location'));
}

function assertCharge(res, { customer, amount, currency }) {
	assert.equal(res.status, 201, res.text);
	assert.equal(res.headers.get('content-type'), 'application/json; charset=utf-8');
	assert.match(res.json.id, /^ch_[0-9]+$/);
	assert.equal(res.headers.get('location'), `/charges/${res.json.id}`);
	assert.deepEqual(
		{ object: res.json.object, customer: res.json.customer, amount: res.json.amount, currency: res.json.currency },
		{ object: 'charge', customer, amount, currency });
}

function assertProblem(res, status, type) {
	assert.equal(res.status, status, res.text);
	assert.equal(res.headers.get('content-type'), 'application/problem+json; charset=utf-8');
	assert.equal(res.json.status, status);
	assert.equal(res.json.type, `/problems/${type}`);
	assert.equal(typeof res.json.title, 'string');
	assert.equal(typeof res.json.detail, 'string');
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// Duplicates sent together, in mode `mode`: exactly one response is fresh
// (it ran the charge), every other is its replay (wait) or, with raise, its
// replay or a 409; nothing else (no 500: no attempt lost its claim).
// `rs`: {status, text, replayed}.  Returns the fresh one.
function assertOneRan(rs, mode, what) {
	const fresh = rs.filter((r) => r.status === 201 && !r.replayed);
	assert.equal(fresh.length, 1, `${what}: one request ran, got ${rs.map((r) => r.status).join(' ')}`);
	for (const r of rs) {
		if (r.status === 201) {
			assert.equal(r.text, fresh[0].text, `${what}: a replay is the original response`);
		} else {
			assert.equal(mode, 'raise', `${what}: with wait every duplicate replays, got ${r.status}: ${r.text}`);
			assert.equal(r.status, 409, `${what}: ${r.status} ${r.text}`);
		}
	}
	return fresh[0];
}

// post()'s answer as postJson()'s {status, text, replayed}
const brief = (r) => ({ status: r.status, text: r.text, replayed: r.headers.get('idempotent-replayed') === 'true' });

// ---------------------------------------------------------- setup/teardown

before(async () => {
	admin = new pg.Client({ database: process.env.PGDATABASE || 'postgres' });
	await admin.connect();
	await admin.query(`CREATE DATABASE ${DB}`);
	db = new pg.Client({ database: DB });
	await db.connect();
	// as README.md says: a superuser creates the extension, then the tables.
	// IDEM_EXTENSION_VERSION=1.3 tests the service against an older version.
	const version = process.env.IDEM_EXTENSION_VERSION;
	await db.query(`CREATE EXTENSION idempotency${version ? ` VERSION '${version.replace(/'/g, "''")}'` : ''}`);
	await db.query(await readFile(new URL('../schema.sql', import.meta.url), 'utf8'));
	[waitApi, raiseApi] = await Promise.all([
		startApi({}),
		startApi({ IN_FLIGHT: 'raise' }),
	]);
	Object.assign(apis, { wait: waitApi, raise: raiseApi });
	// Warm up: the first fetch() of a process loads its HTTP client, which
	// can take longer than the 50 ms the first test gives a request.  These
	// requests charge nothing.
	for (const api of [waitApi, raiseApi]) {
		assert.equal((await fetch(`${api}/problems/request-in-progress`)).status, 200);
		assert.equal((await post(api, { body: {} })).status, 400);
	}
});

after(async () => {
	await Promise.all(children.map((c) => new Promise((resolve) => {
		if (c.exitCode !== null || c.signalCode !== null) {
			return resolve();
		}
		c.once('exit', resolve);
		c.kill('SIGTERM');
	})));
	await db?.end();
	if (admin) {
		await admin.query(`DROP DATABASE IF EXISTS ${DB} WITH (FORCE)`);
		await admin.end();
	}
});

// ----------------------------------------------------------------- tests

for (const mode of MODES) {
	test(`${mode}: a client times out after 50 ms and retries while the first charge runs: one charge, the retry gets its response`, async () => {
		const api = apis[mode];
		const key = newKey(`timeout-retry-${mode}`);
		const body = { customer: 'cus_alice', amount: 1000, currency: 'EUR' };

		// the first request: the client gives up after 50 ms, the server does not
		const t0 = performance.now();
		await assert.rejects(post(api, { key, body, timeoutMs: 50 }),
			(err) => err.name === 'TimeoutError');
		// The scenario needs the first attempt to hold the key when the retry
		// arrives.  It normally does by now; on a slow machine it may still be
		// connecting, so wait until its claim is committed.
		assert.equal(await claimState(key), 'pending',
			'the first attempt holds the key (pending: it is at the provider) when the retry is sent');

		let retry = await post(api, { key, body });
		if (mode === 'raise') {
			// the first attempt is still at the provider: 409; the client
			// retries after Retry-After and gets the replay
			assertProblem(retry, 409, 'request-in-progress');
			while (retry.status === 409) {
				await sleep(Number(retry.headers.get('retry-after')) * 100);
				retry = await post(api, { key, body });
			}
		}
		// the retry, same key: it waited for the first attempt (wait) or came
		// back after it (raise), and got its result
		assertCharge(retry, body);
		assert.equal(retry.headers.get('idempotent-replayed'), 'true',
			'the retry must replay the first attempt, not charge again');
		assert.ok(retry.doneAt - t0 >= PROVIDER_DELAY_MS - 20,
			`the retry came back after ${Math.round(retry.doneAt - t0)} ms: it cannot have waited for a 300 ms charge`);

		// a third request, after everything finished: the same response again
		const third = await post(api, { key, body });
		assert.equal(third.headers.get('idempotent-replayed'), 'true');
		assertSameResponse(third, retry);

		const charges = await chargesFor(key);
		assert.equal(charges.length, 1, 'exactly one charge for the key');
		assert.equal(charges[0].id, retry.json.id);
		assert.equal(await providerCalls(key), 1, 'the provider was called once');
		expected.charges += 1;
		expected.calls += 1;

		// the Location of the charge resolves
		const got = await fetch(`${api}${retry.headers.get('location')}`);
		assert.equal(got.status, 200);
		assert.deepEqual(await got.json(), retry.json);
	});

	test(`${mode}: 12 concurrent requests with one key (more than a pool has connections): one charge, no 500`, async () => {
		const key = newKey(`burst-${mode}`);
		const body = { customer: 'cus_bob', amount: 2500, currency: 'USD' };
		const responses = await Promise.all(
			Array.from({ length: 12 }, () => post(apis[mode], { key, body })));
		const fresh = assertOneRan(responses.map(brief), mode, 'POST /charges');
		assertCharge(responses.find((r) => r.text === fresh.text), body);
		if (mode === 'wait') {
			responses.forEach((r) => assertSameResponse(r, responses[0]));
		}
		assert.equal((await chargesFor(key)).length, 1, 'one charge recorded');
		assert.equal(await providerCalls(key), 1, 'the provider was called once');
		expected.charges += 1;
		expected.calls += 1;
	});

	test(`${mode}: 12 duplicates at once on 12 open keep-alive connections, both routes: one charge, one order`, async () => {
		const api = apis[mode];
		const agents = Array.from({ length: 12 }, () => new http.Agent({ keepAlive: true, maxSockets: 1 }));
		try {
			// open the connections first
			await Promise.all(agents.map((agent) => new Promise((resolve, reject) => {
				http.get(`${api}/problems/request-in-progress`, { agent }, (res) => res.resume().on('end', resolve))
					.on('error', reject);
			})));
			for (const path of ['/charges', '/orders']) {
				const key = newKey(`keepalive-${mode}${path.replace('/', '-')}`);
				const body = { customer: 'cus_lee', amount: 4100, currency: 'EUR' };
				// on already open connections the 12 reach the server together
				const rs = await Promise.all(agents.map((agent) => postJson(`${api}${path}`, key, body, { agent })));
				assertOneRan(rs, mode, path);
				if (mode === 'wait') {
					assert.deepEqual(rs.map((r) => r.status), Array(12).fill(201), path);
				}
				if (path === '/charges') {
					assert.equal(await providerCalls(key), 1);
					assert.equal((await chargesFor(key)).length, 1);
					expected.charges += 1;
					expected.calls += 1;
				} else {
					assert.equal((await ordersFor(key)).length, 1);
				}
			}
		} finally {
			agents.forEach((a) => a.destroy());
		}
	});
}

test('in_flight raise: a duplicate of a running request gets 409 at once; after it finished, a replay', async () => {
	const key = newKey('raise');
	const body = { customer: 'cus_carol', amount: 700, currency: 'GBP' };
	const first = post(raiseApi, { key, body });
	assert.equal(await claimState(key), 'pending', 'the first request holds the key');
	const dup = await post(raiseApi, { key, body });
	assertProblem(dup, 409, 'request-in-progress');
	assert.equal(dup.json.title, 'A request is outstanding for this Idempotency-Key');
	// Retry-After: an estimate of when the first attempt ends (docs/http.md),
	// not the claim's 30 s lease
	const retryAfter = Number(dup.headers.get('retry-after'));
	assert.ok(retryAfter >= 1 && retryAfter <= 5, `Retry-After ${retryAfter}`);

	const original = await first;
	assertCharge(original, body);
	assert.ok(dup.doneAt < original.doneAt, 'the 409 came at once, before the first request finished');
	assert.equal(original.headers.get('idempotent-replayed'), null);
	const later = await post(raiseApi, { key, body });
	assert.equal(later.headers.get('idempotent-replayed'), 'true');
	assertSameResponse(later, original);
	assert.equal((await chargesFor(key)).length, 1);
	assert.equal(await providerCalls(key), 1);
	expected.charges += 1;
	expected.calls += 1;
});

test('same key, another amount: 422 with both fingerprints, and no second charge', async () => {
	const key = newKey('reuse');
	const body = { customer: 'cus_dave', amount: 1000, currency: 'EUR' };
	const first = await post(waitApi, { key, body });
	assertCharge(first, body);

	const reuse = await post(waitApi, { key, body: { ...body, amount: 5 } });
	assertProblem(reuse, 422, 'idempotency-key-reused');
	assert.equal(reuse.json.title, 'Idempotency-Key is already used');
	assert.equal(reuse.json.stored_fingerprint, await fingerprintHex('cus_dave', 1000, 'EUR'));
	assert.equal(reuse.json.request_fingerprint, await fingerprintHex('cus_dave', 5, 'EUR'));
	assert.match(reuse.json.stored_fingerprint, /^[0-9a-f]{64}$/);
	assert.notEqual(reuse.json.stored_fingerprint, reuse.json.request_fingerprint);

	// same amount again: the original charge, replayed
	const again = await post(waitApi, { key, body });
	assertSameResponse(again, first);
	assert.equal((await chargesFor(key)).length, 1);
	expected.charges += 1;
	expected.calls += 1;
});

test('the fingerprint covers customer, amount and currency only: a retry with another description replays', async () => {
	const key = newKey('trace');
	const body = { customer: 'cus_erin', amount: 300, currency: 'EUR', description: 'attempt 1' };
	const first = await post(waitApi, { key, body });
	assertCharge(first, body);
	const retry = await post(waitApi, { key, body: { ...body, description: 'attempt 2, trace 7f3a' } });
	assert.equal(retry.headers.get('idempotent-replayed'), 'true');
	assertSameResponse(retry, first);
	// a different currency is a different request
	const other = await post(waitApi, { key, body: { ...body, currency: 'USD' } });
	assertProblem(other, 422, 'idempotency-key-reused');
	assert.equal((await chargesFor(key)).length, 1);
	expected.charges += 1;
	expected.calls += 1;
});

test('missing or malformed Idempotency-Key: 400, nothing charged', async () => {
	const body = { customer: 'cus_bad_key', amount: 100, currency: 'EUR' };
	const missing = await post(waitApi, { body });
	assertProblem(missing, 400, 'idempotency-key-missing');
	assert.equal(missing.json.title, 'Idempotency-Key is missing');

	const cases = [
		['256 characters', { key: 'k'.repeat(256) }],
		['empty string', { rawKey: '""' }],
		['unterminated string', { rawKey: '"abc' }],
		['text after the string', { rawKey: '"abc" x' }],
		['two keys', { rawKey: '"a", "b"' }],
		['bad escape', { rawKey: '"a\\nb"' }],
		['unquoted with a space', { rawKey: 'a b' }],
		['unquoted with a quote', { rawKey: 'a"b' }],
	];
	for (const [what, keyArgs] of cases) {
		const r = await post(waitApi, { ...keyArgs, body });
		assertProblem(r, 400, 'idempotency-key-malformed');
		assert.ok(r.json.detail.length > 0, what);
	}
	// a header sent twice arrives joined by a comma: malformed as well
	const twice = await fetch(`${waitApi}/charges`, {
		method: 'POST',
		headers: [['content-type', 'application/json'], ['idempotency-key', '"a"'], ['idempotency-key', '"b"']],
		body: JSON.stringify(body),
	});
	assert.equal(twice.status, 400);

	const { rows } = await db.query(`SELECT count(*)::int AS n FROM charges WHERE customer = 'cus_bad_key'`);
	assert.equal(rows[0].n, 0);
});

test('keys at the limits: 255 characters, escapes, and the unquoted form all work', async () => {
	const body = { customer: 'cus_frank', amount: 900, currency: 'SEK' };
	for (const key of ['k'.repeat(255), newKey('with "quotes" and \\backslash')]) {
		const r = await post(waitApi, { key, body });
		assertCharge(r, body);
		const charges = await chargesFor(key);
		assert.equal(charges.length, 1, `key ${key}`);
	}
	const bare = newKey('bare');
	const r1 = await post(waitApi, { rawKey: bare, body });
	assertCharge(r1, body);
	// the quoted and the unquoted form name the same key
	const r2 = await post(waitApi, { key: bare, body });
	assertSameResponse(r2, r1);
	assert.equal((await chargesFor(bare)).length, 1);
	expected.charges += 3;
	expected.calls += 3;
});

test('an invalid body is a 400 and does not use up the key', async () => {
	const key = newKey('invalid-body');
	for (const body of [
		{ customer: 'cus_gina', amount: -5, currency: 'EUR' },
		{ customer: 'cus_gina', amount: 1.5, currency: 'EUR' },
		{ customer: 'cus_gina', amount: 100, currency: 'euro' },
		{ amount: 100, currency: 'EUR' },
		'{"customer": "cus_gina", ',
	]) {
		assertProblem(await post(waitApi, { key, body }), 400, 'invalid-request');
	}
	const ok = await post(waitApi, { key, body: { customer: 'cus_gina', amount: 100, currency: 'EUR' } });
	assertCharge(ok, { customer: 'cus_gina', amount: 100, currency: 'EUR' });
	assert.equal(ok.headers.get('idempotent-replayed'), null);
	assert.equal((await chargesFor(key)).length, 1);
	expected.charges += 1;
	expected.calls += 1;
});

test('errors are not cached: the provider times out, the retry charges once', async () => {
	const key = newKey('flaky');
	const body = { customer: 'cus_flaky', amount: 4200, currency: 'EUR' };
	const failed = await post(waitApi, { key, body });
	assertProblem(failed, 504, 'provider-timeout');
	assert.match(failed.json.detail, /may or may not have been made/);
	assert.equal((await chargesFor(key)).length, 0);

	const retry = await post(waitApi, { key, body });
	assertCharge(retry, body);
	assert.equal(retry.headers.get('idempotent-replayed'), null, 'the retry ran the charge itself');
	const replay = await post(waitApi, { key, body });
	assertSameResponse(replay, retry);
	assert.equal((await chargesFor(key)).length, 1);
	assert.equal(await providerCalls(key), 1, 'the call that timed out charged nothing here');
	expected.charges += 1;
	expected.calls += 1;
});

for (const mode of MODES) {
	test(`${mode}: a key is not a resource lock: two keys for one customer charge in parallel`, async () => {
		const body = { customer: 'cus_hank', amount: 150, currency: 'EUR' };
		const [k1, k2] = [newKey(`parallel-${mode}`), newKey(`parallel-${mode}`)];
		const requests = Promise.all([post(apis[mode], { key: k1, body }), post(apis[mode], { key: k2, body })]);
		// both claims are held at the same time: neither waits for the other
		assert.deepEqual(await claimStates([k1, k2]), ['pending', 'pending'],
			'the two keys are claimed at the same time');
		const [a, b] = await requests;
		assertCharge(a, body);
		assertCharge(b, body);
		assert.notEqual(a.json.id, b.json.id);
		assert.equal(a.headers.get('idempotent-replayed'), null);
		assert.equal(b.headers.get('idempotent-replayed'), null);
		assert.equal((await chargesFor(k1)).length, 1);
		assert.equal((await chargesFor(k2)).length, 1);
		expected.charges += 2;
		expected.calls += 2;
	});
}

test('problem types are documented, unknown routes are problems too', async () => {
	const doc = await fetch(`${waitApi}/problems/idempotency-key-reused`);
	assert.equal(doc.status, 200);
	assert.match(await doc.text(), /^Idempotency-Key is already used\n/);
	// every problem the middleware answers with (docs/http.md) is documented
	for (const type of ['idempotency-key-missing', 'idempotency-key-malformed', 'request-in-progress',
		'idempotency-key-expired', 'response-not-stored', 'invalid-request', 'internal-error', 'service-unavailable']) {
		assert.equal((await fetch(`${waitApi}/problems/${type}`)).status, 200, type);
	}
	const nf = await fetch(`${waitApi}/nope`);
	assert.equal(nf.status, 404);
	assert.equal(nf.headers.get('content-type'), 'application/problem+json; charset=utf-8');
});

// ------------------------------------------------- in-transaction: /orders

for (const mode of MODES) {
	test(`${mode}: orders, in-transaction: 12 concurrent requests with one key make one order; the others replay it`, async () => {
		const key = newKey(`order-burst-${mode}`);
		const body = { customer: 'cus_ivy', amount: 1200, currency: 'EUR' };
		const responses = await Promise.all(
			Array.from({ length: 12 }, () => post(apis[mode], { key, body, path: '/orders' })));
		const fresh = assertOneRan(responses.map(brief), mode, 'POST /orders');
		const first = responses.find((r) => r.text === fresh.text);
		for (const r of responses.filter((x) => x.status === 201)) {
			assert.match(r.json.id, /^ord_[0-9]+$/);
			assert.equal(r.headers.get('location'), `/orders/${r.json.id}`);
			assertSameResponse(r, first);
		}
		assert.deepEqual(
			{ object: first.json.object, customer: first.json.customer, amount: first.json.amount },
			{ object: 'order', customer: 'cus_ivy', amount: 1200 });
		assert.equal((await ordersFor(key)).length, 1);
	});
}

test('orders: same key, another amount is a 422; an invalid body is a 400 that does not use up the key', async () => {
	const key = newKey('order-reuse');
	const body = { customer: 'cus_jo', amount: 100, currency: 'EUR' };
	assertProblem(await post(waitApi, { key, body: { ...body, amount: -1 }, path: '/orders' }), 400, 'invalid-request');
	const first = await post(waitApi, { key, body, path: '/orders' });
	assert.equal(first.status, 201, first.text);
	assert.equal(first.headers.get('idempotent-replayed'), null);
	assertProblem(await post(waitApi, { key, body: { ...body, amount: 5 }, path: '/orders' }), 422, 'idempotency-key-reused');
	const again = await post(raiseApi, { key, body, path: '/orders' });
	assert.equal(again.headers.get('idempotent-replayed'), 'true');
	assertSameResponse(again, first);
	assert.equal((await ordersFor(key)).length, 1);
});

// ------------------------------------------- the service killed mid-charge

async function extensionHasRecovery() {
	const { rows } = await db.query(`SELECT to_regproc('idem_checkpoint') IS NOT NULL AS ok`);
	return rows[0].ok;
}

// The default (CHECKPOINT=off) relies on the provider deduplicating by key:
// after the kill the retry takes the key over and calls the provider again,
// with the same key, and gets the first charge.  CHECKPOINT=on: the retry
// gets 'recover' and asks the provider instead: one call.
for (const checkpoint of ['off', 'on']) {
	for (const mode of MODES) {
		test(`${mode}, CHECKPOINT=${checkpoint}: the service is killed (kill -9) mid-charge: one charge, the retry answers it; 1.4 at once, 1.3 after the lease`, async (t) => {
			const recovery = await extensionHasRecovery();
			if (checkpoint === 'on' && !recovery) {
				t.skip('checkpoints need the extension\'s version 1.4');
				return;
			}
			const env = { LEASE: '2 s', IN_FLIGHT: mode, CHECKPOINT: checkpoint };
			const api = await startApi(env);
			const child = children.at(-1);
			const key = newKey(`killed-${mode}-${checkpoint}`);
			const body = { customer: 'cus_kim', amount: 800, currency: 'EUR' };
			const lost = post(api, { key, body }).catch((err) => err);
			// the provider has the call (and has charged) and the claim is committed
			const deadline = performance.now() + 3000;
			while (await providerCalls(key) === 0) {
				assert.ok(performance.now() < deadline, 'the provider was called');
				await sleep(5);
			}
			assert.equal(await claimState(key), 'pending');
			child.kill('SIGKILL');
			assert.ok((await lost) instanceof Error, 'the killed request got no answer');

			const restarted = await startApi(env);
			const t0 = performance.now();
			let retry = await post(restarted, { key, body });
			// raise: until the claim lapses (the dead process's sessions
			// ended; with 1.3 its lease) the retry gets 409, and the client
			// retries
			while (mode === 'raise' && retry.status === 409 && performance.now() - t0 < 5000) {
				await sleep(100);
				retry = await post(restarted, { key, body });
			}
			assertCharge(retry, body);
			assert.equal(retry.headers.get('idempotent-replayed'), null);
			const { rows: ledger } = await db.query(
				'SELECT id, calls FROM provider_charges WHERE provider_key = $1', [key]);
			assert.equal(ledger.length, 1, 'the provider charged once');
			assert.equal(retry.json.id, `ch_${ledger[0].id}`, 'the retry answers with the charge the killed attempt made');
			if (recovery) {
				// 1.4: the claim lapsed with the killed process's sessions
				assert.ok(performance.now() - t0 < 2000, 'the retry was answered within 2 s of the restart');
				assert.equal(ledger[0].calls, checkpoint === 'on' ? 1 : 2, checkpoint === 'on'
					? 'recover: the provider was asked, not called again'
					: 'new: the provider was called again with the same key, and returned the first charge');
			} else {
				// 1.3: the lease, not the process's death, frees the key; the
				// second call with the key returned the first charge
				assert.ok(performance.now() - t0 < 5000, 'the retry was answered once the 2 s lease had lapsed');
				assert.equal(ledger[0].calls, 2);
			}
			const charges = await chargesFor(key);
			assert.equal(charges.length, 1);
			assert.equal(charges[0].id, retry.json.id);
			expected.charges += 1;
			expected.calls += ledger[0].calls;
		});
	}
}

// ------------------------- a charge that outlasts the pools' idle timeout

// The claim is made with takeover => 'session': it lapses when its
// connection closes.  The attempt keeps that connection checked out, so the
// pool's idle timeout (here 200 ms, against a 1.5 s charge) cannot close it,
// and every duplicate sent meanwhile meets the live claim.
for (const mode of MODES) {
	test(`${mode}: a charge longer than the pools' idle timeout: duplicates meanwhile get ${mode === 'wait' ? 'its replay' : '409'}, one charge, no 500`, async () => {
		const idleMs = 200;
		const api = await startApi({ IN_FLIGHT: mode, POOL_IDLE_TIMEOUT_MS: String(idleMs), PROVIDER_DELAY_MS: '1500' });
		const key = newKey(`idle-${mode}`);
		const body = { customer: 'cus_lin', amount: 640, currency: 'EUR' };
		const first = post(api, { key, body });
		assert.equal(await claimState(key), 'pending');
		// a duplicate whenever the idle timeout has passed again, while the
		// charge runs
		const dups = [];
		for (let i = 0; i < 4; i++) {
			await sleep(idleMs + 50);
			dups.push(post(api, { key, body }));
		}
		const original = await first;
		assertCharge(original, body);
		assert.equal(original.headers.get('idempotent-replayed'), null, 'the first request ran the charge');
		const rs = [original, ...await Promise.all(dups)];
		assertOneRan(rs.map(brief), mode, 'duplicates during a long charge');
		if (mode === 'raise') {
			assert.ok(rs.slice(1).some((r) => r.status === 409), 'a duplicate met the running attempt');
		}
		const later = await post(api, { key, body });
		assert.equal(later.headers.get('idempotent-replayed'), 'true');
		assertSameResponse(later, original);
		assert.equal(await providerCalls(key), 1, 'the provider was called once');
		assert.equal((await chargesFor(key)).length, 1);
		expected.charges += 1;
		expected.calls += 1;
	});
}

// ------------------------------- bigint type parser: tokens above 2^53

// Many applications install pg.types.setTypeParser(20, parseInt) to get
// numbers for bigint columns.  Tokens are bigints above 2^53, which a number
// rounds: the example reads them as text, so its finish and abort still hold
// the key.
test('with pg.types.setTypeParser(20, parseInt) installed: tokens above 2^53 still finish and abort their claims', async () => {
	const preload = new URL('./int8-as-number.js', import.meta.url).href;
	const api = await startApi({ NODE_OPTIONS: `--import=${preload}` });
	assert.match(apiOutput.get(api), /bigint values are parsed with parseInt/);
	const body = { customer: 'cus_max', amount: 990, currency: 'EUR' };

	const key = newKey('int8');
	const first = await post(api, { key, body });
	assertCharge(first, body);
	const { rows } = await db.query(`SELECT token::text AS token FROM idem_inspect('payment.charge', $1)`, [key]);
	assert.ok(BigInt(rows[0].token) > BigInt(Number.MAX_SAFE_INTEGER),
		`the token ${rows[0].token} is above 2^53, so parseInt would have rounded it`);
	const replay = await post(api, { key, body });
	assertSameResponse(replay, first);

	// the provider times out once: idem_abort with the token releases the key
	const flakyKey = newKey('int8-flaky');
	const flakyBody = { ...body, customer: 'cus_flaky' };
	assertProblem(await post(api, { key: flakyKey, body: flakyBody }), 504, 'provider-timeout');
	const left = await db.query(`SELECT state FROM idem_inspect('payment.charge', $1)`, [flakyKey]);
	assert.deepEqual(left.rows, [], 'the claim was aborted: no record');
	assertCharge(await post(api, { key: flakyKey, body: flakyBody }), flakyBody);

	const order = await post(api, { key: newKey('int8-order'), body, path: '/orders' });
	assert.equal(order.status, 201, order.text);
	assert.equal((await chargesFor(key)).length, 1);
	assert.equal((await chargesFor(flakyKey)).length, 1);
	expected.charges += 2;
	expected.calls += 2;
});

// ------------------------------------------------------------- totals

test('in total: one charge per request that succeeded, none for the others', async () => {
	const { rows } = await db.query('SELECT count(*)::int AS n, count(DISTINCT idempotency_key)::int AS keys FROM charges');
	assert.deepEqual(rows[0], { n: expected.charges, keys: expected.charges });
	const ledger = await db.query('SELECT count(*)::int AS charges, sum(calls)::int AS calls FROM provider_charges');
	assert.deepEqual(ledger.rows[0], { charges: expected.charges, calls: expected.calls },
		'the provider charged once per charge, and was called again only after a kill -9 without a checkpoint');
	// one completed record per charge, no claim left pending
	const stats = await db.query(
		`SELECT pending::int, lapsed::int, completed::int FROM idem_stats WHERE operation = 'payment.charge'`);
	assert.deepEqual(stats.rows, [{ pending: 0, lapsed: 0, completed: expected.charges }]);
});
