'use strict';
// An express (or connect, or plain node:http) middleware for routes that take
// an Idempotency-Key header (IETF draft-ietf-httpapi-idempotency-key-header),
// mapping the extension's outcomes to HTTP as docs/errors.md, "Errors and HTTP" says:
//
//   key missing, empty, > 255 characters, malformed   400 problem+json
//   replay          the stored status, allow-listed headers and body, plus
//                   Idempotent-Replayed: true
//   IK409           409, Retry-After: the seconds until the claim's lease ends
//   IK422           422 problem+json with stored_fingerprint, request_fingerprint
//   IK410           410: done, its response expired; a new request needs a new key
//   22023 / 22004   400;  25006, connection errors  503, Retry-After: 1
//   IK412 / 54000   500 (the attempt lost its claim / the response is too large)
//
// 'new' or 'recover': the handler runs with req.idempotency set, and what it
// sends is stored (status < 400, `store`) or the claim is aborted (errors are
// not cached) before the response leaves.

const { parseIdempotencyKey } = require('./key');
const { fingerprint: computeFingerprint } = require('./fingerprint');
const errors = require('./errors');

const TITLES = {
	'idempotency-key-missing': 'Idempotency-Key is missing',
	'idempotency-key-malformed': 'Idempotency-Key is malformed',
	'idempotency-key-reused': 'Idempotency-Key is already used',
	'request-in-progress': 'A request is outstanding for this Idempotency-Key',
	'idempotency-key-expired': 'The response for this Idempotency-Key has expired',
	'invalid-request': 'Invalid request',
	'internal-error': 'Internal error',
	'service-unavailable': 'Service unavailable',
};

const JSON_TYPE = 'application/json; charset=utf-8';
const PARTS = new Set(['body', 'params', 'query', 'headers']);

// problem(status, name, detail, { extra, headers }): an RFC 9457 problem
// detail.  `name` is one of TITLES' keys; the response's "type" is
// problemType(name) (none, i.e. about:blank, unless the option is given).
function problem(status, name, detail, { extra = {}, headers = {} } = {}) {
	return { status, name, title: TITLES[name] ?? name, detail, extra, headers };
}

function sendProblem(res, p, { problemType } = {}) {
	const body = {};
	const type = problemType ? problemType(p.name) : undefined;
	if (type !== undefined && type !== null) {
		body.type = type;
	}
	Object.assign(body, { title: p.title, status: p.status, detail: p.detail }, p.extra);
	for (const h of ['content-length', 'etag', 'location']) {
		res.removeHeader(h);
	}
	for (const [name, value] of Object.entries(p.headers)) {
		res.setHeader(name, value);
	}
	const text = JSON.stringify(body);
	res.statusCode = p.status;
	res.setHeader('Content-Type', 'application/problem+json; charset=utf-8');
	res.setHeader('Content-Length', Buffer.byteLength(text));
	res.end(text);
}

// sendStored(res, stored, replayed): a stored response { status, headers,
// body } (body: JSON; or text: a string), with Idempotent-Replayed: true on
// a replay.  The first response is sent from what was stored too, so that
// it and its replays are identical.
function sendStored(res, stored, replayed) {
	res.removeHeader('content-length');
	const headers = stored.headers ?? {};
	for (const [name, value] of Object.entries(headers)) {
		res.setHeader(name, value);
	}
	if (!Object.keys(headers).some((h) => h.toLowerCase() === 'content-type')) {
		res.setHeader('Content-Type', JSON_TYPE);
	}
	if (replayed) {
		res.setHeader('Idempotent-Replayed', 'true');
	}
	const text = stored.body !== undefined ? JSON.stringify(stored.body) : (stored.text ?? '');
	res.statusCode = stored.status ?? 200;
	res.setHeader('Content-Length', Buffer.byteLength(text));
	res.end(text);
}

// problemFor(err, { retryAfter }) -> the problem an API answers for an
// error of begin / finish / abort (docs/errors.md, "Errors and HTTP")
function problemFor(err, { retryAfter = 1 } = {}) {
	if (err instanceof errors.InProgressError) {
		return problem(409, 'request-in-progress', err.sqlstate === '57014'
			? 'A request with this Idempotency-Key has been running for longer than this server waits. Retry later with the same key.'
			: 'A request with this Idempotency-Key is still being processed. Retry later with the same key.',
		{ headers: { 'Retry-After': String(retryAfter) } });
	}
	if (err instanceof errors.KeyReuseError) {
		return problem(422, 'idempotency-key-reused',
			'This Idempotency-Key was already used for a different request. Use a new key for a new request.',
			{ extra: { stored_fingerprint: err.storedFingerprint, request_fingerprint: err.requestFingerprint } });
	}
	if (err instanceof errors.ExpiredError) {
		return problem(410, 'idempotency-key-expired',
			'The request with this Idempotency-Key was completed, and its stored response has expired. ' +
			'Do not retry it; a new request needs a new key.');
	}
	if (err instanceof errors.FencedError) {
		return problem(500, 'internal-error',
			'This attempt lost its claim on the Idempotency-Key before it could store its response. Retry with the same key.');
	}
	if (err instanceof errors.ResponseTooLargeError) {
		return problem(500, 'internal-error', 'The response is too large to store.');
	}
	if (err instanceof errors.InputError) {
		return problem(400, 'invalid-request', `Invalid argument: ${err.message}.`);
	}
	if (err?.code === '25006' || err?.code === '57014') {
		return problem(503, 'service-unavailable', 'The database cannot take writes right now. Retry with the same key.',
			{ headers: { 'Retry-After': '1' } });
	}
	if (!errors.isServerError(err) || /^(08|53|57P)/.test(err.code)) {
		return problem(503, 'service-unavailable', 'Could not reach the database. Retry with the same Idempotency-Key.',
			{ headers: { 'Retry-After': '1' } });
	}
	return problem(500, 'internal-error', 'The server could not complete the request.');
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

// idempotencyKey({ header, problemType, required }): only the header check:
// req.idempotencyKey is the key, or a 400 is sent.
function idempotencyKey({ header = 'Idempotency-Key', problemType, required = true } = {}) {
	const lower = header.toLowerCase();
	return function idempotencyKeyMiddleware(req, res, next) {
		const value = req.headers[lower];
		if (value === undefined && !required) {
			req.idempotencyKey = null;
			return next();
		}
		const parsed = parseIdempotencyKey(value);
		if (!parsed.ok) {
			return sendProblem(res, problem(400, parsed.missing ? 'idempotency-key-missing' : 'idempotency-key-malformed',
				parsed.reason), { problemType });
		}
		req.idempotencyKey = parsed.key;
		return next();
	};
}

// middleware(client, options): see README.md of this package.
function middleware(client, options = {}) {
	const {
		operation, fingerprint, inFlight, lease, ttl, takeover, remember, checkpoint = false,
		headers = ['Location', 'ETag'], store = (status) => status < 400, problemType,
		header = 'Idempotency-Key', required = true, onOutcome,
	} = options;
	if (typeof operation !== 'string' || operation === '') {
		throw new TypeError('middleware: operation must be a non-empty string');
	}
	for (const [name, value, allowed] of [['inFlight', inFlight, ['wait', 'raise']], ['takeover', takeover, ['lease', 'session']]]) {
		if (value !== undefined && value !== null && !allowed.includes(value)) {
			throw new TypeError(`middleware: ${name} must be ${allowed.map((a) => `'${a}'`).join(' or ')}`);
		}
	}
	const log = { ...client.log, ...(options.log ?? {}) };
	const fp = fingerprinter(fingerprint);
	const keep = headers.map((h) => h.toLowerCase());
	const checkpointState = checkpoint === true ? (req, key) => ({ idempotency_key: key })
		: typeof checkpoint === 'function' ? checkpoint : null;
	const checkKey = idempotencyKey({ header, problemType, required });
	const beginOptions = { inFlight, lease, ttl, takeover, remember, onOutcome };
	for (const k of Object.keys(beginOptions)) {
		if (beginOptions[k] === undefined) {
			delete beginOptions[k];
		}
	}

	async function handle(req, res, next) {
		const key = req.idempotencyKey;
		if (key === null) {
			return next();	// required: false, and no key: no idempotency
		}
		let requestFingerprint;
		try {
			requestFingerprint = fp(req);
		} catch (err) {
			if (!(err instanceof TypeError)) {
				throw err;
			}
			return sendProblem(res, problem(400, 'invalid-request', `The request cannot be fingerprinted: ${err.message}.`),
				{ problemType });
		}
		let claim;
		try {
			claim = await client.begin(operation, key, requestFingerprint, {
				...beginOptions,
				...(checkpointState ? { checkpoint: checkpointState(req, key) } : {}),
			});
		} catch (err) {
			return sendError(client, res, err, { operation, key, problemType, log });
		}
		if (claim.status === 'replay') {
			return sendStored(res, claim.response ?? {}, true);
		}
		attach(req, res, claim, { keep, store, problemType, log });
		return next();
	}

	return function idempotencyMiddleware(req, res, next) {
		checkKey(req, res, (err) => {
			if (err) {
				return next(err);
			}
			handle(req, res, next).catch(next);
			return undefined;
		});
	};
}

// sendError(client, res, err, { operation, key, problemType, log }): the
// problem for err, with a Retry-After from the claim's lease for a 409
async function sendError(client, res, err, { operation, key, problemType, log = client.log } = {}) {
	const e = errors.translate(err, { operation, key });
	let retryAfter = 1;
	if (e instanceof errors.InProgressError && operation && key) {
		try {
			retryAfter = await client.retryAfter(operation, key);
		} catch (inspectError) {
			log.error('idempotency-pg: reading the lease for Retry-After failed:', inspectError.message);
		}
	}
	const p = problemFor(e, { retryAfter });
	if (p.status >= 500) {
		log.error(`idempotency-pg: ${operation} ${JSON.stringify(key)}:`, e.code ?? '', e.message);
	}
	if (!res.headersSent) {
		sendProblem(res, p, { problemType });
	}
}

// The handler holds the key: req.idempotency, and res.end watched, so that
// whatever the handler sends is stored (or the claim aborted) before it
// leaves.
function attach(req, res, claim, { keep, store, problemType, log }) {
	const originalEnd = res.end;
	let settled = false;
	const done = () => { settled = true; res.end = originalEnd; };

	async function respond(response, { effect } = {}) {
		if (settled) {
			throw new Error('idempotency-pg: the response was sent already');
		}
		done();
		let stored;
		try {
			stored = await claim.finish(response, { effect });
		} catch (err) {
			if (claim.pending) {
				claim.release({ close: true });	// an input error: give the claim up
			}
			log.error(`idempotency-pg: ${claim.operation} ${JSON.stringify(claim.key)}: the response was not stored:`,
				err.code ?? '', err.message);
			sendProblem(res, problemFor(errors.translate(err, claim)), { problemType });
			return null;
		}
		sendStored(res, stored, false);
		return stored;
	}

	req.idempotency = {
		key: claim.key,
		operation: claim.operation,
		status: claim.status,
		recovered: claim.status === 'recover' ? claim.response : null,
		claim,
		get token() { return claim.token; },
		respond,
		checkpoint: (state) => claim.checkpoint(state),
	};

	res.end = function end(chunk, encoding, cb) {
		if (settled) {
			return originalEnd.call(this, chunk, encoding, cb);
		}
		if (typeof chunk === 'function') {
			[cb, chunk, encoding] = [chunk, undefined, undefined];
		} else if (typeof encoding === 'function') {
			[cb, encoding] = [encoding, undefined];
		}
		const status = res.statusCode;
		if (res.headersSent || !store(status)) {
			// not stored (an error, or streamed with res.write): release the
			// key before the client can retry
			if (res.headersSent && store(status)) {
				log.error(`idempotency-pg: ${claim.operation} ${JSON.stringify(claim.key)}: a streamed response cannot be stored; the claim is aborted`);
			}
			done();
			claim.abort()
				.catch((err) => log.error(`idempotency-pg: idem_abort failed for ${JSON.stringify(claim.key)}:`, err.code ?? '', err.message))
				.finally(() => originalEnd.call(res, chunk, encoding, cb));
			return res;
		}
		const response = { status, headers: {} };
		for (const name of keep) {
			const value = res.getHeader(name);
			if (value !== undefined) {
				response.headers[name] = Array.isArray(value) ? value.join(', ') : String(value);
			}
		}
		const type = res.getHeader('content-type');
		const text = chunk === undefined || chunk === null ? ''
			: Buffer.isBuffer(chunk) ? chunk.toString('utf8') : String(chunk);
		let parsed = false;
		if (type === undefined || /[/+]json\b/i.test(String(type))) {
			try {
				response.body = text === '' ? null : JSON.parse(text);
				parsed = true;
			} catch {
				// not JSON after all: stored as text
			}
		}
		if (!parsed) {
			response.text = text;
		}
		if (type !== undefined && String(type).toLowerCase() !== JSON_TYPE) {
			response.headers['content-type'] = String(type);
		}
		respond(response).catch((err) => log.error('idempotency-pg:', err)).finally(() => cb?.());
		return res;
	};
}

module.exports = { middleware, idempotencyKey, sendStored, sendProblem, sendError, problemFor, problem, TITLES };
