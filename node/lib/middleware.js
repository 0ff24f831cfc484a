'use strict';
// The express middleware: routes that take an Idempotency-Key header (IETF
// draft-ietf-httpapi-idempotency-key-header), answering as docs/http.md's
// table says -- the HTTP contract that the Python package follows too.
//
// An IdempotentRoute is one declared route: its options, checked where the
// route is declared, and what it measured (how long its attempts take, for
// a 409's Retry-After).  An Attempt is one request that holds the key: it
// captures what the handler sends -- res.writeHead, res.write and res.end
// alike, so that nothing leaves before it is stored -- then stores it with
// idem_finish and sends it, or releases the claim (errors are not cached).
// Once the handler has run, a failure to store never leads to a second run:
// the key is completed with the response-not-stored answer instead, or,
// while the database refuses every write of it, the claim is kept and the
// response stored in the background.

const { setTimeout: sleep } = require('node:timers/promises');
const { isDeepStrictEqual } = require('node:util');

const { parseIdempotencyKey } = require('./key');
const { fingerprint: computeFingerprint } = require('./fingerprint');
const { milliseconds } = require('./duration');
const errors = require('./errors');

const TITLES = {
	'idempotency-key-missing': 'Idempotency-Key is missing',
	'idempotency-key-malformed': 'Idempotency-Key is malformed',
	'idempotency-key-reused': 'Idempotency-Key is already used',
	'idempotency-key-expired': 'The response for this Idempotency-Key has expired',
	'request-in-progress': 'A request is outstanding for this Idempotency-Key',
	'response-not-stored': 'The response for this Idempotency-Key was not stored',
	'invalid-request': 'Invalid request',
	'internal-error': 'Internal error',
	'service-unavailable': 'Service unavailable',
};

const PROBLEM_TYPE_BASE = 'urn:idempotency:problem:';
const JSON_TYPE = 'application/json; charset=utf-8';
const PROBLEM_TYPE = 'application/problem+json; charset=utf-8';
const PARTS = new Set(['body', 'params', 'query', 'headers']);
// "try again later" statuses: not stored, as server errors are not
const NOT_STORED = new Set([408, 425, 429]);
// statuses whose responses have no body, and no Content-Length
const BODILESS = new Set([204, 304]);
// headers stored with every response, whatever replayHeaders says: what
// the stored bytes are (a compression after the middleware sets the
// encoding), and what they were chosen by
const BODY_HEADERS = ['content-type', 'content-encoding', 'vary'];

const defaultStore = (status) => status < 500 && !NOT_STORED.has(status);
// a response the database refuses to store is tried again after these
// delays (ms): the first, doubled each round up to the last
const STORE_DELAY = 100;
const MAX_STORE_DELAY = 5000;

// problem(status, name, detail, { extra, headers }): an RFC 9457 problem
// detail; `name` is its type's slug, one of TITLES' keys.
function problem(status, name, detail, { extra = {}, headers = {} } = {}) {
	return { status, name, title: TITLES[name] ?? name, detail, extra, headers };
}

// the problem's type URI: problemType(name) if given, else
// problemTypeBase + name
function problemTypeOf({ problemType, problemTypeBase = PROBLEM_TYPE_BASE } = {}) {
	if (problemType !== undefined && problemType !== null) {
		if (typeof problemType !== 'function') {
			throw new TypeError('problemType must be a function of the problem\'s name');
		}
		return problemType;
	}
	if (typeof problemTypeBase !== 'string') {
		throw new TypeError('problemTypeBase must be a string');
	}
	return (name) => problemTypeBase + name;
}

function problemText(p, typeOf) {
	const body = {};
	const type = typeOf(p.name);
	if (type !== undefined && type !== null) {
		body.type = type;
	}
	Object.assign(body, { title: p.title, status: p.status, detail: p.detail }, p.extra);
	return JSON.stringify(body);
}

// sendProblem(res, p, { problemType, problemTypeBase })
function sendProblem(res, p, options = {}) {
	const text = problemText(p, problemTypeOf(options));
	for (const h of ['content-length', 'content-encoding', 'etag', 'location']) {
		res.removeHeader(h);
	}
	for (const [name, value] of Object.entries(p.headers)) {
		res.setHeader(name, value);
	}
	res.statusCode = p.status;
	res.setHeader('Content-Type', PROBLEM_TYPE);
	res.setHeader('Content-Length', Buffer.byteLength(text));
	res.end(text);
}

// The body of a stored response { status, headers, text | base64 | body }
// -> { bytes, type }: `text` is the body as it was sent, `base64` one that
// is not UTF-8 text, `body` a JSON value (a record an application wrote
// itself), whose type is JSON unless the record names another.
function storedBody(stored) {
	if (typeof stored.text === 'string') {
		return { bytes: Buffer.from(stored.text, 'utf8') };
	}
	if (typeof stored.base64 === 'string') {
		return { bytes: Buffer.from(stored.base64, 'base64') };
	}
	if (stored.body !== undefined) {
		return { bytes: Buffer.from(JSON.stringify(stored.body), 'utf8'), type: JSON_TYPE };
	}
	return { bytes: Buffer.alloc(0) };
}

// End res with status, headers -- name -> a value, or an array of values,
// each sent as a header line of its own -- and the body; Content-Length is
// the body's (none on a 204 or 304, which have no body).
function endResponse(res, status, headers, bytes, cb) {
	for (const [name, value] of Object.entries(headers)) {
		res.setHeader(name, value);
	}
	res.statusCode = status;
	if (!BODILESS.has(status)) {
		res.setHeader('Content-Length', bytes.length);
	}
	res.end(bytes, cb);
}

// sendStored(res, stored, replayed): a stored response, its headers
// exactly, with Idempotent-Replayed: true on a replay.
function sendStored(res, stored, replayed) {
	res.removeHeader('content-length');
	const { bytes, type } = storedBody(stored);
	if (type) {
		res.setHeader('Content-Type', type);	// unless the stored headers name another
	}
	if (replayed) {
		res.setHeader('Idempotent-Replayed', 'true');
	}
	endResponse(res, stored.status ?? 200, stored.headers ?? {}, bytes);
}

// problemFor(err, { retryAfter }) -> the problem an API answers for an
// error of begin / finish / abort (docs/http.md)
function problemFor(err, { retryAfter = 1 } = {}) {
	if (err instanceof errors.InProgressError) {
		return problem(409, 'request-in-progress', err instanceof errors.WaitTimeoutError
			? 'A request with this Idempotency-Key has been running for longer than this server waits. Retry later with the same key.'
			: 'A request with this Idempotency-Key is still being processed. Retry later with the same key.',
		{ headers: { 'Retry-After': String(retryAfter) } });
	}
	if (err instanceof errors.KeyReuseError) {
		return problem(422, 'idempotency-key-reused',
			'This Idempotency-Key was already used for a different request. Use a new key for a new request.',
			{ extra: { stored_fingerprint: err.storedFingerprint, request_fingerprint: err.requestFingerprint } });
	}
	if (err instanceof errors.ResponseExpiredError) {
		return problem(410, 'idempotency-key-expired',
			'The request with this Idempotency-Key was completed, and its stored response has expired. ' +
			'Do not retry it; a new request needs a new key.');
	}
	if (err instanceof errors.LostClaimError) {
		return problem(500, 'response-not-stored',
			'This attempt lost its claim on the Idempotency-Key before it could store its response. Retry with the same key.');
	}
	if (err instanceof errors.ResponseTooLargeError) {
		return problem(500, 'response-not-stored', 'The response is too large to store.');
	}
	if (err instanceof errors.InvalidRequestError) {
		return problem(400, 'invalid-request', `Invalid argument: ${err.message}.`);
	}
	// read-only, cancelled, or a serialization failure that outlasted the
	// claim's retries: the database is there, but cannot take the claim now
	if (['25006', '57014', '40001'].includes(err?.code)) {
		return problem(503, 'service-unavailable', 'The database cannot take writes right now. Retry with the same key.',
			{ headers: { 'Retry-After': '1' } });
	}
	if (!errors.isServerError(err) || /^(08|53|57P)/.test(err.code)) {
		return problem(503, 'service-unavailable', 'Could not reach the database. Retry with the same Idempotency-Key.',
			{ headers: { 'Retry-After': '1' } });
	}
	return problem(500, 'internal-error', 'The server could not complete the request.');
}

// sendError(client, res, err, { operation, key, problemType,
// problemTypeBase, expected, log }): the problem for err; a 409's
// Retry-After from the claim (client.retryAfter, `expected` seconds per
// attempt)
async function sendError(client, res, err, { operation, key, expected = 0, log = client.log, ...types } = {}) {
	const e = errors.translate(err, { operation, key });
	let retryAfter = 1;
	if (e instanceof errors.InProgressError && operation && key) {
		try {
			retryAfter = await client.retryAfter(operation, key, expected);
		} catch (inspectError) {
			log.error('idempotency-pg: reading the claim for Retry-After failed:', inspectError.message);
		}
	}
	const p = problemFor(e, { retryAfter });
	if (p.status >= 500) {
		log.error(`idempotency-pg: ${operation} ${JSON.stringify(key)}:`, e.code ?? '', e.message);
	}
	if (!res.headersSent) {
		sendProblem(res, p, types);
	}
}

// 'body.amount' -> (req) => req.body?.amount
function pathGetter(path) {
	const parts = path.split('.');
	if (parts.length < 2 || !PARTS.has(parts[0]) || parts.some((p) => p === '')) {
		throw new TypeError(`fingerprint: ${JSON.stringify(path)} is not a request part such as "body.amount", ` +
			'"params.id", "query.page" or "headers.x-tenant"');
	}
	if (parts[0] === 'headers') {
		const name = parts.slice(1).join('.').toLowerCase();
		return (req) => req.headers?.[name];
	}
	return (req) => parts.reduce((v, p) => (v !== null && typeof v === 'object' && Object.hasOwn(v, p) ? v[p] : undefined), req);
}

function fingerprinter(option) {
	if (option === undefined || option === null) {
		return () => null;
	}
	if (typeof option === 'function') {
		return (req) => {
			const v = option(req);
			return Array.isArray(v) ? computeFingerprint(...v) : v;
		};
	}
	if (!Array.isArray(option)) {
		throw new TypeError('fingerprint must be an array of request parts or a function');
	}
	const getters = option.map(pathGetter);
	return (req) => computeFingerprint(...getters.map((g) => g(req)));
}

// idempotencyKey({ header, problemType, problemTypeBase, required }): only
// the header check: req.idempotencyKey is the key (null without one when
// not required), or a 400 is sent.
function idempotencyKey({ header = 'Idempotency-Key', required = true, ...types } = {}) {
	const lower = header.toLowerCase();
	const typeOf = problemTypeOf(types);
	return function idempotencyKeyMiddleware(req, res, next) {
		const value = req.headers[lower];
		if (value === undefined && !required) {
			req.idempotencyKey = null;
			return next();
		}
		const parsed = parseIdempotencyKey(value);
		if (!parsed.ok) {
			return sendProblem(res, problem(400, parsed.missing ? 'idempotency-key-missing' : 'idempotency-key-malformed',
				parsed.reason), { problemType: typeOf });
		}
		req.idempotencyKey = parsed.key;
		return next();
	};
}

const oneOf = (name, value, allowed) => {
	if (value !== undefined && value !== null && !allowed.includes(value)) {
		throw new TypeError(`middleware: ${name} must be ${allowed.map((a) => `'${a}'`).join(' or ')}`);
	}
};

// One declared route: idem.middleware(options) is `new
// IdempotentRoute(idem, options).handler`.  Options: README.md, "The
// middleware".
class IdempotentRoute {
	constructor(client, options = {}) {
		const {
			operation, fingerprint, inFlight, lease, ttl, takeover, remember, waitTimeout, checkpoint = false, recover,
			headers, replayHeaders = headers ?? ['Location', 'ETag'], store = defaultStore, onStoreError = 'raise',
			header = 'Idempotency-Key', required = true, onOutcome, problemType, problemTypeBase,
		} = options;
		if (typeof operation !== 'string' || operation === '') {
			throw new TypeError('middleware: operation must be a non-empty string');
		}
		oneOf('inFlight', inFlight, ['wait', 'raise']);
		oneOf('takeover', takeover, ['lease', 'session']);
		oneOf('onStoreError', onStoreError, ['raise', 'run']);
		if (recover !== undefined && recover !== null && typeof recover !== 'function') {
			throw new TypeError('middleware: recover must be a handler (req, res, next)');
		}
		if (checkpoint !== false && checkpoint !== true && typeof checkpoint !== 'function') {
			throw new TypeError('middleware: checkpoint must be true, false or a function (req, key) => state');
		}
		// a key taken over with a checkpoint gets 'recover': with no recover
		// handler, every retry of that key would have nothing to run
		if (checkpoint !== false && !recover) {
			throw new TypeError('middleware: a route with a checkpoint needs a recover handler (recover: (req, res, next) => ...), ' +
				'which answers a retry after the attempt that wrote the checkpoint died');
		}
		if (typeof store !== 'function') {
			throw new TypeError('middleware: store must be a function of the status');
		}
		this.client = client;
		this.operation = operation;
		this.fingerprint = fingerprinter(fingerprint);
		this.keep = [...new Set([...replayHeaders.map((h) => h.toLowerCase()), ...BODY_HEADERS])];
		this.store = store;
		this.recover = recover ?? null;
		this.onStoreError = onStoreError;
		this.typeOf = problemTypeOf({ problemType, problemTypeBase });
		// the stored answer of a key whose handler ran but whose response
		// could not be stored: every retry gets it
		this.notStored = {
			status: 410,
			headers: { 'content-type': PROBLEM_TYPE },
			text: problemText(problem(410, 'response-not-stored',
				'The request with this Idempotency-Key was processed, but its response could not be stored. ' +
				'Do not retry it; a new request needs a new key.'), this.typeOf),
		};
		this.log = { ...client.log, ...(options.log ?? {}) };
		this.checkpointState = checkpoint === true ? (req, key) => ({ idempotency_key: key })
			: typeof checkpoint === 'function' ? checkpoint : null;
		this.beginOptions = Object.fromEntries(Object.entries({
			inFlight, lease, ttl, takeover, remember, onOutcome,
			waitTimeout: waitTimeout === undefined || waitTimeout === null ? undefined : milliseconds(waitTimeout),
		}).filter(([, v]) => v !== undefined));
		// the mean duration of this route's stored attempts, in seconds
		// (exponentially weighted), for Retry-After; null before the first
		this.expected = null;
		const checkKey = idempotencyKey({ header, required, problemType: this.typeOf });
		this.handler = (req, res, next) => {
			if (req.method === 'HEAD') {
				// safe by definition (express serves it through app.get routes):
				// no idempotency, nothing claimed, the handler's own headers
				req.idempotencyKey = null;
				req.idempotency = null;
				return next();
			}
			checkKey(req, res, (err) => {
				if (err) {
					return next(err);
				}
				this.handle(req, res, next).catch(next);
				return undefined;
			});
		};
	}

	measure(seconds) {
		this.expected = this.expected === null ? seconds : 0.8 * this.expected + 0.2 * seconds;
	}

	sendProblem(res, p) {
		sendProblem(res, p, { problemType: this.typeOf });
	}

	async handle(req, res, next) {
		const key = req.idempotencyKey;
		if (key === null) {
			req.idempotency = null;
			return next();	// required: false, and no key: no idempotency
		}
		let requestFingerprint;
		try {
			requestFingerprint = this.fingerprint(req);
		} catch (err) {
			if (!(err instanceof TypeError)) {
				throw err;
			}
			return this.sendProblem(res, problem(400, 'invalid-request', `The request cannot be fingerprinted: ${err.message}.`));
		}
		let claim;
		try {
			claim = await this.client.begin(this.operation, key, requestFingerprint, {
				...this.beginOptions,
				...(this.checkpointState ? { checkpoint: this.checkpointState(req, key) } : {}),
			});
		} catch (err) {
			if (this.onStoreError === 'run' && errors.isUnreachable(err)) {
				this.log.error(`idempotency-pg: ${this.operation} ${JSON.stringify(key)}: the database cannot be reached; ` +
					"the handler runs without idempotency (onStoreError: 'run'):", err.code ?? '', err.message);
				req.idempotency = null;
				return next();
			}
			return sendError(this.client, res, err, {
				operation: this.operation, key, problemType: this.typeOf, expected: this.expected ?? 0, log: this.log,
			});
		}
		if (claim.status === 'replay') {
			return sendStored(res, claim.response ?? {}, true);
		}
		const attempt = new Attempt(this, req, res, claim);
		if (claim.status === 'recover' && !this.recover) {
			return attempt.terminal();
		}
		attempt.capture();
		if (claim.status === 'recover') {
			return Promise.resolve(this.recover(req, res, next)).catch(next);
		}
		return next();
	}
}

const CAPTURED = ['writeHead', 'write', 'end', 'flushHeaders'];

// writeHead's headers as [name, value] pairs: an object, an array of
// pairs, or a flat array [name, value, name, value, ...]
function headerPairs(headers) {
	if (!Array.isArray(headers)) {
		return Object.entries(headers ?? {});
	}
	if (Array.isArray(headers[0])) {
		return headers;
	}
	const pairs = [];
	for (let i = 0; i + 1 < headers.length; i += 2) {
		pairs.push([headers[i], headers[i + 1]]);
	}
	return pairs;
}

// One request that holds the key.
class Attempt {
	constructor(route, req, res, claim) {
		this.route = route;
		this.req = req;
		this.res = res;
		this.claim = claim;
		this.chunks = [];
		// the head at the handler's first write (Node would send it then)
		this.written = null;
		this.done = false;
		this.started = process.hrtime.bigint();
		this.saved = {};
	}

	get log() {
		return this.route.log;
	}

	// Hold back whatever the handler sends until it is stored.  Its status,
	// message and headers (the head) are taken at its first write, as Node
	// sends them, else when it ends the response, and sent so, whatever
	// changes them later: an error of the handler after its answer does not
	// alter it, as in express once headers were sent.
	capture() {
		const { res, claim } = this;
		for (const name of CAPTURED) {
			this.saved[name] = Object.hasOwn(res, name) ? { own: res[name] } : null;
		}
		res.writeHead = (statusCode, reason, headers) => {
			if (typeof reason !== 'string') {
				headers = reason;
			} else {
				res.statusMessage = reason;
			}
			res.statusCode = statusCode;
			// as Node's: an array's names replace the values set before, and a
			// name repeated in it adds a value
			const pairs = headerPairs(headers);
			for (const [name] of pairs) {
				res.removeHeader(name);
			}
			for (const [name, value] of pairs) {
				const before = res.getHeader(name);
				res.setHeader(name, before === undefined ? value : [].concat(before, value));
			}
			return res;
		};
		res.write = (chunk, encoding, cb) => {
			if (typeof encoding === 'function') {
				[cb, encoding] = [encoding, undefined];
			}
			if (!this.done) {
				this.written ??= this.head();
				this.push(chunk, encoding);
			}
			if (cb) {
				process.nextTick(cb);
			}
			return true;
		};
		res.end = (chunk, encoding, cb) => {
			if (typeof chunk === 'function') {
				[cb, chunk, encoding] = [chunk, undefined, undefined];
			} else if (typeof encoding === 'function') {
				[cb, encoding] = [encoding, undefined];
			}
			if (this.done) {
				return res;	// an error handler's, after the handler's answer
			}
			this.done = true;
			let head = this.head();
			let keep = this.stores(head.status);
			if (this.written && !isDeepStrictEqual(head, this.written)) {
				if (keep) {
					// the head changed after a write: Node sends the head of the
					// first write, and the whole body after it
					head = this.written;
					keep = this.stores(head.status);
				} else {
					// an answer not stored after a write: an error handler's for a
					// handler that failed midway.  Nothing was sent yet: it
					// replaces the partial body, rather than following it in a
					// malformed message, and releases the claim.
					this.chunks = [];
				}
			}
			this.push(chunk, encoding);
			this.complete(head, keep, Buffer.concat(this.chunks), cb).catch((err) => this.log.error('idempotency-pg:', err));
			return res;
		};
		res.flushHeaders = () => {};
		const attempt = this;
		this.req.idempotency = {
			key: claim.key,
			operation: claim.operation,
			status: claim.status,
			recovered: claim.status === 'recover' ? claim.response : null,
			claim,
			get token() { return claim.token; },
			respond: (response, options) => attempt.respond(response, options),
			checkpoint: (state) => {
				if (!attempt.route.recover) {
					throw new Error(`idempotency-pg: ${claim.operation}: a checkpoint needs a recover handler on the route`);
				}
				return claim.checkpoint(state);
			},
		};
	}

	// what Node would send as the response's head now
	head() {
		const { res } = this;
		return { status: res.statusCode, message: res.statusMessage, headers: res.getHeaders() };
	}

	// The response as the handler ended it, through the real res.end.
	send({ status, message, headers }, bytes, cb) {
		const { res } = this;
		this.restore();
		for (const name of res.getHeaderNames()) {
			res.removeHeader(name);
		}
		res.statusMessage = message;
		endResponse(res, status, headers, bytes, cb);
	}

	restore() {
		for (const name of CAPTURED) {
			if (this.saved[name]) {
				this.res[name] = this.saved[name].own;
			} else {
				delete this.res[name];
			}
		}
	}

	push(chunk, encoding) {
		if (chunk === undefined || chunk === null) {
			return;
		}
		this.chunks.push(typeof chunk === 'string' ? Buffer.from(chunk, typeof encoding === 'string' ? encoding : 'utf8')
			: Buffer.from(chunk));
	}

	// the record of a response: the kept headers (lower case; one sent more
	// than once as an array of its values), and the body as sent (text, or
	// base64 when it is not UTF-8 text jsonb can hold)
	record({ status, headers }, bytes) {
		const record = { status, headers: {} };
		for (const name of this.route.keep) {
			const value = headers[name];
			if (Array.isArray(value) && value.length !== 1) {
				record.headers[name] = value.map(String);
			} else if (value !== undefined && value !== null) {
				record.headers[name] = String(value);
			}
		}
		const text = bytes.toString('utf8');
		if (!text.includes('\u0000') && Buffer.from(text, 'utf8').equals(bytes)) {
			record.text = text;
		} else {
			record.base64 = bytes.toString('base64');
		}
		return record;
	}

	get where() {
		return `idempotency-pg: ${this.claim.operation} ${JSON.stringify(this.claim.key)}`;
	}

	// Store the record (and run the effect with it) -> 'stored'; 'not
	// stored' (the key is completed with the response-not-stored answer);
	// 'lost' (IK412: another attempt holds the key); 'failed' (the effect
	// failed: nothing happened, the claim is released); 'pending' (the
	// database refused every write: keepPending); 'unstored' (the
	// connection was lost for good: the claim lapses with it).
	async save(record, effect) {
		const { log, where } = this;
		const { outcome, error } = await this.store(record, effect);
		const report = (what) => log.error(`${where}: ${what}:`, error.code ?? '', error.message);
		if (outcome === 'stored') {
			this.route.measure(Number(process.hrtime.bigint() - this.started) / 1e9);
		} else if (outcome === 'not stored' && error) {
			report('the response was not stored, the key answers response-not-stored');
		} else if (outcome === 'lost') {
			report('the attempt lost its claim before storing its response');
		} else if (outcome === 'unstored') {
			report('the connection was lost before the response was stored; the claim lapses');
		} else if (outcome === 'refused' && effect) {
			// the effect's statement itself fails: it did not happen
			report('the effect failed, the claim is released');
			await this.claim.abort().catch((e) => log.error(`${where}: idem_abort failed:`, e.code ?? '', e.message));
			return 'failed';
		} else if (outcome === 'refused') {
			report('the database refuses to store the response; the claim is kept, and the response stored in the background');
			await this.keepPending(record, error);
			return 'pending';
		}
		return outcome;
	}

	// One pass: the record, else the response-not-stored answer ->
	// { outcome, error }: 'stored', 'not stored', 'lost', 'unstored' as
	// save() says, or 'refused': the database answered an error to both
	// (read-only, a trigger, out of disk ...) and the claim is still ours
	// (Claim.finish keeps it after an error the server sent); `error` is the
	// first (the record's) error, or the last.
	async store(record, effect) {
		const { claim } = this;
		const { notStored } = this.route;
		let error;
		for (const answer of record === notStored ? [notStored] : [record, notStored]) {
			try {
				await claim.finish(answer, { effect });
				return { outcome: answer === notStored ? 'not stored' : 'stored', error };
			} catch (err) {
				error ??= err;
				if (err instanceof errors.LostClaimError) {
					return { outcome: 'lost', error: err };
				}
				if (!claim.pending) {
					return { outcome: 'unstored', error: err };
				}
			}
		}
		return { outcome: 'refused', error };
	}

	// The database refuses to store anything of the key, but answers: the
	// claim stays pending, on its connection, and the response is stored in
	// the background, tried again (then the response-not-stored answer) after
	// a delay doubling from 100 ms to 5 s, until one is stored, the claim is
	// lost (IK412) or its connection is.  Meanwhile duplicates wait for it or
	// get 409, as for any running attempt.  A checkpoint saying so, where the
	// database takes it, makes the next attempt after a takeover (this
	// process died) get 'recover', not 'new' (a route with checkpoints keeps
	// its own: its recover handler decides).
	async keepPending(record, err) {
		const { claim, log, where } = this;
		if (!this.route.checkpointState) {
			// refused too, most likely: the background store is the remedy
			await claim.checkpoint({ response_not_stored: { error: `${err.code ?? ''} ${err.message}`.trim().slice(0, 1000) } })
				.catch(() => {});
		}
		(async () => {
			for (let delay = STORE_DELAY; ; delay = Math.min(2 * delay, MAX_STORE_DELAY)) {
				await sleep(delay);
				const { outcome, error } = await this.store(record);
				if (outcome !== 'refused') {
					log.error(`${where}: the store in the background ended: ${{
						stored: 'the response is stored',
						'not stored': 'the response-not-stored answer is stored',
						lost: 'the attempt lost its claim (IK412)',
						unstored: 'the connection was lost; the claim lapses',
					}[outcome]}`, ...(error ? [error.code ?? '', error.message] : []));
					return;
				}
			}
		})().catch((e) => log.error(`${where}: the store in the background failed:`, e));
	}

	// whether the route stores a response of this status (the store
	// option); not when the option fails
	stores(status) {
		try {
			return Boolean(this.route.store(status));
		} catch (err) {
			this.log.error('idempotency-pg: the store option failed:', err);
			return false;
		}
	}

	// what the handler sent, once it ended the response: its head, whether
	// it is stored (stores(head.status)), and its body
	async complete(head, keep, bytes, cb) {
		const { claim, log } = this;
		if (!keep) {
			// errors are not cached: release the key before the client can retry
			await claim.abort().catch((err) => log.error(`${this.where}: idem_abort failed:`, err.code ?? '', err.message));
			return this.send(head, bytes, cb);
		}
		const outcome = await this.save(this.record(head, bytes));
		if (outcome === 'stored' || outcome === 'not stored') {
			return this.send(head, bytes, cb);
		}
		this.restore();
		this.route.sendProblem(this.res, this.failure(outcome));
		return cb?.();
	}

	// the 500 for save()'s outcome when the response is not sent
	failure(outcome) {
		if (outcome === 'failed') {
			return problem(500, 'internal-error', 'The server could not complete the request.');
		}
		return problem(500, 'response-not-stored', {
			'not stored': 'The request was processed, but its response could not be encoded to be stored or sent. ' +
				'It will not run again: a retry with the same key gets 410.',
			pending: 'The request was processed, but its response is not stored yet. A retry with the same key gets it.',
			lost: 'This attempt lost its claim on the Idempotency-Key before it could store its response. Retry with the same key.',
			unstored: 'The request was processed, but its response could not be stored. Retry with the same key.',
		}[outcome]);
	}

	// req.idempotency.respond(response, { effect }): store the response (and
	// run the effect in the same statement), then send it.  -> the stored
	// record, or null when it could not be stored (then the handler's
	// response is sent, or a 500 when it cannot be: a body JSON.stringify
	// refuses, or nothing stored at all, or the effect failed).
	async respond(response, { effect } = {}) {
		if (this.done) {
			throw new Error('idempotency-pg: the response was sent already');
		}
		this.done = true;
		let record = null;
		try {
			// a JSON body is application/json unless the headers say otherwise
			const json = typeof response.text !== 'string' && response.body !== undefined;
			const headers = json ? { 'content-type': JSON_TYPE } : {};
			for (const [name, value] of Object.entries(response.headers ?? {})) {
				headers[name.toLowerCase()] = value;
			}
			const text = json ? JSON.stringify(response.body) : response.text ?? '';
			record = this.record({ status: response.status ?? 200, headers }, Buffer.from(text, 'utf8'));
		} catch (err) {
			// a body JSON.stringify refuses (a BigInt, a cycle): it can be
			// neither stored nor sent; the key is completed with the
			// response-not-stored answer (and the effect runs with it)
			this.log.error(`${this.where}: the response cannot be encoded:`, err.message);
		}
		const outcome = await this.save(record ?? this.route.notStored, effect);
		this.restore();
		if (record !== null && (outcome === 'stored' || outcome === 'not stored')) {
			sendStored(this.res, record, false);
			return outcome === 'stored' ? record : null;
		}
		this.route.sendProblem(this.res, this.failure(outcome));
		return null;
	}

	// 'recover' on a route without a recover handler (a checkpoint that other
	// code wrote): complete the key with the response-not-stored answer
	async terminal() {
		this.done = true;
		const outcome = await this.save(this.route.notStored);
		if (outcome === 'not stored') {
			return sendStored(this.res, this.route.notStored, false);
		}
		return this.route.sendProblem(this.res, this.failure(outcome));
	}
}

// middleware(client, options): idem.middleware(options)
function middleware(client, options) {
	return new IdempotentRoute(client, options).handler;
}

module.exports = {
	IdempotentRoute, middleware, idempotencyKey, sendStored, sendProblem, sendError, problemFor, problem, TITLES,
	PROBLEM_TYPE_BASE,
};
