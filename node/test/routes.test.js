'use strict';
// The middleware's routes beyond the conformance cases: options refused
// where a route is declared, a busy pool that must not fail open, and what
// req.idempotency.respond does when the response or its effect cannot be
// stored.  Real HTTP on 127.0.0.1 and a real server; effects are rows,
// counted.

const assert = require('node:assert/strict');
const { after, before, test } = require('node:test');
const { randomUUID } = require('node:crypto');

const express = require('express');

const { IdempotencyClient } = require('..');
const { scratchDatabase } = require('./db');

let s;
let base;
let server;
let idem;
let busy;
let busyPool;
const gates = new Map();
const quiet = { debug() {}, error() {} };
const newKey = (label) => `${label}-${randomUUID()}`;

before(async () => {
	s = await scratchDatabase('routes');
	await s.db.query(`CREATE TABLE effects (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, key text NOT NULL,
	                                        amount bigint CHECK (amount > 0))`);
	// responses over 1 kB are too large to store
	idem = new IdempotencyClient(s.pool({ max: 10, options: '-c idempotency.max_response_size=1kB' }), { log: quiet });
	busyPool = s.pool({ max: 1, connectionTimeoutMillis: 300 });
	busy = new IdempotencyClient(busyPool, { log: quiet });
	const app = express();
	app.use(express.json());
	const effect = (req) => ({ text: 'INSERT INTO effects (key, amount) VALUES ($5, $6)', values: [req.idempotency.key, req.body.amount] });
	app.post('/respond', idem.middleware({ operation: 'routes.respond', fingerprint: ['body.amount', 'body.size'], takeover: 'session' }),
		async (req, res) => {
			await req.idempotency.respond({ status: 201, body: { amount: req.body.amount, padding: 'x'.repeat(req.body.size) } },
				{ effect: effect(req) });
		});
	// a body JSON.stringify refuses
	app.post('/bigint', idem.middleware({ operation: 'routes.bigint', takeover: 'session' }), async (req, res) => {
		await req.idempotency.respond({ status: 201, body: { amount: BigInt(req.body.amount) } }, { effect: effect(req) });
	});
	app.post('/checkpoint', idem.middleware({ operation: 'routes.checkpoint', takeover: 'session' }), async (req, res) => {
		await req.idempotency.checkpoint({ step: 1 });
		res.status(201).json({ ok: true });
	});
	app.post('/busy', busy.middleware({ operation: 'routes.busy', onStoreError: 'run', takeover: 'session' }), async (req, res) => {
		await gates.get(req.body.gate);
		await s.db.query('INSERT INTO effects (key, amount) VALUES ($1, 1)', [req.idempotency?.key ?? 'unguarded']);
		res.status(201).json({ ok: true });
	});
	// eslint-disable-next-line no-unused-vars
	app.use((err, req, res, next) => res.status(500).json({ error: err.message }));
	await new Promise((resolve) => { server = app.listen(0, '127.0.0.1', resolve); });
	base = `http://127.0.0.1:${server.address().port}`;
});

after(async () => {
	await new Promise((resolve) => server?.close(resolve) ?? resolve());
	await s?.drop();
});

async function post(path, key, body) {
	const res = await fetch(`${base}${path}`, {
		method: 'POST', headers: { 'content-type': 'application/json', 'idempotency-key': key }, body: JSON.stringify(body),
	});
	const text = await res.text();
	return { status: res.status, headers: res.headers, text, json: text ? JSON.parse(text) : null };
}

async function effects(key) {
	const { rows } = await s.db.query('SELECT count(*)::int AS n FROM effects WHERE key = $1', [key]);
	return rows[0].n;
}

test('options that would leave a key stuck or are unknown are refused where the route is declared', () => {
	assert.throws(() => idem.middleware({ operation: 'x', checkpoint: true }), /checkpoint needs a recover handler/);
	assert.throws(() => idem.middleware({ operation: 'x', checkpoint: () => ({}) }), /checkpoint needs a recover handler/);
	assert.throws(() => idem.middleware({ operation: 'x', recover: 'yes' }), /recover must be a handler/);
	assert.throws(() => idem.middleware({ operation: 'x', onStoreError: 'ignore' }), /onStoreError must be 'raise' or 'run'/);
	assert.throws(() => idem.middleware({ operation: 'x', waitTimeout: 'soon' }), /waitTimeout must be a positive/);
	assert.throws(() => idem.middleware({ operation: '' }), /operation must be a non-empty string/);
	assert.doesNotThrow(() => idem.middleware({ operation: 'x', checkpoint: true, recover: (req, res) => res.end() }));
});

test('a checkpoint from a handler of a route without a recover handler is refused, and the claim released', async () => {
	const key = newKey('checkpoint');
	const r = await post('/checkpoint', key, {});
	assert.equal(r.status, 500, r.text);
	assert.match(r.json.error, /a checkpoint needs a recover handler/);
	const { rows } = await s.db.query(`SELECT * FROM idem_inspect('routes.checkpoint', $1)`, [key]);
	assert.deepEqual(rows, [], 'the 500 released the claim: no checkpoint, no record');
});

test('respond() with a response too large to store: one effect in three attempts, the retries get 410', async () => {
	const key = newKey('large');
	const body = { amount: 5, size: 5000 };
	const first = await post('/respond', key, body);
	assert.equal(first.status, 201, 'the first attempt gets its response');
	assert.equal(first.json.padding.length, 5000);
	for (let i = 0; i < 2; i++) {
		const retry = await post('/respond', key, body);
		assert.equal(retry.status, 410, retry.text);
		assert.equal(retry.json.type, 'urn:idempotency:problem:response-not-stored');
		assert.equal(retry.headers.get('idempotent-replayed'), 'true');
	}
	assert.equal(await effects(key), 1, 'the effect committed once, with the response-not-stored answer');
});

test('respond() with a body JSON.stringify refuses (a BigInt): 500, the effect done once, the key completed, retries get 410', async () => {
	const key = newKey('bigint');
	const first = await post('/bigint', key, { amount: 5 });
	assert.equal(first.status, 500, first.text);
	assert.equal(first.json.type, 'urn:idempotency:problem:response-not-stored');
	const retry = await post('/bigint', key, { amount: 5 });
	assert.equal(retry.status, 410, retry.text);
	assert.equal(retry.headers.get('idempotent-replayed'), 'true');
	assert.equal(await effects(key), 1, 'the effect committed with the response-not-stored answer');
	assert.equal(idem.pool.idleCount, idem.pool.totalCount, 'every claim\'s connection is back in the pool');
});

test('respond() whose effect fails: 500, nothing happened, the claim is released', async () => {
	const key = newKey('effect');
	const r = await post('/respond', key, { amount: -1, size: 0 });
	assert.equal(r.status, 500, r.text);
	assert.equal(r.json.type, 'urn:idempotency:problem:internal-error');
	assert.equal(await effects(key), 0);
	const { rows } = await s.db.query(`SELECT * FROM idem_inspect('routes.respond', $1)`, [key]);
	assert.deepEqual(rows, [], 'released: a retry runs again');
});

test("onStoreError 'run' does not fail open when the pool is only busy: 503, nothing runs", async () => {
	const holder = newKey('holder');
	let open;
	gates.set('g', new Promise((resolve) => { open = resolve; }));
	const first = post('/busy', holder, { gate: 'g' });
	// the first request holds the pool's one connection (its claim's)
	for (let i = 0; ; i++) {
		const { rows } = await s.db.query(
			`SELECT count(*)::int AS n FROM idem_inspect('routes.busy', $1) WHERE state = 'pending'`, [holder]);
		if (rows[0].n === 1) {
			break;
		}
		assert.ok(i < 3000, 'the first request did not claim its key');
		await new Promise((resolve) => setTimeout(resolve, 10));
	}
	const other = newKey('other');
	const r = await post('/busy', other, {});
	assert.equal(r.status, 503, r.text);
	assert.equal(r.json.type, 'urn:idempotency:problem:service-unavailable');
	assert.equal(await effects(other), 0, 'the handler did not run unguarded');
	assert.equal(await effects('unguarded'), 0);
	open();
	assert.equal((await first).status, 201);
});

test('a serialization failure (40001) that outlasts idem_begin\'s retries: 503 with Retry-After: 1, nothing runs', async () => {
	const key = newKey('serialization');
	await s.db.query(`CREATE FUNCTION refuse_claim() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF NEW.key = '${key}' THEN
				RAISE EXCEPTION 'could not serialize access' USING ERRCODE = 'serialization_failure';
			END IF;
			RETURN NEW;
		END $$`);
	await s.db.query('CREATE TRIGGER refuse_claim BEFORE INSERT OR UPDATE ON idem_record FOR EACH ROW EXECUTE FUNCTION refuse_claim()');
	try {
		const r = await post('/respond', key, { amount: 5, size: 0 });
		assert.equal(r.status, 503, r.text);
		assert.equal(r.json.type, 'urn:idempotency:problem:service-unavailable');
		assert.equal(r.headers.get('retry-after'), '1');
	} finally {
		await s.db.query('DROP FUNCTION refuse_claim() CASCADE');
	}
	assert.equal(await effects(key), 0);
});
