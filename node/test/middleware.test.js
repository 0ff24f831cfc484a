'use strict';
// The express middleware over real HTTP on 127.0.0.1: header validation,
// replays with the allow-listed headers, 409 with Retry-After from the
// lease, 422 with both fingerprints, 410, errors not cached, concurrent
// duplicates, recovery after the claim's session ended.  Effects are rows in
// a table, counted.

const assert = require('node:assert/strict');
const { after, before, test } = require('node:test');
const { randomUUID } = require('node:crypto');

const express = require('express');

const { IdempotencyClient } = require('..');
const { expireCompleted, failFirstFinish, scratchDatabase, sleep } = require('./db');

let s;
let base;
let server;
let idem;
const outcomes = {};
const gates = new Map();	// key -> a promise the handler waits for
const arrivals = new Map();	// key -> resolves once a handler is at its gate

const newKey = (label) => `${label}-${randomUUID()}`;

before(async () => {
	s = await scratchDatabase('mw');
	await s.db.query('CREATE TABLE effects (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, key text NOT NULL, amount bigint)');
	idem = new IdempotencyClient(s.pool({ max: 20, idleTimeoutMillis: 100 }), {
		onOutcome: (op, outcome) => { outcomes[outcome] = (outcomes[outcome] ?? 0) + 1; },
	});
	const app = express();
	app.use(express.json());
	const problemType = (name) => `/problems/${name}`;
	const opts = {
		operation: 'test.charge', fingerprint: ['body.amount', 'body.currency', 'params.account'], problemType,
		takeover: 'session', lease: '20 s',
	};
	// automatic: what res.json sends is stored
	app.post('/auto/:account', idem.middleware(opts), async (req, res) => {
		await atGate(req.idempotency.key);
		if (req.body.fail) {
			return res.status(502).json({ error: 'provider down' });
		}
		await s.db.query('INSERT INTO effects (key, amount) VALUES ($1, $2)', [req.idempotency.key, req.body.amount]);
		res.status(201).set('Location', `/things/${req.body.amount}`).set('ETag', '"v1"').set('X-Request-Id', randomUUID())
			.json({ zeta: 1, amount: req.body.amount, status: req.idempotency.status, recovered: req.idempotency.recovered });
	});
	// explicit: the effect in the finishing statement
	// (a takeover's retry, status 'recover', runs the same function)
	const explicit = async (req, res) => {
		await atGate(req.idempotency.key);
		await req.idempotency.respond(
			{ status: 201, headers: { location: '/x' }, body: { status: req.idempotency.status, recovered: req.idempotency.recovered } },
			{ effect: { text: 'INSERT INTO effects (key, amount) VALUES ($5, $6)', values: [req.idempotency.key, req.body.amount] } });
	};
	app.post('/explicit/:account', idem.middleware({
		...opts, operation: 'test.explicit', inFlight: 'raise', checkpoint: true, recover: explicit,
	}), explicit);
	app.post('/remembered/:account', idem.middleware({ ...opts, operation: 'test.remembered', remember: '30 days', ttl: '1 min' }),
		(req, res) => res.status(200).json({ ok: true }));
	await new Promise((resolve) => { server = app.listen(0, '127.0.0.1', resolve); });
	base = `http://127.0.0.1:${server.address().port}`;
});

after(async () => {
	await new Promise((resolve) => server?.close(resolve) ?? resolve());
	await s?.drop();
});

async function post(path, { key, rawKey, body = { amount: 100, currency: 'EUR' } } = {}) {
	const headers = { 'content-type': 'application/json' };
	if (key !== undefined) {
		headers['idempotency-key'] = `"${key}"`;
	} else if (rawKey !== undefined) {
		headers['idempotency-key'] = rawKey;
	}
	const res = await fetch(`${base}${path}`, { method: 'POST', headers, body: JSON.stringify(body) });
	const text = await res.text();
	return { status: res.status, headers: res.headers, text, json: text ? JSON.parse(text) : null };
}

async function effects(key) {
	const { rows } = await s.db.query('SELECT count(*)::int AS n FROM effects WHERE key = $1', [key]);
	return rows[0].n;
}

// the text forms, as docs/managed-postgresql.md tells a caller of the
// portable edition's idem_fingerprint (the C edition's answers alike)
async function serverFingerprint(...values) {
	const { rows } = await s.db.query(`SELECT encode(idem_fingerprint($1::bigint::text, $2::text, $3::text), 'hex') AS fp`, values);
	return rows[0].fp;
}

// gate(key): the handlers of key wait until the function returned is
// called; its .reached resolves once a handler waits there
function gate(key) {
	let open;
	gates.set(key, new Promise((resolve) => { open = resolve; }));
	const release = () => { open(); gates.delete(key); };
	release.reached = new Promise((resolve) => { arrivals.set(key, resolve); });
	return release;
}

async function atGate(key) {
	arrivals.get(key)?.();
	await gates.get(key);
}

async function pendingState(key, operation) {
	for (let i = 0; i < 300; i++) {
		const { rows } = await s.db.query('SELECT state FROM idem_inspect($1, $2)', [operation, key]);
		if (rows[0]?.state === 'pending') {
			return;
		}
		await sleep(10);
	}
	throw new Error('the claim did not appear');
}

test('the Idempotency-Key header: missing, empty, over 255 characters, malformed: 400 problem+json, nothing runs', async () => {
	const missing = await post('/auto/acc1', {});
	assert.equal(missing.status, 400);
	assert.equal(missing.headers.get('content-type'), 'application/problem+json; charset=utf-8');
	assert.deepEqual([missing.json.type, missing.json.title, missing.json.status],
		['/problems/idempotency-key-missing', 'Idempotency-Key is missing', 400]);
	for (const rawKey of ['', '""', `"${'k'.repeat(256)}"`, '"a", "b"', 'a b']) {
		const r = await post('/auto/acc1', { rawKey });
		assert.equal(r.status, 400, rawKey);
		assert.match(r.json.type, /^\/problems\/idempotency-key-(missing|malformed)$/);
	}
	assert.equal((await post('/auto/acc1', { key: 'k'.repeat(255) })).status, 201, '255 characters are fine');
	const { rows } = await s.db.query('SELECT count(*)::int AS n FROM effects');
	assert.equal(rows[0].n, 1);
});

test('a replay: the original status, the allow-listed headers (Location, ETag) and body, Idempotent-Replayed: true', async () => {
	const key = newKey('replay');
	const first = await post('/auto/acc1', { key });
	assert.equal(first.status, 201, first.text);
	assert.equal(first.headers.get('idempotent-replayed'), null);
	assert.equal(first.headers.get('location'), '/things/100');
	assert.equal(first.headers.get('etag'), '"v1"');
	assert.equal(first.headers.get('content-type'), 'application/json; charset=utf-8');
	const replay = await post('/auto/acc1', { key });
	assert.equal(replay.status, 201);
	assert.equal(replay.headers.get('idempotent-replayed'), 'true');
	assert.equal(replay.text, first.text, 'the first response was sent from what was stored: byte for byte');
	assert.equal(replay.headers.get('location'), '/things/100');
	assert.equal(replay.headers.get('etag'), '"v1"');
	assert.equal(replay.headers.get('x-request-id'), null, 'headers not allow-listed are not replayed');
	assert.equal(replay.headers.get('content-type'), first.headers.get('content-type'));
	assert.equal(await effects(key), 1);
});

test('12 concurrent duplicates (wait): one effect, every other response is its replay', async () => {
	const key = newKey('burst');
	const open = gate(key);
	const rs = Promise.all(Array.from({ length: 12 }, () => post('/auto/acc1', { key })));
	await pendingState(key, 'test.charge');
	await sleep(100);
	open();
	const all = await rs;
	assert.deepEqual(all.map((r) => r.status), Array(12).fill(201));
	assert.equal(all.filter((r) => r.headers.get('idempotent-replayed') !== 'true').length, 1);
	assert.equal(new Set(all.map((r) => r.text)).size, 1);
	assert.equal(await effects(key), 1);
});

test('in_flight raise: 409 with a short Retry-After (not the 20 s lease), while the claim outlives the pool\'s idle timeout', async () => {
	const key = newKey('raise');
	const open = gate(key);
	const first = post('/explicit/acc1', { key });
	await pendingState(key, 'test.explicit');
	for (let i = 0; i < 3; i++) {
		await sleep(150);	// past the pool's 100 ms idle timeout
		const dup = await post('/explicit/acc1', { key });
		assert.equal(dup.status, 409, dup.text);
		assert.equal(dup.json.title, 'A request is outstanding for this Idempotency-Key');
		const retryAfter = Number(dup.headers.get('retry-after'));
		// an estimate of when the first attempt ends, not the lease's 20 s
		assert.ok(retryAfter >= 1 && retryAfter <= 5, `Retry-After ${retryAfter}`);
	}
	open();
	const r = await first;
	assert.equal(r.status, 201, r.text);
	assert.deepEqual(r.json, { status: 'new', recovered: null });
	assert.equal(await effects(key), 1, 'the effect ran in the finishing statement');
	const again = await post('/explicit/acc1', { key });
	assert.equal(again.headers.get('idempotent-replayed'), 'true');
	assert.equal(again.text, r.text);
});

test('same key, other request parts: 422 with both fingerprints, equal to the server\'s idem_fingerprint', async () => {
	const key = newKey('reuse');
	assert.equal((await post('/auto/acc1', { key, body: { amount: 100, currency: 'EUR' } })).status, 201);
	for (const [path, body, account] of [['/auto/acc1', { amount: 5, currency: 'EUR' }, 'acc1'], ['/auto/acc2', { amount: 100, currency: 'EUR' }, 'acc2']]) {
		const r = await post(path, { key, body });
		assert.equal(r.status, 422, r.text);
		assert.equal(r.json.type, '/problems/idempotency-key-reused');
		assert.equal(r.json.stored_fingerprint, await serverFingerprint(100, 'EUR', 'acc1'));
		assert.equal(r.json.request_fingerprint, await serverFingerprint(body.amount, body.currency, account));
	}
	// a field outside the fingerprint may change
	assert.equal((await post('/auto/acc1', { key, body: { amount: 100, currency: 'EUR', note: 'retry' } })).headers.get('idempotent-replayed'), 'true');
	assert.equal(await effects(key), 1);
});

test('a fraction in a fingerprinted field is a 400, before anything is claimed', async () => {
	const r = await post('/auto/acc1', { key: newKey('fraction'), body: { amount: 1.5, currency: 'EUR' } });
	assert.equal(r.status, 400, r.text);
	assert.equal(r.json.type, '/problems/invalid-request');
});

test('errors are not cached: a 502 aborts the claim before it is sent, the retry runs', async () => {
	const key = newKey('fail');
	const failed = await post('/auto/acc1', { key, body: { amount: 100, currency: 'EUR', fail: true } });
	assert.equal(failed.status, 502);
	const { rows } = await s.db.query(`SELECT state FROM idem_inspect('test.charge', $1)`, [key]);
	assert.deepEqual(rows, [], 'aborted before the response left');
	const retry = await post('/auto/acc1', { key });
	assert.equal(retry.status, 201);
	assert.equal(retry.headers.get('idempotent-replayed'), null);
	assert.equal(await effects(key), 1);
});

test('410 for a remembered key whose response expired', async () => {
	const key = newKey('remembered');
	assert.equal((await post('/remembered/acc1', { key })).status, 200);
	await expireCompleted(s.db, key);
	const r = await post('/remembered/acc1', { key });
	assert.equal(r.status, 410, r.text);
	assert.equal(r.json.type, '/problems/idempotency-key-expired');
});

test('checkpoint on: after the attempt\'s session ended, the retry gets recover with the checkpoint; the old attempt gets 500', async () => {
	const key = newKey('recover');
	const open = gate(key);
	const first = post('/explicit/acc1', { key });
	await pendingState(key, 'test.explicit');
	// the first attempt's handler waits at its gate: it must not run
	// before the retry (gates.delete below lets the retry's handler by)
	await open.reached;
	const { rows: [claim] } = await s.db.query(`SELECT checkpoint FROM idem_inspect('test.explicit', $1)`, [key]);
	assert.deepEqual(claim.checkpoint, { idempotency_key: key });
	// the worker's connection ends (as when its process dies)
	await s.db.query(`SELECT pg_terminate_backend(pid) FROM pg_stat_activity
	                   WHERE datname = current_database() AND pid <> pg_backend_pid() AND query LIKE '%idem_begin%'
	                     AND state = 'idle'`);
	gates.delete(key);	// the retry's handler runs at once
	const retry = await post('/explicit/acc1', { key });
	assert.equal(retry.status, 201, retry.text);
	assert.deepEqual(retry.json, { status: 'recover', recovered: { idempotency_key: key } });
	open();
	const old = await first;
	assert.equal(old.status, 500, 'the first attempt lost its claim: IK412');
	assert.equal(old.json.type, '/problems/response-not-stored');
	assert.equal(await effects(key), 1, 'only the owner\'s effect committed');
});

test('the database refuses every finish of the key after the handler ran: 500, the claim kept with a checkpoint, the response stored once it can be', async () => {
	const key = newKey('nostore');
	// every finish of this key fails (a server error), its checkpoint does not
	await s.db.query(`CREATE FUNCTION refuse_finish() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF NEW.key = '${key}' AND NEW.completed_at IS NOT NULL THEN
				RAISE EXCEPTION 'no room for %', NEW.key;
			END IF;
			RETURN NEW;
		END $$`);
	// a completed record is written to idem_record, or to idem_result in the
	// modes that keep completed records apart
	await s.db.query(`DO $$
		BEGIN
			CREATE TRIGGER refuse_finish BEFORE INSERT OR UPDATE ON idem_record FOR EACH ROW EXECUTE FUNCTION refuse_finish();
			IF to_regclass('idem_result') IS NOT NULL THEN
				CREATE TRIGGER refuse_finish BEFORE INSERT OR UPDATE ON idem_result FOR EACH ROW EXECUTE FUNCTION refuse_finish();
			END IF;
		END $$`);
	try {
		const first = await post('/auto/acc1', { key });
		assert.equal(first.status, 500, first.text);
		assert.equal(first.json.type, '/problems/response-not-stored');
		assert.match(first.json.detail, /not stored yet/);
		const { rows } = await s.db.query(`SELECT state, checkpoint FROM idem_inspect('test.charge', $1)`, [key]);
		assert.equal(rows[0].state, 'pending', 'the claim is kept');
		assert.ok(rows[0].checkpoint.response_not_stored, 'a checkpoint for a takeover, should this process die');
	} finally {
		await s.db.query('DROP FUNCTION refuse_finish() CASCADE');
	}
	const retry = await post('/auto/acc1', { key });
	assert.equal(retry.status, 201, retry.text);
	assert.equal(retry.headers.get('idempotent-replayed'), 'true', 'the retry waited for the store in the background');
	assert.equal(await effects(key), 1, 'the handler ran once');
});

test('a finish that fails with 40001 (a Citus shard move raced it) is sent again: stored, the effect done once, the retry replays', async () => {
	const key = newKey('serialization');
	const trigger = await failFirstFinish(s.db, key);
	try {
		const first = await post('/explicit/acc1', { key });
		assert.equal(first.status, 201, first.text);
		assert.equal(await trigger.attempts(), 2, 'the finish failed once and was sent again');
	} finally {
		await trigger.drop();
	}
	const { rows } = await s.db.query('SELECT state FROM idem_inspect($1, $2)', ['test.explicit', key]);
	assert.deepEqual(rows, [{ state: 'completed' }]);
	const retry = await post('/explicit/acc1', { key });
	assert.equal(retry.status, 201, retry.text);
	assert.equal(retry.headers.get('idempotent-replayed'), 'true');
	assert.equal(await effects(key), 1, 'the effect, in the finishing statement, was done once');
});

test('onOutcome counted new, replay, recover, in_progress, key_reuse and expired', () => {
	for (const outcome of ['new', 'replay', 'recover', 'in_progress', 'key_reuse', 'expired']) {
		assert.ok(outcomes[outcome] > 0, `${outcome}: ${JSON.stringify(outcomes)}`);
	}
});
