// The payments API on top of the idempotency extension, in both shapes of
// README, "Two usage shapes":
//
// POST /charges, external call (a payment provider):
//   1. idem_begin(...)                 autocommit: the claim is committed
//                                      before the provider is called
//   2. provider.charge(...)            the external call, passing the key on
//   3. INSERT the charge + idem_finish one statement, so one transaction: the
//                                      API's record of the charge and the
//                                      stored response commit together; or
//                                      idem_abort() if the provider failed:
//                                      errors are not cached
//
// POST /orders, in-transaction (the effect is the order row itself):
//   claim + INSERT the order + idem_finish in ONE statement (ORDER_SQL), so in
//   one transaction and one round trip: a crash anywhere rolls back all
//   three, and a duplicate waits on the uncommitted claim, then replays.
//
// A retry that arrives while a request runs waits inside idem_begin (the
// default 'wait' policy) and then replays the stored response; with
// in_flight 'raise' it gets 409 at once.  A completed request is replayed
// with the identical status, headers and body, plus
// `Idempotent-Replayed: true`.
//
// Every statement is a named prepared statement (node-pg's `name`): each
// connection parses and plans it once.
//
// Recovery (the extension's version 1.4 and later: `sessionTakeover`, see
// hasRecovery()).  The claim is made with takeover => 'session': if this
// process dies (kill -9, OOM) its connections close and the claim lapses at
// once instead of after its lease, so the client's retry takes the key over
// and calls the provider again, with the same key.  The provider
// deduplicates by the key it is passed (the simulated one does, and real
// payment providers do), so the second call returns the first charge: one
// charge, and nothing else to pay for.  `checkpoint` (server.js:
// CHECKPOINT=on) is for a provider that must not be called twice: the claim's
// statement also records a checkpoint saying the provider is about to be
// called with the key, the retry's idem_begin then answers 'recover' with it,
// and the new owner asks the provider for the charge made with the key
// before charging (README, "When a worker dies").  The checkpoint makes the
// claim a logged write (in durability 'completed'), which roughly doubles
// the server's CPU per new key: off by default.  Against 1.3, or with
// RECOVERY=off, the claim is a plain leased one: a retry waits for the lease,
// then calls the provider again with the same key.
//
// Connections (external call only).  A claim made with takeover =>
// 'session' belongs to the database session that made it: it lapses when
// that connection closes, and a duplicate then takes the key over while this
// attempt still runs (its idem_finish gets IK412).  So an attempt keeps the
// connection that claimed checked out of `claimPool` -- not back in the pool
// -- until it finishes or aborts: idle timeouts, other requests' errors and
// pool recycling cannot touch it, and no duplicate's statement ever runs on
// it.  The attempt's finish or abort runs on that same connection.  A
// claiming connection is closed on purpose (release with an error) only when
// the attempt gives up: after a failed idem_abort, or when its charge was
// made but could not be stored (the claim then lapses at once, with its
// checkpoint if it has one).  Statements that may fail with an expected
// error (IK409, IK422) are run with query(), which returns the connection to
// its pool: node-pg's pool.query() closes a connection on any error.
//
// A waiting idem_begin occupies its connection until the first attempt
// finishes or aborts, and a running attempt holds its own: claimPool's size
// bounds how many charges (and waiting retries) are in flight at once, and
// the next requests queue for a connection.  The first attempt never needs
// another connection of claimPool to finish, so waiters cannot block it.
// Orders, reads and a finish whose connection broke use `pool`.

import express from 'express';
import pg from 'pg';

import { parseIdempotencyKey } from './idempotency-key.js';
import { PROBLEM_TYPES, Problem, problemFromDbError, providerProblem, sendProblem } from './problems.js';

export const OPERATION = 'payment.charge';
export const ORDER_OPERATION = 'order.create';
const SERIALIZATION_RETRIES = 3;

// The fingerprint covers the fields that make a charge *this* charge, and
// nothing else: a retry may legitimately carry another description or trace
// id (README, "API reference").  Its text form must not depend on session
// settings: amount is an integer and the others are text, so it does not.
//
// The token is read as text (c.token::text) and sent back as text: tokens
// are bigints above 2^53 (README, "Fencing tokens": `epoch << 25 | count`),
// which a JavaScript number cannot hold.  node-pg returns bigint as a string
// by default, but an application that installs the common
// pg.types.setTypeParser(20, parseInt) would get a rounded token, and its
// idem_finish would fail with IK412.  As text, no type parser touches it.
//
// Three variants of the claim (createApp's sessionTakeover and checkpoint):
// a leased claim (1.3, RECOVERY=off); takeover => 'session' (the default);
// and takeover => 'session' with a checkpoint written in the claim's own
// statement (one round trip), for CHECKPOINT=on.
const BEGIN_LEASE = {
	name: 'charge_begin',
	text: `SELECT c.status, c.token::text AS token, c.response
	         FROM idem_begin($1, $2,
	                         idem_fingerprint($3::text, $4::bigint, $5::text),
	                         in_flight => $6, lease => $7::interval) AS c`,
};

const BEGIN_SESSION = {
	name: 'charge_begin_session',
	text: `SELECT c.status, c.token::text AS token, c.response
	         FROM idem_begin($1, $2,
	                         idem_fingerprint($3::text, $4::bigint, $5::text),
	                         in_flight => $6, lease => $7::interval, takeover => 'session') AS c`,
};

const BEGIN_CHECKPOINT = {
	name: 'charge_begin_checkpoint',
	text: `SELECT c.status, c.token::text AS token, c.response,
	              CASE WHEN c.status <> 'replay'
	                   THEN idem_checkpoint($1, $2, c.token, jsonb_build_object('provider_key', $2::text)) END
	         FROM idem_begin($1, $2,
	                         idem_fingerprint($3::text, $4::bigint, $5::text),
	                         in_flight => $6, lease => $7::interval, takeover => 'session') AS c`,
};

// Record the charge and store the response in one statement.  It returns
// what was stored: the first response is sent from exactly the jsonb a
// replay will get, so both are identical byte for byte (jsonb orders object
// keys its own way).  If the claim was lost (IK412) the INSERT rolls back
// with it.
const FINISH = {
	name: 'charge_finish',
	text: `WITH charge AS (
	         INSERT INTO charges (id, idempotency_key, customer, amount, currency, created_at)
	         VALUES ($5, $2, $6, $7, $8, $9))
	       SELECT idem_finish($1, $2, $3::bigint, $4::jsonb), $4::jsonb AS response`,
};

const ABORT = { name: 'charge_abort', text: `SELECT idem_abort($1, $2, $3::bigint) AS released` };

// Claim, order row and response in one statement.  'new': the order is
// inserted and its response stored by idem_finish; 'replay': nothing is
// inserted, the stored response comes back.  Errors (IK409, IK422) abort the
// whole statement.
const ORDER = {
	name: 'order_create',
	text: `WITH claim AS MATERIALIZED (
	         SELECT * FROM idem_begin($1, $2,
	                                  idem_fingerprint($3::text, $4::bigint, $5::text),
	                                  in_flight => $6)),
	       new_order AS (
	         INSERT INTO orders (idempotency_key, customer, amount, currency)
	         SELECT $2, $3, $4, $5 FROM claim WHERE claim.status = 'new'
	         RETURNING jsonb_build_object(
	           'status', 201,
	           'headers', jsonb_build_object('location', '/orders/ord_' || id),
	           'body', jsonb_build_object('id', 'ord_' || id, 'object', 'order', 'customer', customer,
	                                      'amount', amount, 'currency', currency, 'created', created_at))
	           AS response)
	       SELECT claim.status,
	              coalesce(claim.response, new_order.response) AS response,
	              CASE WHEN claim.status = 'new'
	                   THEN idem_finish($1, $2, claim.token, new_order.response) END
	         FROM claim LEFT JOIN new_order ON true`,
};

const GET_CHARGE = {
	name: 'charge_get',
	text: `SELECT id, customer, amount, currency, created_at FROM charges WHERE id = $1`,
};

// Whether the extension installed in the database has session takeover and
// checkpoints (version 1.4 and later).
export async function hasRecovery(pool) {
	const { rows } = await pool.query(`SELECT to_regproc('idem_checkpoint') IS NOT NULL AS ok`);
	return rows[0].ok;
}

export function createApp({
	claimPool, pool, provider, inFlight = 'wait', lease = '30 s', sessionTakeover = false, checkpoint = false,
	log = console,
}) {
	if (checkpoint && !sessionTakeover) {
		throw new Error('checkpoint needs sessionTakeover (extension 1.4 or later)');
	}
	const beginStatement = checkpoint ? BEGIN_CHECKPOINT : sessionTakeover ? BEGIN_SESSION : BEGIN_LEASE;
	const app = express();
	app.disable('x-powered-by');
	// no ETag: nothing here is cached by validators, and hashing every body
	// costs CPU
	app.disable('etag');
	app.use(express.json({ limit: '16kb' }));

	app.post('/charges', async (req, res) => {
		const request = parseRequest(req, res);
		if (!request) {
			return;
		}
		const { key, customer, amount, currency } = request;

		// 1. claim the key, on a connection this attempt keeps until it
		// finishes or aborts
		let conn;
		try {
			conn = new HeldConnection(await claimPool.connect());
		} catch (err) {
			return sendProblem(res, dbProblem(err, 'begin', log));
		}
		let claim;
		try {
			claim = await withSerializationRetry(() => conn.query({
				...beginStatement, values: [OPERATION, key, customer, amount, currency, inFlight, lease],
			}));
		} catch (err) {
			// no claim (IK409, IK422, a wait that timed out): the connection
			// goes back to the pool, unless it broke
			conn.release();
			return sendProblem(res, dbProblem(err, 'begin', log));
		}
		if (claim.status === 'replay') {
			conn.release();
			return sendStored(res, claim.response, true);
		}

		// 2. we hold the key: call the provider, passing the key on.  After a
		// takeover ('recover': an attempt died after its checkpoint) first ask
		// the provider whether it charged with this key.  ('new' after a
		// takeover without a checkpoint: the provider's deduplication by key
		// returns the dead attempt's charge, if it made one.)
		let result;
		try {
			if (claim.status === 'recover') {
				result = await provider.find({ idempotencyKey: key, customer, amount, currency });
			}
			result ??= await provider.charge({ idempotencyKey: key, customer, amount, currency });
		} catch (err) {
			// errors are not cached: release the claim so a retry runs again
			await abort(conn, pool, [OPERATION, key, claim.token], log);
			return sendProblem(res, providerProblem(err, log));
		}

		// 3. record the charge and store the response; every later request
		// with this key gets it
		const response = {
			status: 201,
			headers: { location: `/charges/${result.id}` },
			body: { id: result.id, object: 'charge', customer, amount, currency, created: result.created },
		};
		let stored;
		try {
			stored = await finish(conn, pool,
				[OPERATION, key, claim.token, response, result.id, customer, amount, currency, result.created]);
		} catch (err) {
			// IK412: our claim lapsed and another attempt took the key over
			// (our session ended, or the lease ran out).  The provider
			// charged; its deduplication by key makes the other attempt's call
			// return this same charge.  Any other error: the charge is made
			// but not stored, and this attempt gives up: closing its session
			// lets the claim lapse at once (with its checkpoint, if any), so
			// that the client's retry takes the key over and finds the charge
			// (no idem_abort: it would drop the checkpoint).  Say so loudly.
			log.error(`charge ${result.id} made but its response was not stored (key ${JSON.stringify(key)}):`,
				err.code, err.message);
			conn.release(err.code !== 'IK412');
			return sendProblem(res, dbProblem(err, 'finish', log));
		}
		conn.release();
		return sendStored(res, stored, false);
	});

	app.post('/orders', async (req, res) => {
		const request = parseRequest(req, res);
		if (!request) {
			return;
		}
		const { key, customer, amount, currency } = request;
		let row;
		try {
			row = await withSerializationRetry(
				() => query(pool, { ...ORDER, values: [ORDER_OPERATION, key, customer, amount, currency, inFlight] }));
		} catch (err) {
			return sendProblem(res, dbProblem(err, 'begin', log));
		}
		return sendStored(res, row.response, row.status === 'replay');
	});

	app.get('/charges/:id', async (req, res) => {
		const { rows } = await pool.query({ ...GET_CHARGE, values: [req.params.id] });
		if (rows.length === 0) {
			return sendProblem(res, new Problem(404, 'not-found', `There is no charge ${req.params.id}.`));
		}
		const row = rows[0];
		res.json({
			id: row.id,
			object: 'charge',
			customer: row.customer,
			amount: Number(row.amount),
			currency: row.currency,
			created: row.created_at.toISOString(),
		});
	});

	// the documentation the problem "type" URIs point to
	app.get('/problems/:type', (req, res) => {
		const t = Object.hasOwn(PROBLEM_TYPES, req.params.type) ? PROBLEM_TYPES[req.params.type] : null;
		if (!t) {
			return sendProblem(res, new Problem(404, 'not-found', 'No such problem type.'));
		}
		res.type('text/plain').send(`${t.title}\n\n${t.doc}\n`);
	});

	app.use((req, res) => {
		sendProblem(res, new Problem(404, 'not-found', `No route for ${req.method} ${req.path}.`));
	});

	// body parser errors (bad JSON, too large) and anything unexpected
	// eslint-disable-next-line no-unused-vars
	app.use((err, req, res, next) => {
		if (err.type === 'entity.parse.failed') {
			return sendProblem(res, new Problem(400, 'invalid-request', 'The request body is not valid JSON.'));
		}
		if (typeof err.status === 'number' && err.status >= 400 && err.status < 500) {
			return sendProblem(res, new Problem(err.status, 'invalid-request', err.message));
		}
		log.error('unexpected error:', err);
		return sendProblem(res, new Problem(500, 'internal-error', 'The server could not complete the request.'));
	});

	return app;
}

// The key and the body of a POST, or null after sending the 400: a
// malformed request never uses up its key.
export function parseRequest(req, res) {
	const parsed = parseIdempotencyKey(req.get('Idempotency-Key'));
	if (!parsed.ok) {
		sendProblem(res, new Problem(400,
			parsed.missing ? 'idempotency-key-missing' : 'idempotency-key-malformed', parsed.reason));
		return null;
	}
	const charge = validateCharge(req.body);
	if (charge.error) {
		sendProblem(res, new Problem(400, 'invalid-request', charge.error));
		return null;
	}
	return { key: parsed.key, ...charge };
}

// Retried on 40001 (README, "Errors and HTTP": under REPEATABLE READ the
// snapshot may not see a concurrent result; the retry replays it).
// Autocommit statements run in READ COMMITTED unless the database says
// otherwise.
async function withSerializationRetry(run) {
	for (let attempt = 1; ; attempt++) {
		try {
			const { rows } = await run();
			return rows[0];
		} catch (err) {
			if (err.code !== '40001' || attempt >= SERIALIZATION_RETRIES) {
				throw err;
			}
		}
	}
}

// A connection checked out of a pool for as long as an attempt holds its
// claim.  While it is checked out the pool does not listen for its errors: a
// connection that breaks meanwhile (server restart) is noted here instead of
// crashing the process; a claim made on it has lapsed with its session.
class HeldConnection {
	constructor(client) {
		this.client = client;
		this.broken = null;
		this.onError = (err) => { this.broken = err; };
		client.on('error', this.onError);
	}

	get usable() {
		return this.broken === null;
	}

	async query(statement) {
		if (this.broken) {
			throw this.broken;
		}
		try {
			return await this.client.query(statement);
		} catch (err) {
			if (brokeConnection(err)) {
				this.broken = err;
			}
			throw err;
		}
	}

	// Back to the pool; closed instead if it broke, or if `close` (the
	// attempt gives up on a claim it still holds: closing the session lets
	// the claim lapse at once).
	release(close = false) {
		this.client.removeListener('error', this.onError);
		this.client.release(this.broken ?? (close ? new Error('the attempt gave up its claim') : undefined));
	}
}

// One statement on a pooled connection, which goes back to the pool after an
// error the server sent (the connection is fine): pool.query() would close
// it, and each IK409 or IK422 would cost a new connection.
export async function query(p, statement) {
	const conn = new HeldConnection(await p.connect());
	try {
		return await conn.query(statement);
	} finally {
		conn.release();
	}
}

// An error after which a connection cannot be used: anything the server
// did not send (socket closed, connection refused, timeout), or a FATAL one
// (the server ended the session).
function brokeConnection(err) {
	return !(err instanceof pg.DatabaseError) || err.severity === 'FATAL' || err.severity === 'PANIC';
}

// The finishing statement, on the claim's own connection, retried when the
// database was briefly unreachable: the charge has been made, and a claim
// left pending would make the next retry take the key over and call the
// provider again.  If the claim's connection broke, the retry goes through
// `pool` (the claim lapsed with its session; until another attempt takes it
// over, its token still finishes it).
async function finish(conn, pool, values) {
	for (let attempt = 1; ; attempt++) {
		try {
			const statement = { ...FINISH, values };
			const { rows } = conn.usable ? await conn.query(statement) : await query(pool, statement);
			return rows[0].response;
		} catch (err) {
			if (!isTransient(err) || attempt >= 5) {
				throw err;
			}
			await new Promise((resolve) => setTimeout(resolve, 100 * attempt));
		}
	}
}

// Release the claim after the provider failed, then the connection.  If
// idem_abort fails, the attempt gives up: its connection is closed, so the
// claim lapses with its session (a leased claim, when its lease ends).
async function abort(conn, pool, values, log) {
	let aborted = false;
	try {
		const statement = { ...ABORT, values };
		await (conn.usable ? conn.query(statement) : query(pool, statement));
		aborted = true;
	} catch (err) {
		log.error(`idem_abort failed for key ${JSON.stringify(values[1])}:`, err.code, err.message);
	}
	conn.release(!aborted);
}

// connection failures, too many connections, out of memory or disk, server
// shutting down
function isTransient(err) {
	return !(err instanceof pg.DatabaseError) || /^(08|53|57P)/.test(err.code);
}

function dbProblem(err, phase, log) {
	const problem = problemFromDbError(err, phase)
		?? new Problem(503, 'service-unavailable', 'Could not claim the Idempotency-Key; retry.',
			{ headers: { 'Retry-After': '1' } });
	if (problem.status >= 500) {
		log.error(`idem_${phase} failed:`, err.code, err.message);
	}
	return problem;
}

// A stored response: {status, headers, body}.  A replay is the same
// response plus Idempotent-Replayed: true.
export function sendStored(res, stored, replayed) {
	for (const [name, value] of Object.entries(stored.headers ?? {})) {
		res.set(name, value);
	}
	if (replayed) {
		res.set('Idempotent-Replayed', 'true');
	}
	res.status(stored.status).type('application/json').send(JSON.stringify(stored.body));
}

const CURRENCY = /^[A-Z]{3}$/;
const MAX_AMOUNT = 99_999_999_999; // minor units

export function validateCharge(body) {
	if (body === null || typeof body !== 'object' || Array.isArray(body)) {
		return { error: 'The request body must be a JSON object (Content-Type: application/json).' };
	}
	const { customer, amount, currency } = body;
	if (typeof customer !== 'string' || customer.length === 0 || customer.length > 255) {
		return { error: '"customer" must be a string of 1 to 255 characters.' };
	}
	if (!Number.isSafeInteger(amount) || amount <= 0 || amount > MAX_AMOUNT) {
		return { error: `"amount" must be an integer from 1 to ${MAX_AMOUNT} (minor units, e.g. cents).` };
	}
	if (typeof currency !== 'string' || !CURRENCY.test(currency)) {
		return { error: '"currency" must be an ISO 4217 code such as "EUR".' };
	}
	return { customer, amount, currency };
}
