'use strict';
// IdempotencyClient: idem_begin / idem_finish / idem_abort / idem_checkpoint
// over a node-pg Pool, with the SQL in plain sight.
//
// The claim's connection.  A claim made with takeover => 'session' belongs to
// the database session that made it and lapses when that connection closes
// (docs/applications.md, "When a worker dies").  node-pg closes pooled connections on its
// own: pool.query() destroys its connection after any error (a duplicate's
// IK409), and idleTimeoutMillis closes one left idle during a long action.
// So begin() takes a connection with pool.connect(), claims on it, and a
// 'new' or 'recover' claim keeps it checked out -- never back in the pool --
// until its finish() or abort(), which run on it too.  Other requests'
// statements never run on it, and no idle timeout or recycling can close it.
// A replay, or an error (IK409, IK422, ...), gives the connection back to
// the pool at once (closed instead if it broke).
//
// Tokens are bigints above 2^53 (docs/durability.md, "Fencing tokens"), which a
// JavaScript number cannot hold.  Every statement selects the token as text
// (token::text) and sends it back as text ($3::bigint), so no type parser
// touches it -- not even pg.types.setTypeParser(20, parseInt).  claim.token
// is that string, or a BigInt with { tokens: 'bigint' }.

const util = require('node:util');

const { fingerprint: computeFingerprint } = require('./fingerprint');
const errors = require('./errors');
const { IdempotentRoute, sendError } = require('./middleware');
const { intervalText, milliseconds } = require('./duration');

const {
	translate, brokeConnection, isServerError, WaitTimeoutError, LostClaimError,
} = errors;

const SERIALIZATION_RETRIES = 3;
const FINISH_RETRIES = 5;
const RECONNECTS = 5;

// A pooled session the server had ended (terminated, shut down, restarting):
// FATAL 57P01..57P03, whose statement did not commit, or a write to its
// closed socket (EPIPE), which never reached it.
function endedSession(err) {
	return isServerError(err) ? err.severity === 'FATAL' && /^57P0[123]$/.test(err.code) : err?.code === 'EPIPE';
}

// ------------------------------------------------------------------ SQL

// idem_begin with the arguments the call names (NULL ones fall back to the
// settings idempotency.in_flight, .lease, .ttl, .takeover, .remember): only
// the given ones are in the text, so a call without takeover and remember
// also works against the extension's 1.3.  With `checkpoint`, the claim's
// own statement records the checkpoint state (one round trip) unless it
// replays.
const BEGIN_ARGS = [
	['inFlight', 'in_flight', 'text', 'i'],
	['lease', 'lease', 'interval', 'l'],
	['ttl', 'ttl', 'interval', 't'],
	['takeover', 'takeover', 'text', 'k'],
	['remember', 'remember', 'interval', 'r'],
];

function beginStatement(options) {
	let text = 'SELECT c.status, c.token::text AS token, c.response';
	let args = '';
	let name = 'idem_begin';
	let n = 3;
	const values = [];
	if (options.checkpoint !== undefined && options.checkpoint !== null) {
		text += `,\n       CASE WHEN c.status <> 'replay' THEN idem_checkpoint($1, $2, c.token, $${++n}::jsonb) END`;
		values.push(JSON.stringify(options.checkpoint));
		name += '_c';
	}
	for (const [option, arg, type, letter] of BEGIN_ARGS) {
		const value = options[option];
		if (value !== undefined && value !== null) {
			args += `, ${arg} => $${++n}::${type}`;
			values.push(type === 'interval' ? intervalText(value) : value);
			name += `_${letter}`;
		}
	}
	text += `\n  FROM idem_begin($1, $2, $3::bytea${args}) AS c`;
	return { name, text, values };
}

const FINISH_TEXT = 'SELECT idem_finish($1, $2, $3::bigint, $4::jsonb), $4::jsonb AS response';
const FINISH = { name: 'idem_finish', text: FINISH_TEXT };
const ABORT = { name: 'idem_abort', text: 'SELECT idem_abort($1, $2, $3::bigint) AS released' };
const CHECKPOINT = { name: 'idem_checkpoint', text: 'SELECT idem_checkpoint($1, $2, $3::bigint, $4::jsonb)' };
const RENEW = { name: 'idem_renew', text: 'SELECT idem_renew($1, $2, $3::bigint, $4::interval) AS lease_until' };
const INSPECT = {
	name: 'idem_inspect',
	text: `SELECT state, token::text AS token, encode(fingerprint, 'hex') AS fingerprint, created_at, lease_until,
	              completed_at, expires_at, uncommitted, response
	         FROM idem_inspect($1, $2)`,
};
// Retry-After for a 409 (docs/http.md): the expected duration of an attempt
// ($3, seconds) less how long the holding one has run, never beyond its
// lease, by the server's clock; at least 1
const RETRY_AFTER = {
	name: 'idem_retry_after',
	text: `SELECT greatest(1, ceil(least($3::float8 - extract(epoch FROM clock_timestamp() - created_at),
	                                      extract(epoch FROM lease_until - clock_timestamp()))))::int AS seconds
	         FROM idem_inspect($1, $2) WHERE lease_until IS NOT NULL`,
};
// A claim with a waitTimeout: one simple-protocol string, which PostgreSQL
// runs as one implicit transaction, so the setting (local to it) ends with
// it, committed or not, and the connection keeps its own statement_timeout.
// PostgreSQL arms statement_timeout for each statement of the string as it
// starts, so the claim runs under the new one.  One round trip where a SET,
// the claim and a RESET would take three; the values are in the text as
// literals (sqlLiteral), since the simple protocol has no parameters.
const WAIT_PREFIX = 'SELECT set_config(\'statement_timeout\', $0, true);\n';

// a value as an SQL literal: text (backslashes doubled, with E''), a
// Buffer as decode('<hex>', 'hex'), or NULL
function sqlLiteral(value) {
	if (value === null || value === undefined) {
		return 'NULL';
	}
	if (Buffer.isBuffer(value)) {
		return `decode('${value.toString('hex')}', 'hex')`;
	}
	const text = String(value);
	const quoted = `'${text.replace(/'/g, "''").replace(/\\/g, '\\\\')}'`;
	return text.includes('\\') ? `E${quoted}` : quoted;
}

// the claim's statement under waitTimeout (ms): its text with the values
// in place of $1..$n
function waitingStatement(statement, waitTimeout) {
	const values = [String(waitTimeout), ...statement.values];
	return (WAIT_PREFIX + statement.text).replace(/\$(\d+)/g, (_, n) => sqlLiteral(values[Number(n)]));
}

// The finish, and the effect's statement in the same statement (so in one
// transaction): `WITH effect AS (INSERT ...) SELECT idem_finish(...)`.  The
// effect's parameters are numbered from $5 ($1..$4 are the finish's).
function finishStatement(effect) {
	if (!effect) {
		return FINISH;
	}
	const statement = { text: `WITH effect AS (\n${effect.text}\n)\n${FINISH_TEXT}` };
	if (effect.name) {
		statement.name = effect.name;
	}
	return statement;
}

// ---------------------------------------------------------- connections

// A connection checked out of a pool for as long as an attempt holds its
// claim.  While it is checked out the pool does not listen for its errors: a
// connection that breaks meanwhile (server restart) is noted here instead of
// crashing the process; a claim made on it has lapsed with its session.
class HeldConnection {
	constructor(client) {
		this.client = client;
		this.broken = null;
		this.released = false;
		this.onError = (err) => { this.broken = err; };
		client.on('error', this.onError);
	}

	get usable() {
		return this.broken === null && !this.released;
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
	// attempt gives up on a claim it still holds: closing the session lets a
	// 'session' claim lapse at once).
	release(close = false) {
		if (this.released) {
			return;
		}
		this.released = true;
		this.client.removeListener('error', this.onError);
		this.client.release(this.broken ?? (close ? new Error('the attempt gave up its claim') : undefined));
	}
}

// One statement on a pooled connection, which goes back to the pool after an
// error the server sent (the connection is fine): pool.query() would close
// it, and each IK409 or IK422 would cost a new connection.
async function query(pool, statement) {
	const conn = new HeldConnection(await pool.connect());
	try {
		return await conn.query(statement);
	} finally {
		conn.release();
	}
}

// connection failures, too many connections, out of memory or disk, server
// shutting down
function isTransient(err) {
	return !isServerError(err) || /^(08|53|57P)/.test(err.code);
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// Send a statement again after err, its attempt-th failure?  Only a
// serialization failure (40001: the statement's transaction rolled back,
// nothing was done) on a connection in no transaction (client's status
// 'I' once the error is in; a pg too old to tell counts as one): in a
// transaction of the application's own (BEGIN on claim.connection) it
// aborted that transaction, and is thrown.
function serializationRetry(err, attempt, client) {
	return err?.code === '40001' && attempt < SERIALIZATION_RETRIES
		&& (client.getTransactionStatus?.() ?? 'I') === 'I';
}

// idem_begin on conn, under statement_timeout = waitTimeout (ms) if given,
// retried on 40001 -> its row.  On an error there is no claim: the
// connection goes back to the pool (closed if it broke).
async function claimOn(conn, statement, waitTimeout) {
	const text = waitTimeout === undefined ? null : waitingStatement(statement, waitTimeout);
	try {
		for (let attempt = 1; ; attempt++) {
			try {
				if (text === null) {
					return (await conn.query(statement)).rows[0];
				}
				const results = await conn.query(text);
				return results[results.length - 1].rows[0];
			} catch (err) {
				// docs/errors.md: under REPEATABLE READ the snapshot may not see a
				// concurrent result; the retry replays it
				if (!serializationRetry(err, attempt, conn.client)) {
					throw err;
				}
			}
		}
	} catch (err) {
		conn.release();
		throw err;
	}
}

// ---------------------------------------------------------------- client

const OUTCOMES = { new: 'new', replay: 'replay', recover: 'recover' };

function defaultLog() {
	const debug = util.debuglog('idempotency-pg');
	return { debug: (msg) => debug('%s', msg), error: (...args) => console.error(...args) };
}

class IdempotencyClient {
	// pool: a pg.Pool for the claims.  Options:
	//   finishPool    where a finish or abort runs if the claim's connection
	//                 broke (default: pool)
	//   tokens        'string' (default) or 'bigint': the type of claim.token
	//   inFlight, lease, ttl, takeover, remember, waitTimeout: defaults for begin()
	//   log           { debug(msg), error(...) }; debug: NODE_DEBUG=idempotency-pg
	//   onOutcome     (operation, outcome) => void, for counting
	constructor(pool, options = {}) {
		if (!pool || typeof pool.connect !== 'function') {
			throw new TypeError('IdempotencyClient needs a pg.Pool');
		}
		this.pool = pool;
		this.finishPool = options.finishPool ?? pool;
		if (options.tokens !== undefined && options.tokens !== 'string' && options.tokens !== 'bigint') {
			throw new TypeError(`tokens must be 'string' or 'bigint', not ${JSON.stringify(options.tokens)}`);
		}
		this.tokens = options.tokens ?? 'string';
		this.defaults = {};
		for (const [option] of BEGIN_ARGS) {
			if (options[option] !== undefined) {
				this.defaults[option] = options[option];
			}
		}
		if (options.waitTimeout !== undefined && options.waitTimeout !== null) {
			this.defaults.waitTimeout = milliseconds(options.waitTimeout);
		}
		this.log = { ...defaultLog(), ...(options.log ?? {}) };
		this.onOutcome = options.onOutcome ?? null;
	}

	// middleware(options): an express middleware for routes that take an
	// Idempotency-Key header (README.md, "The middleware")
	middleware(options) {
		return new IdempotentRoute(this, options).handler;
	}

	// sendError(res, err, { operation, key, problemTypeBase, expected }):
	// answer err as the middleware does (docs/http.md)
	sendError(res, err, context) {
		return sendError(this, res, err, context);
	}

	// begin(operation, key, fingerprint, options) -> Claim
	//
	// fingerprint: a Buffer (any bytea, e.g. fingerprint(...)), an array of
	// values (fingerprinted here as idem_fingerprint would), or null.
	// options: inFlight ('wait' | 'raise'), lease, ttl, remember (interval
	// text such as '30 s', or milliseconds), takeover ('lease' | 'session'),
	// checkpoint (a state recorded on the claim in the same statement),
	// waitTimeout (how long a duplicate waits for the attempt holding the
	// key: milliseconds or '2 s'; the server's statement_timeout otherwise).
	// Throws InProgressError (WaitTimeoutError after waitTimeout),
	// KeyReuseError, ResponseExpiredError, InvalidRequestError, or node-pg's
	// error.
	async begin(operation, key, fingerprint, options = {}) {
		const fp = Array.isArray(fingerprint) ? computeFingerprint(...fingerprint) : (fingerprint ?? null);
		const opts = { ...this.defaults, ...options };
		const waitTimeout = options.waitTimeout !== undefined && options.waitTimeout !== null
			? milliseconds(options.waitTimeout) : this.defaults.waitTimeout;
		const statement = beginStatement(opts);
		statement.values = [operation, key, fp, ...statement.values];
		const context = { operation, key, requestFingerprint: fp };
		const report = (outcome) => this.report(operation, key, outcome, options.onOutcome);

		let conn;
		let row;
		for (let reconnect = 0; ; reconnect++) {
			conn = new HeldConnection(await this.pool.connect());
			try {
				row = await claimOn(conn, statement, waitTimeout);
				break;
			} catch (err) {
				if (endedSession(err) && reconnect < RECONNECTS) {
					// the server had ended this pooled session (restarted, or
					// terminated it) before our statement: nothing ran; again
					// on a new connection
					conn.release();
					continue;
				}
				let e = translate(err, context);
				if (waitTimeout !== undefined && isServerError(err) && err.code === '57014') {
					// waitTimeout ended the wait for the attempt holding the key:
					// it is still running
					e = new WaitTimeoutError(`gave up waiting for the attempt that holds idempotency key ${JSON.stringify(key)}: ${err.message}`,
						{ sqlstate: '57014', detail: err.detail ?? null, operation, key, cause: err });
				}
				const outcome = e instanceof errors.InProgressError ? 'in_progress'
					: e instanceof errors.KeyReuseError ? 'key_reuse'
						: e instanceof errors.ResponseExpiredError ? 'expired' : null;
				if (outcome) {
					report(outcome);
				}
				throw e;
			}
		}
		report(OUTCOMES[row.status] ?? row.status);
		if (row.status === 'replay') {
			conn.release();
			return new Claim(this, { operation, key, fingerprint: fp, status: row.status, token: null, response: row.response, conn: null });
		}
		return new Claim(this, { operation, key, fingerprint: fp, status: row.status, token: row.token, response: row.response, conn });
	}

	report(operation, key, outcome, extraHook) {
		this.log.debug(`idempotency ${outcome}: operation ${JSON.stringify(operation)}, key ${JSON.stringify(key)}`);
		for (const hook of [this.onOutcome, extraHook]) {
			if (hook) {
				try {
					hook(operation, outcome);
				} catch (err) {
					this.log.error('idempotency-pg: onOutcome failed:', err);
				}
			}
		}
	}

	// inspect(operation, key) -> the calling role's record (idem_inspect),
	// token as text and fingerprint as hex, or null
	async inspect(operation, key) {
		const { rows } = await query(this.pool, { ...INSPECT, values: [operation, key] });
		return rows[0] ?? null;
	}

	// retryAfter(operation, key, expected) -> a 409's Retry-After
	// (docs/http.md): seconds until the attempt holding the key is expected
	// to end -- `expected` (seconds an attempt takes; default 0) less how
	// long it has run, and no later than its lease's end -- at least 1; 1
	// when there is no claim any more.
	async retryAfter(operation, key, expected = 0) {
		const { rows } = await query(this.pool, { ...RETRY_AFTER, values: [operation, key, expected] });
		return rows[0]?.seconds ?? 1;
	}
}

// ----------------------------------------------------------------- claim

class Claim {
	constructor(client, { operation, key, fingerprint, status, token, response, conn }) {
		this.client = client;
		this.operation = operation;
		this.key = key;
		this.fingerprint = fingerprint;
		// 'new' | 'recover' (we hold the key) | 'replay'
		this.status = status;
		// replay: the stored response; recover: the last checkpoint's state
		this.response = response;
		this.tokenText = token;
		this.conn = conn;
		this.settled = conn === null;
	}

	// the fencing token: a string, or a BigInt with { tokens: 'bigint' };
	// null for a replay
	get token() {
		if (this.tokenText === null) {
			return null;
		}
		return this.client.tokens === 'bigint' ? BigInt(this.tokenText) : this.tokenText;
	}

	// true while this attempt holds the key and has not finished or aborted
	get pending() {
		return !this.settled;
	}

	// the held connection (pg.PoolClient), for statements of the attempt's own
	// in between; null once settled
	get connection() {
		return this.settled ? null : this.conn.client;
	}

	assertPending(what) {
		if (this.settled) {
			throw new Error(`${what}: the claim on ${JSON.stringify(this.key)} is ${this.status === 'replay' ? 'a replay' : 'settled'}`);
		}
	}

	// A statement of the claim's, on its own connection; on finishPool if that
	// connection broke (the claim lapsed with its session; until another
	// attempt takes it over, the token still holds it).  Sent again after a
	// serialization failure (40001: a Citus shard move raced it, or
	// default_transaction_isolation is repeatable read; it rolled back, so
	// nothing was done): a finish failing so would leave the claim pending
	// after the action ran, for a takeover to run it again.  Not in a
	// transaction the application opened on claim.connection
	// (serializationRetry).
	async run(statement) {
		for (let attempt = 1; ; attempt++) {
			const conn = this.conn.usable ? this.conn : new HeldConnection(await this.client.finishPool.connect());
			try {
				return await conn.query(statement);
			} catch (err) {
				if (!serializationRetry(err, attempt, conn.client)) {
					throw err;
				}
			} finally {
				if (conn !== this.conn) {
					conn.release();
				}
			}
		}
	}

	values(...rest) {
		return [this.operation, this.key, this.tokenText, ...rest];
	}

	// finish(response, { effect: { text, values, name } }) -> the stored
	// response, as jsonb returned it (send that one: jsonb orders object keys
	// its own way, and a replay must be identical).
	//
	// effect: a data-modifying statement (INSERT / UPDATE / DELETE) run in
	// the same statement, so in the same transaction, as idem_finish; its
	// parameters are numbered from $5.  Retried on connection errors and on
	// 40001 (run(): the action was done: a claim left pending would make the
	// next retry run it again).  On IK412 (LostClaimError) the connection goes back to the pool.
	// On another error the server sent (54000, 22004, an effect's error) the
	// claim stays held: finish again (a smaller response), abort (nothing
	// happened), or release.  When the connection is lost for good the
	// attempt gives up: the connection is closed, so a 'session' claim
	// lapses at once, keeping its checkpoint.
	async finish(response, { effect } = {}) {
		this.assertPending('finish');
		const statement = {
			...finishStatement(effect),
			values: this.values(JSON.stringify(response ?? null), ...(effect?.values ?? [])),
		};
		for (let attempt = 1; ; attempt++) {
			try {
				const { rows } = await this.run(statement);
				this.settle();
				return rows[0].response;
			} catch (err) {
				if (isTransient(err) && attempt < FINISH_RETRIES) {
					await sleep(100 * attempt);
					continue;
				}
				const e = translate(err, this);
				if (e instanceof LostClaimError) {
					this.settle();
				} else if (!isServerError(err) || !this.conn.usable) {
					this.settle(true);
				}
				throw e;
			}
		}
	}

	// abort() -> true if the claim was released (false: the token no longer
	// held it).  Errors are not cached: the next request runs again.  If
	// idem_abort fails, the connection is closed (a 'session' claim lapses;
	// a leased one when its lease ends) and the error is thrown.
	async abort() {
		this.assertPending('abort');
		try {
			const { rows } = await this.run({ ...ABORT, values: this.values() });
			this.settle();
			return rows[0].released;
		} catch (err) {
			this.settle(true);
			throw translate(err, this);
		}
	}

	// checkpoint(state): idem_checkpoint; after a takeover the next owner
	// gets status 'recover' with this state
	async checkpoint(state) {
		this.assertPending('checkpoint');
		try {
			await this.run({ ...CHECKPOINT, values: this.values(JSON.stringify(state ?? null)) });
		} catch (err) {
			throw translate(err, this);
		}
	}

	// renew(lease) -> the new end of the lease (Date): idem_renew
	async renew(lease) {
		this.assertPending('renew');
		try {
			const { rows } = await this.run({ ...RENEW, values: this.values(intervalText(lease)) });
			return rows[0].lease_until;
		} catch (err) {
			throw translate(err, this);
		}
	}

	// release({ close }): give the connection up without finishing or
	// aborting.  close: true ends the session, so that a 'session' claim
	// lapses at once (keeping its checkpoint); false hands it back to the
	// pool, where the claim lives as long as the pooled connection.
	release({ close = true } = {}) {
		if (!this.settled) {
			this.settle(close);
		}
	}

	settle(close = false) {
		this.settled = true;
		this.conn?.release(close);
	}
}

module.exports = {
	IdempotencyClient, Claim, HeldConnection, query, beginStatement, finishStatement,
	statements: { FINISH, ABORT, CHECKPOINT, RENEW, INSPECT, RETRY_AFTER },
};
