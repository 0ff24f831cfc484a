'use strict';
// IdempotencyClient against a real server: claims, replays, aborts,
// checkpoints and recovery, tokens above 2^53 with a bigint type parser
// installed, the error classes, and a 'session' claim held across the pool's
// idle timeout.

const assert = require('node:assert/strict');
const { after, before, test } = require('node:test');
const { randomUUID } = require('node:crypto');

const pg = require('pg');

const {
	IdempotencyClient, InProgressError, WaitTimeoutError, KeyReuseError, FencedError, ExpiredError, InputError,
	ResponseTooLargeError, IdempotencyError, fingerprint,
} = require('..');
const { expireCompleted, failFirstFinish, scratchDatabase, sleep } = require('./db');

// What many applications do: bigint columns as JavaScript numbers, for the
// whole process.  Tokens are above 2^53: they must never go through it.
pg.types.setTypeParser(20, parseInt);

let s;
let pool;
let idem;
const outcomes = [];

before(async () => {
	s = await scratchDatabase('client');
	pool = s.pool();
	idem = new IdempotencyClient(pool, { onOutcome: (op, outcome) => outcomes.push(`${op}:${outcome}`) });
});
after(async () => { await s?.drop(); });

const newKey = (label) => `${label}-${randomUUID()}`;

async function state(key, operation = 'op.test') {
	const { rows } = await s.db.query('SELECT state, token::text AS token, checkpoint FROM idem_inspect($1, $2)', [operation, key]);
	return rows[0] ?? null;
}

test('new, finish, then replay: the stored response, as jsonb returns it; the token is the exact text', async () => {
	const key = newKey('basic');
	const claim = await idem.begin('op.test', key, ['order-7', 4200]);
	assert.equal(claim.status, 'new');
	assert.equal(typeof claim.token, 'string');
	assert.ok(BigInt(claim.token) > BigInt(Number.MAX_SAFE_INTEGER), `token ${claim.token} is above 2^53`);
	assert.equal(claim.token, (await state(key)).token, 'the token is the server\'s, digit for digit');
	assert.ok(claim.pending);
	const stored = await claim.finish({ status: 201, body: { zz: 1, a: [1, 2] } });
	assert.deepEqual(stored, { status: 201, body: { zz: 1, a: [1, 2] } });
	assert.equal(claim.pending, false);
	assert.equal((await state(key)).state, 'completed');

	const replay = await idem.begin('op.test', key, fingerprint('order-7', 4200));
	assert.equal(replay.status, 'replay');
	assert.equal(replay.token, null);
	assert.deepEqual(replay.response, stored);
	await assert.rejects(replay.finish({}), /replay/);
});

test("tokens: 'bigint' gives BigInts, equal to the server's", async () => {
	const client = new IdempotencyClient(pool, { tokens: 'bigint' });
	const key = newKey('bigint');
	const claim = await client.begin('op.test', key, null);
	assert.equal(typeof claim.token, 'bigint');
	assert.equal(claim.token, BigInt((await state(key)).token));
	assert.equal(await claim.abort(), true);
	assert.equal(await state(key), null, 'aborted: no record');
});

test('abort releases the key: the next attempt gets new, with a greater token', async () => {
	const key = newKey('abort');
	const first = await idem.begin('op.test', key, ['x']);
	assert.equal(await first.abort(), true);
	const second = await idem.begin('op.test', key, ['x']);
	assert.equal(second.status, 'new');
	assert.ok(BigInt(second.token) > BigInt(first.token));
	await second.finish({ ok: true });
});

test('in_flight raise: InProgressError (IK409) with the key; wait: the duplicate waits, then replays', async () => {
	const key = newKey('inflight');
	const claim = await idem.begin('op.test', key, ['x'], { lease: '20 s' });
	const err = await idem.begin('op.test', key, ['x'], { inFlight: 'raise' }).catch((e) => e);
	assert.ok(err instanceof InProgressError, String(err));
	assert.ok(err instanceof IdempotencyError);
	assert.equal(err.sqlstate, 'IK409');
	assert.equal(err.code, 'IK409');
	assert.equal(err.key, key);
	assert.equal(err.operation, 'op.test');
	// Retry-After: the expected duration less the time the claim has run,
	// never past the lease's end, at least 1
	assert.equal(await idem.retryAfter('op.test', key), 1, 'no expected duration: 1');
	const capped = await idem.retryAfter('op.test', key, 3600);
	assert.ok(capped >= 19 && capped <= 20, `capped at the lease end: ${capped}`);
	const expected = await idem.retryAfter('op.test', key, 10);
	assert.ok(expected >= 9 && expected <= 10, `10 s expected: ${expected}`);

	const waiting = idem.begin('op.test', key, ['x'], { inFlight: 'wait' });
	await sleep(100);
	await claim.finish({ done: 1 });
	const replay = await waiting;
	assert.equal(replay.status, 'replay');
	assert.deepEqual(replay.response, { done: 1 });
});

test('KeyReuseError (IK422) carries both fingerprints in hex and the DETAIL', async () => {
	const key = newKey('reuse');
	await (await idem.begin('op.test', key, ['cus_1', 1000])).finish({});
	const err = await idem.begin('op.test', key, ['cus_1', 5]).catch((e) => e);
	assert.ok(err instanceof KeyReuseError, String(err));
	assert.equal(err.sqlstate, 'IK422');
	assert.match(err.detail, /Stored fingerprint/);
	assert.equal(err.storedFingerprint, fingerprint('cus_1', 1000).toString('hex'));
	assert.equal(err.requestFingerprint, fingerprint('cus_1', 5).toString('hex'));
	assert.equal(err.key, key);
});

test('KeyReuseError (IK422) reads both fingerprints whatever the language of the messages', async (t) => {
	// lc_messages is the server's choice: with German (the OS locale, Debian's
	// locales-all, and the server's German catalogue) every translatable
	// message reads differently; the DETAIL the package reads must not
	const german = s.pool({ max: 1, options: '-c lc_messages=de_DE.UTF-8' });
	const probe = await german.query('SELECT 1 / 0').catch((e) => e);
	if (probe.message === 'division by zero') {
		t.skip('the server has no German message catalogue (postgres-NN.mo)');
		return;
	}
	const client = new IdempotencyClient(german);
	const key = newKey('reuse-de');
	await (await client.begin('op.test', key, ['cus_1', 1000])).finish({});
	const err = await client.begin('op.test', key, ['cus_1', 5]).catch((e) => e);
	assert.ok(err instanceof KeyReuseError, String(err));
	assert.equal(err.storedFingerprint, fingerprint('cus_1', 1000).toString('hex'));
	assert.equal(err.requestFingerprint, fingerprint('cus_1', 5).toString('hex'));
});

test('KeyReuseError (IK422) reads a fingerprint over 64 bytes, which the DETAIL cuts', async () => {
	// the server writes "\\x<first 64 bytes>... (N bytes)" for a fingerprint over
	// 64 bytes: the package gives the hex it has, ending in "...", never a cut
	// fingerprint as if it were whole
	const key = newKey('reuse-long');
	const stored = Buffer.alloc(100, 0xab);
	const other = Buffer.alloc(65, 0xcd);
	await (await idem.begin('op.test', key, stored)).finish({});
	const err = await idem.begin('op.test', key, other).catch((e) => e);
	assert.ok(err instanceof KeyReuseError, String(err));
	assert.match(err.detail, /\(100 bytes\)/);
	assert.equal(err.storedFingerprint, `${'ab'.repeat(64)}...`);
	assert.equal(err.requestFingerprint, `${'cd'.repeat(64)}...`);
	// a NULL, an empty and a 64-byte fingerprint are whole
	const whole = Buffer.alloc(64, 0xef);
	for (const [fp, hex] of [[null, null], [Buffer.alloc(0), ''], [whole, 'ef'.repeat(64)]]) {
		const reused = await idem.begin('op.test', key, fp).catch((e) => e);
		assert.ok(reused instanceof KeyReuseError, String(reused));
		assert.equal(reused.storedFingerprint, `${'ab'.repeat(64)}...`);
		assert.equal(reused.requestFingerprint, hex);
	}
});

test('FencedError (IK412): a finish with a token that lost the key', async () => {
	const key = newKey('fenced');
	const claim = await idem.begin('op.test', key, null, { lease: '50 ms' });
	await sleep(120);
	const next = await idem.begin('op.test', key, null);
	assert.equal(next.status, 'new', 'the lapsed claim was taken over');
	const err = await claim.finish({ late: true }).catch((e) => e);
	assert.ok(err instanceof FencedError, String(err));
	assert.equal(err.sqlstate, 'IK412');
	assert.equal(typeof err.detail, 'string');
	assert.equal(claim.pending, false);
	await next.finish({ on: 'time' });
});

test('ExpiredError (IK410): a remembered key past its ttl', async () => {
	const key = newKey('expired');
	const claim = await idem.begin('op.test', key, ['a'], { ttl: '1 min', remember: '30 days' });
	await claim.finish({ x: 1 });
	await expireCompleted(s.db, key);
	const err = await idem.begin('op.test', key, ['a']).catch((e) => e);
	assert.ok(err instanceof ExpiredError, String(err));
	assert.equal(err.sqlstate, 'IK410');
});

test('input errors: 22023 (empty key, a key over 255 characters, a bad policy), 22004, 54000', async () => {
	for (const [key, opts] of [['', {}], ['k'.repeat(256), {}], [newKey('policy'), { inFlight: 'sometimes' }]]) {
		const err = await idem.begin('op.test', key, null, opts).catch((e) => e);
		assert.ok(err instanceof InputError, String(err));
		assert.equal(err.sqlstate, '22023');
	}
	const nullKey = await idem.begin('op.test', null, null).catch((e) => e);
	assert.ok(nullKey instanceof InputError, String(nullKey));
	assert.equal(nullKey.sqlstate, '22004');

	// a response too large: the claim stays held, a smaller one finishes it
	const small = new IdempotencyClient(s.pool({ options: '-c idempotency.max_response_size=1kB' }));
	const key = newKey('large');
	const claim = await small.begin('op.test', key, null);
	const err = await claim.finish({ big: 'x'.repeat(5000) }).catch((e) => e);
	assert.ok(err instanceof ResponseTooLargeError, String(err));
	assert.ok(err instanceof IdempotencyError);
	assert.equal(err.sqlstate, '54000');
	assert.ok(claim.pending, 'an input error keeps the claim');
	assert.deepEqual(await claim.finish({ ref: 'blob-1' }), { ref: 'blob-1' });
});

test("takeover 'session': the claim's connection stays checked out past the pool's idle timeout; its end lets the next owner recover", async () => {
	const idlePool = s.pool({ max: 3, idleTimeoutMillis: 50 });
	const client = new IdempotencyClient(idlePool, { onOutcome: (op, outcome) => outcomes.push(`${op}:${outcome}`) });
	const key = newKey('session');
	const claim = await client.begin('op.test', key, ['s'], { takeover: 'session', checkpoint: { provider_key: key } });
	assert.equal(claim.status, 'new');
	assert.deepEqual((await state(key)).checkpoint, { provider_key: key }, 'the checkpoint came with the claim');
	// other requests' errors on the pool, and idle time, do not touch it
	for (let i = 0; i < 3; i++) {
		await assert.rejects(idlePool.query('SELECT 1/0'));
		const dup = await client.begin('op.test', key, ['s'], { inFlight: 'raise', takeover: 'session' }).catch((e) => e);
		assert.ok(dup instanceof InProgressError, String(dup));
		await sleep(100);
	}
	assert.equal((await state(key)).state, 'pending', 'the claim is live after 3 idle timeouts');
	await claim.checkpoint({ provider_key: key, step: 'called' });

	// the worker dies: its session ends, the claim lapses at once
	const pid = claim.connection.processID;
	await s.db.query('SELECT pg_terminate_backend($1)', [pid]);
	const t0 = performance.now();
	const next = await client.begin('op.test', key, ['s'], { takeover: 'session' });
	assert.equal(next.status, 'recover');
	assert.ok(performance.now() - t0 < 1000);
	assert.deepEqual(next.response, { provider_key: key, step: 'called' });
	assert.ok(BigInt(next.token) > BigInt(claim.token));
	await next.finish({ charge: 'ch_1' });
	// the dead attempt's finish is fenced off
	const late = await claim.finish({ charge: 'ch_2' }).catch((e) => e);
	assert.ok(late instanceof FencedError, String(late));
	assert.deepEqual((await client.begin('op.test', key, ['s'])).response, { charge: 'ch_1' });
});

test('finish with an effect: the effect and idem_finish in one statement (one transaction)', async () => {
	await s.db.query('CREATE TABLE IF NOT EXISTS effects (key text PRIMARY KEY, amount bigint NOT NULL)');
	const key = newKey('effect');
	const claim = await idem.begin('op.test', key, null);
	const effect = { name: 'effect_insert', text: 'INSERT INTO effects VALUES ($5, $6)', values: [key, 700] };
	await claim.finish({ ok: 1 }, { effect });
	const { rows } = await s.db.query('SELECT amount FROM effects WHERE key = $1', [key]);
	assert.deepEqual(rows, [{ amount: 700 }]);

	// a fenced finish rolls its effect back
	const key2 = newKey('effect-fenced');
	const lost = await idem.begin('op.test', key2, null, { lease: '50 ms' });
	await sleep(120);
	const owner = await idem.begin('op.test', key2, null);
	await assert.rejects(lost.finish({}, { effect: { ...effect, values: [key2, 1] } }), FencedError);
	assert.equal((await s.db.query('SELECT 1 FROM effects WHERE key = $1', [key2])).rowCount, 0);
	await owner.abort();
});

test('40001 on a finish in a transaction the application opened on claim.connection is thrown, not retried', async () => {
	const key = newKey('serialization-tx');
	const trigger = await failFirstFinish(s.db, key);
	try {
		const claim = await idem.begin('op.test', key, null);
		await claim.connection.query('BEGIN');
		await assert.rejects(claim.finish({ ok: 1 }), { code: '40001' });
		assert.equal(await trigger.attempts(), 1, 'not sent again in the aborted transaction');
		assert.ok(claim.pending, 'the claim stays held');
		await claim.connection.query('ROLLBACK');
		assert.deepEqual(await claim.finish({ ok: 2 }), { ok: 2 }, 'finished once the application rolled back');
		assert.equal((await state(key)).state, 'completed');
	} finally {
		await trigger.drop();
	}
});

test('renew extends the lease; onOutcome counted every outcome', async () => {
	const key = newKey('renew');
	const claim = await idem.begin('op.test', key, null, { lease: '1 s' });
	const until = await claim.renew('60 s');
	assert.ok(until instanceof Date && until.getTime() - Date.now() > 50000);
	await claim.abort();
	for (const outcome of ['new', 'replay', 'recover', 'in_progress', 'key_reuse', 'expired']) {
		assert.ok(outcomes.includes(`op.test:${outcome}`), `${outcome} was reported: ${outcomes.join(' ')}`);
	}
});

test('waitTimeout: the claim is one statement on its connection, its values exact', async () => {
	const one = s.pool({ max: 1 });
	const client = new IdempotencyClient(one, { waitTimeout: '2 s', lease: '20 s', takeover: 'session' });
	// count what the client sends on the connection (the statements are the
	// client's own, run by the server)
	const conn = await one.connect();
	let sent = 0;
	const query = conn.query.bind(conn);
	conn.query = (...args) => {
		sent++;
		return query(...args);
	};
	conn.release();
	// quotes, a backslash and a dollar sign in the key, the fingerprint's
	// values and the checkpoint, which the statement carries as literals
	const key = `wait-1rt-'quoted'\\back$2-${randomUUID()}`;
	const fp = fingerprint("o'brien", 'c:\\dir', '$1');
	const claim = await client.begin('op.test', key, fp, { checkpoint: { note: "it's \\ $3" } });
	assert.equal(sent, 1, 'one statement for the claim and its statement_timeout');
	assert.equal(claim.status, 'new');
	const { rows } = await s.db.query(
		`SELECT state, token::text AS token, fingerprint, checkpoint FROM idem_inspect('op.test', $1)`, [key]);
	assert.equal(rows[0].state, 'pending');
	assert.equal(rows[0].token, claim.token);
	assert.ok(rows[0].fingerprint.equals(fp), 'the fingerprint as sent');
	assert.deepEqual(rows[0].checkpoint, { note: "it's \\ $3" });
	assert.equal((await claim.connection.query('SHOW statement_timeout')).rows[0].statement_timeout, '0',
		'the connection keeps its own statement_timeout');
	await claim.finish({ ok: true });
	const replay = await client.begin('op.test', key, fp);
	assert.equal(replay.status, 'replay');
	assert.deepEqual(replay.response, { ok: true });
});

test('waitTimeout: WaitTimeoutError (an InProgressError) after the wait, and the connection keeps its own statement_timeout', async () => {
	const one = s.pool({ max: 1 });
	const client = new IdempotencyClient(one, { waitTimeout: 200 });
	const key = newKey('waittimeout');
	const claim = await idem.begin('op.test', key, ['x'], { lease: '20 s' });
	const err = await client.begin('op.test', key, ['x']).catch((e) => e);
	assert.ok(err instanceof WaitTimeoutError, String(err));
	assert.ok(err instanceof InProgressError);
	assert.equal(err.sqlstate, '57014');
	const { rows } = await one.query('SHOW statement_timeout');
	assert.equal(rows[0].statement_timeout, '0', 'the pooled connection has its own statement_timeout back');
	const quick = await client.begin('op.test', key, ['x'], { waitTimeout: '1 min', inFlight: 'raise' }).catch((e) => e);
	assert.ok(quick instanceof InProgressError && !(quick instanceof WaitTimeoutError), String(quick));
	await claim.finish({ done: true });
	const replay = await client.begin('op.test', key, ['x']);
	assert.equal(replay.status, 'replay');
	assert.equal((await one.query('SHOW statement_timeout')).rows[0].statement_timeout, '0');
});
