// The payments API on top of the idempotency extension, in both shapes of
// README, "Two usage shapes", written with the repository's Node package
// idempotency-pg (../../node, a file: dependency):
//
// POST /charges, external call (a payment provider), through the package's
// express middleware:
//   1. idem_begin(...)                 autocommit: the claim is committed
//                                      before the provider is called
//   2. provider.charge(...)            the external call, passing the key on
//   3. INSERT the charge + idem_finish one statement, so one transaction
//                                      (req.idempotency.respond's effect):
//                                      the API's record of the charge and
//                                      the stored response commit together;
//                                      or idem_abort() if the provider
//                                      failed (the middleware aborts when the
//                                      handler answers an error): errors are
//                                      not cached
//
// POST /orders, in-transaction (the effect is the order row itself):
//   claim + INSERT the order + idem_finish in ONE statement (ORDER), so in
//   one transaction and one round trip: a crash anywhere rolls back all
//   three, and a duplicate waits on the uncommitted claim, then replays.  The
//   package checks the header, maps the errors and sends the response.
//
// A retry that arrives while a request runs waits inside idem_begin (the
// default 'wait' policy) and then replays the stored response; with
// in_flight 'raise' it gets 409 at once, with a Retry-After of the seconds
// until the claim's lease ends.  A completed request is replayed with the
// identical status, headers and body, plus `Idempotent-Replayed: true`.
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
// before charging (docs/applications.md, "When a worker dies").  The checkpoint makes the
// claim a logged write (in durability 'completed'), which roughly doubles
// the server's CPU per new key: off by default.  Against 1.3, or with
// RECOVERY=off, the claim is a plain leased one: a retry waits for the lease,
// then calls the provider again with the same key.
//
// Connections (external call only).  A 'session' claim belongs to the
// database session that made it and lapses when that connection closes.
// The package keeps the connection that claimed checked out of `claimPool`
// -- never back in the pool -- until the finish or abort, which run on it
// too: idle timeouts, other requests' errors and pool recycling cannot touch
// it (node/README.md).  If it broke, the finish runs on `pool`.
//
// A waiting idem_begin occupies its connection until the first attempt
// finishes or aborts, and a running attempt holds its own: claimPool's size
// bounds how many charges (and waiting retries) are in flight at once, and
// the next requests queue for a connection.  The first attempt never needs
// another connection of claimPool to finish, so waiters cannot block it.
// Orders, reads and a finish whose connection broke use `pool`.

import express from 'express';
import pg from 'pg';
import { IdempotencyClient, idempotencyKey, sendStored } from 'idempotency-pg';

import { PROBLEM_TYPES, Problem, providerProblem, sendProblem } from './problems.js';

export const OPERATION = 'payment.charge';
export const ORDER_OPERATION = 'order.create';
const SERIALIZATION_RETRIES = 3;

// the problem "type" URIs: served by GET /problems/:type
const problemType = (name) => `/problems/${name}`;

// The fingerprint covers the fields that make a charge *this* charge, and
// nothing else: a retry may legitimately carry another description or trace
// id (docs/api.md, "API reference").  The package computes it as
// idem_fingerprint(customer, amount, currency) does on the server: amount is
// an integer and the others are text, so the text forms depend on no setting.
const FINGERPRINT = ['body.customer', 'body.amount', 'body.currency'];

// Record the charge in the statement that stores the response (the effect's
// parameters are numbered from $5: $1..$4 are idem_finish's).  If the claim
// was lost (IK412) the INSERT rolls back with it.
const RECORD_CHARGE = `INSERT INTO charges (id, idempotency_key, customer, amount, currency, created_at)
                       VALUES ($5, $6, $7, $8, $9, $10)`;

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
	// claims on claimPool; a finish whose claim connection broke on pool
	const idem = new IdempotencyClient(claimPool, { finishPool: pool, log: { error: (...a) => log.error(...a) } });
	const requireKey = idempotencyKey({ problemType });
	const app = express();
	app.disable('x-powered-by');
	// no ETag: nothing here is cached by validators, and hashing every body
	// costs CPU
	app.disable('etag');
	app.use(express.json({ limit: '16kb' }));

	// the handler; also the recover handler: after a takeover with a
	// checkpoint ('recover') it runs with req.idempotency.status 'recover'
	async function charge(req, res) {
		const { key, status } = req.idempotency;
		const { customer, amount, currency } = req.body;

		// we hold the key: call the provider, passing the key on.  After a
		// takeover ('recover': an attempt died after its checkpoint) first ask
		// the provider whether it charged with this key.  ('new' after a
		// takeover without a checkpoint: the provider's deduplication by key
		// returns the dead attempt's charge, if it made one.)
		let result;
		try {
			if (status === 'recover') {
				result = await provider.find({ idempotencyKey: key, customer, amount, currency });
			}
			result ??= await provider.charge({ idempotencyKey: key, customer, amount, currency });
		} catch (err) {
			// an error response: the middleware releases the claim
			// (idem_abort) before it is sent, so a retry runs again
			return sendProblem(res, providerProblem(err, log));
		}

		// record the charge and store the response, in one statement; the
		// package then sends what was stored, as every later request with this
		// key gets it.  If it cannot be stored (IK412: our claim lapsed and
		// another attempt took the key over; the provider's deduplication by
		// key makes that attempt's call return this same charge), it answers
		// 500 and logs it.
		const response = {
			status: 201,
			headers: { location: `/charges/${result.id}` },
			body: { id: result.id, object: 'charge', customer, amount, currency, created: result.created },
		};
		const stored = await req.idempotency.respond(response, {
			effect: {
				name: 'charge_record',
				text: RECORD_CHARGE,
				values: [result.id, key, customer, amount, currency, result.created],
			},
		});
		if (!stored) {
			log.error(`charge ${result.id} made but its response was not stored (key ${JSON.stringify(key)})`);
		}
	}

	app.post('/charges', requireKey, validateBody, idem.middleware({
		operation: OPERATION,
		fingerprint: FINGERPRINT,
		inFlight,
		lease,
		takeover: sessionTakeover ? 'session' : undefined,
		// in the claim's own statement: "calling the provider with this key"
		checkpoint: checkpoint ? (req, key) => ({ provider_key: key }) : false,
		problemType,
		recover: checkpoint ? charge : undefined,
	}), charge);

	app.post('/orders', requireKey, validateBody, async (req, res) => {
		const key = req.idempotencyKey;
		const { customer, amount, currency } = req.body;
		let row;
		try {
			row = await withSerializationRetry(
				() => query(pool, { ...ORDER, values: [ORDER_OPERATION, key, customer, amount, currency, inFlight] }));
		} catch (err) {
			return idem.sendError(res, err, { operation: ORDER_OPERATION, key, problemType });
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

// The body, checked before anything is claimed: a malformed request never
// uses up its key.
function validateBody(req, res, next) {
	const charge = validateCharge(req.body);
	if (charge.error) {
		return sendProblem(res, new Problem(400, 'invalid-request', charge.error));
	}
	return next();
}

// Retried on 40001 (docs/errors.md, "Errors and HTTP": under REPEATABLE READ the
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

// One statement on a pooled connection, which goes back to the pool after an
// error the server sent (the connection is fine): pool.query() would close
// it, and each IK409 or IK422 would cost a new connection.
export async function query(p, statement) {
	const client = await p.connect();
	let broken;
	try {
		return await client.query(statement);
	} catch (err) {
		if (!(err instanceof pg.DatabaseError) || err.severity === 'FATAL' || err.severity === 'PANIC') {
			broken = err;
		}
		throw err;
	} finally {
		client.release(broken);
	}
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
