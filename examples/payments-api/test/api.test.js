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
const children = [];

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

test('a client times out after 50 ms and retries while the first charge runs: one charge, the retry gets its response', async () => {
	const key = newKey('timeout-retry');
	const body = { customer: 'cus_alice', amount: 1000, currency: 'EUR' };

	// the first request: the client gives up after 50 ms, the server does not
	const t0 = performance.now();
	await assert.rejects(post(waitApi, { key, body, timeoutMs: 50 }),
		(err) => err.name === 'TimeoutError');
	// The scenario needs the first attempt to hold the key when the retry
	// arrives.  It normally does by now; on a slow machine it may still be
	// connecting, so wait until its claim is committed.
	assert.equal(await claimState(key), 'pending',
		'the first attempt holds the key (pending: it is at the provider) when the retry is sent');

	// the retry, same key: it waits for the first attempt and gets its result
	const retry = await post(waitApi, { key, body });
	assertCharge(retry, body);
	assert.equal(retry.headers.get('idempotent-replayed'), 'true',
		'the retry must replay the first attempt, not charge again');
	assert.ok(retry.doneAt - t0 >= PROVIDER_DELAY_MS - 20,
		`the retry came back after ${Math.round(retry.doneAt - t0)} ms: it cannot have waited for a 300 ms charge`);

	// a third request, after everything finished: the same response again
	const third = await post(waitApi, { key, body });
	assert.equal(third.headers.get('idempotent-replayed'), 'true');
	assertSameResponse(third, retry);

	const charges = await chargesFor(key);
	assert.equal(charges.length, 1, 'exactly one charge for the key');
	assert.equal(charges[0].id, retry.json.id);
	assert.equal(await providerCalls(key), 1, 'the provider was called once');

	// the Location of the charge resolves
	const got = await fetch(`${waitApi}${retry.headers.get('location')}`);
	assert.equal(got.status, 200);
	assert.deepEqual(await got.json(), retry.json);
});

test('12 concurrent requests with one key (more than a pool has connections): one charge, 12 identical responses', async () => {
	const key = newKey('burst');
	const body = { customer: 'cus_bob', amount: 2500, currency: 'USD' };
	const responses = await Promise.all(
		Array.from({ length: 12 }, () => post(waitApi, { key, body })));
	for (const r of responses) {
		assertCharge(r, body);
		assertSameResponse(r, responses[0]);
	}
	const fresh = responses.filter((r) => r.headers.get('idempotent-replayed') !== 'true');
	assert.equal(fresh.length, 1, 'one request ran the charge, the other 11 replayed it');
	assert.equal((await chargesFor(key)).length, 1);
	assert.equal(await providerCalls(key), 1);
});

test('12 duplicates at once on 12 open keep-alive connections, both routes: one charge, one order', async () => {
	const agents = Array.from({ length: 12 }, () => new http.Agent({ keepAlive: true, maxSockets: 1 }));
	try {
		// open the connections first
		await Promise.all(agents.map((agent) => new Promise((resolve, reject) => {
			http.get(`${waitApi}/problems/request-in-progress`, { agent }, (res) => res.resume().on('end', resolve))
				.on('error', reject);
		})));
		for (const path of ['/charges', '/orders']) {
			const key = newKey(`keepalive${path.replace('/', '-')}`);
			const body = { customer: 'cus_lee', amount: 4100, currency: 'EUR' };
			// on already open connections the 12 reach the server together
			const rs = await Promise.all(agents.map((agent) => postJson(`${waitApi}${path}`, key, body, { agent })));
			assert.deepEqual(rs.map((r) => r.status), Array(12).fill(201), path);
			assert.equal(new Set(rs.map((r) => r.text)).size, 1, 'the same body 12 times');
			assert.equal(rs.filter((r) => !r.replayed).length, 1, 'one request ran, 11 replayed');
			if (path === '/charges') {
				assert.equal(await providerCalls(key), 1);
				assert.equal((await chargesFor(key)).length, 1);
			} else {
				assert.equal((await ordersFor(key)).length, 1);
			}
		}
	} finally {
		agents.forEach((a) => a.destroy());
	}
});

test('in_flight raise: a duplicate of a running request gets 409 at once; after it finished, a replay', async () => {
	const key = newKey('raise');
	const body = { customer: 'cus_carol', amount: 700, currency: 'GBP' };
	const first = post(raiseApi, { key, body });
	assert.equal(await claimState(key), 'pending', 'the first request holds the key');
	const dup = await post(raiseApi, { key, body });
	assertProblem(dup, 409, 'request-in-progress');
	assert.equal(dup.json.title, 'A request is outstanding for this Idempotency-Key');
	assert.equal(dup.headers.get('retry-after'), '1');

	const original = await first;
	assertCharge(original, body);
	assert.ok(dup.doneAt < original.doneAt, 'the 409 came at once, before the first request finished');
	assert.equal(original.headers.get('idempotent-replayed'), null);
	const later = await post(raiseApi, { key, body });
	assert.equal(later.headers.get('idempotent-replayed'), 'true');
	assertSameResponse(later, original);
	assert.equal((await chargesFor(key)).length, 1);
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
});

test('a key is not a resource lock: two keys for one customer charge in parallel', async () => {
	const body = { customer: 'cus_hank', amount: 150, currency: 'EUR' };
	const [k1, k2] = [newKey('parallel'), newKey('parallel')];
	const requests = Promise.all([post(waitApi, { key: k1, body }), post(waitApi, { key: k2, body })]);
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
});

test('problem types are documented, unknown routes are problems too', async () => {
	const doc = await fetch(`${waitApi}/problems/idempotency-key-reused`);
	assert.equal(doc.status, 200);
	assert.match(await doc.text(), /^Idempotency-Key is already used\n/);
	const nf = await fetch(`${waitApi}/nope`);
	assert.equal(nf.status, 404);
	assert.equal(nf.headers.get('content-type'), 'application/problem+json; charset=utf-8');
});

test('in total: one charge per request that succeeded, none for the others', async () => {
	// timeout-retry 1, burst 1, keep-alive 1, raise 1, reuse 1, trace 1,
	// limits 3, invalid-body 1, flaky 1, parallel 2
	const { rows } = await db.query('SELECT count(*)::int AS n, count(DISTINCT idempotency_key)::int AS keys FROM charges');
	assert.deepEqual(rows[0], { n: 13, keys: 13 });
	const calls = await db.query('SELECT sum(calls)::int AS n FROM provider_charges');
	assert.equal(calls.rows[0].n, 13, 'the API called the provider once per charge');
	// one completed record per charge, no claim left pending
	const stats = await db.query(
		`SELECT pending::int, lapsed::int, completed::int FROM idem_stats WHERE operation = 'payment.charge'`);
	assert.deepEqual(stats.rows, [{ pending: 0, lapsed: 0, completed: 13 }]);
});

// ------------------------------------------------- in-transaction: /orders

test('orders, in-transaction: 12 concurrent requests with one key make one order; the other 11 replay it', async () => {
	const key = newKey('order-burst');
	const body = { customer: 'cus_ivy', amount: 1200, currency: 'EUR' };
	const responses = await Promise.all(
		Array.from({ length: 12 }, () => post(waitApi, { key, body, path: '/orders' })));
	for (const r of responses) {
		assert.equal(r.status, 201, r.text);
		assert.match(r.json.id, /^ord_[0-9]+$/);
		assert.equal(r.headers.get('location'), `/orders/${r.json.id}`);
		assertSameResponse(r, responses[0]);
	}
	assert.deepEqual(
		{ object: responses[0].json.object, customer: responses[0].json.customer, amount: responses[0].json.amount },
		{ object: 'order', customer: 'cus_ivy', amount: 1200 });
	assert.equal(responses.filter((r) => r.headers.get('idempotent-replayed') !== 'true').length, 1);
	assert.equal((await ordersFor(key)).length, 1);
});

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

test('the service is killed (kill -9) mid-charge: one charge; 1.4 recovers at once, 1.3 after the lease', async () => {
	const { rows } = await db.query(`SELECT to_regproc('idem_checkpoint') IS NOT NULL AS ok`);
	const recovery = rows[0].ok;
	const env = { LEASE: '2 s' };
	const api = await startApi(env);
	const child = children.at(-1);
	const key = newKey('killed');
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
	const retry = await post(restarted, { key, body });
	assertCharge(retry, body);
	if (recovery) {
		// 1.4: the claim lapsed with the killed process's sessions; the retry
		// got 'recover' with the checkpoint and asked the provider, which had
		// charged: no second call
		assert.ok(performance.now() - t0 < 2000, 'the retry was answered within 2 s of the restart');
		assert.equal(await providerCalls(key), 1);
	} else {
		// 1.3: the lease, not the process's death, frees the key; the second
		// call with the key returned the first charge (the provider dedups)
		assert.ok(performance.now() - t0 < 5000, 'the retry was answered once the 2 s lease had lapsed');
		assert.equal(await providerCalls(key), 2);
	}
	const charges = await chargesFor(key);
	assert.equal(charges.length, 1);
	assert.equal(charges[0].id, retry.json.id);
});
