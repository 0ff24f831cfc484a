'use strict';
// The extension's errors as classes (docs/errors.md, "Errors and HTTP"), with
// the Python package's names (docs/http.md, "Names in both packages").  Each
// carries the SQLSTATE (`sqlstate`, also `code`), the server's DETAIL
// (`detail`), the operation and key it was raised for, and the driver's
// error as `cause`.  Errors of other SQLSTATEs, and connection errors, are
// passed on as node-pg raised them.

class IdempotencyError extends Error {
	constructor(message, { sqlstate, detail = null, operation = null, key = null, cause } = {}) {
		super(message, cause === undefined ? undefined : { cause });
		this.name = new.target.name;
		this.sqlstate = sqlstate;
		this.code = sqlstate;
		this.detail = detail;
		this.operation = operation;
		this.key = key;
	}
}

// IK409: another attempt holds the key (in_flight 'raise', or this
// transaction holds it already); also a wait for it that statement_timeout
// ended (sqlstate 57014).
class InProgressError extends IdempotencyError {}

// IK422: the key was used for a request with another fingerprint.
// storedFingerprint / requestFingerprint: hex (no \x), null for NULL; one
// over 64 bytes, which the server cuts, is its first 64 bytes and "...".
class KeyReuseError extends IdempotencyError {
	constructor(message, options = {}) {
		super(message, options);
		const found = parseFingerprints(options.detail);
		this.storedFingerprint = found ? found.stored : null;
		this.requestFingerprint = found ? found.request : (options.requestFingerprint ?? null);
	}
}

// A wait for the attempt holding the key that the middleware's or begin()'s
// waitTimeout ended (the server cancelled it, SQLSTATE 57014): nothing
// changed.  An InProgressError: HTTP 409.
class WaitTimeoutError extends InProgressError {}

// IK412: the token no longer holds the key (finished, aborted or taken over).
class LostClaimError extends IdempotencyError {}

// IK410: the key was completed and is remembered, its response expired.
class ResponseExpiredError extends IdempotencyError {}

// 22023, 22004: the caller's input: an empty or over-long key or
// operation, a bad lease or ttl, a NULL.
class InvalidRequestError extends IdempotencyError {}

// 54000: the response is larger than idempotency.max_response_size.
class ResponseTooLargeError extends IdempotencyError {}

const CLASSES = {
	IK409: InProgressError,
	IK422: KeyReuseError,
	IK412: LostClaimError,
	IK410: ResponseExpiredError,
	22023: InvalidRequestError,
	22004: InvalidRequestError,
	54000: ResponseTooLargeError,
};

// A node-pg error the server sent (duck-typed, so that any copy of pg works).
function isServerError(err) {
	return err instanceof Error && typeof err.code === 'string' && /^[0-9A-Z]{5}$/.test(err.code) &&
		typeof err.severity === 'string';
}

// An error after which a connection cannot be used: anything the server did
// not send (socket closed, connection refused, timeout), or a FATAL one.
function brokeConnection(err) {
	return !isServerError(err) || err.severity === 'FATAL' || err.severity === 'PANIC';
}

// translate(err, {operation, key, requestFingerprint}): the class for the
// SQLSTATE, or err itself.
function translate(err, context = {}) {
	if (err instanceof IdempotencyError || !isServerError(err)) {
		return err;
	}
	const Class = CLASSES[err.code];
	if (!Class) {
		return err;
	}
	return new Class(err.message, {
		sqlstate: err.code, detail: err.detail ?? null, operation: context.operation ?? null,
		key: context.key ?? null, cause: err,
		requestFingerprint: context.requestFingerprint ? Buffer.from(context.requestFingerprint).toString('hex') : null,
	});
}

// The DETAIL of IK422 is "Stored fingerprint: F. Request fingerprint: F."
// where each F is NULL, \x and the hex of the bytes, or, over 64 bytes,
// \x, the hex of the first 64 and "... (N bytes)".  The two as bare hex,
// a cut one ending in "..." (as the Python package gives it), stored first;
// null when the DETAIL does not have that shape.
function parseFingerprints(detail) {
	const found = [...(detail ?? '').matchAll(/\\x([0-9a-f]*)(\.\.\.(?: \(\d+ bytes\))?)?|NULL/g)]
		.map((m) => (m[0] === 'NULL' ? null : m[2] ? `${m[1]}...` : m[1]));
	return found.length === 2 ? { stored: found[0], request: found[1] } : null;
}

// Could the database not be reached at all: no connection, a refused or
// lost one, a server shutting down?  Not a pool that is only busy (its
// connectionTimeoutMillis), not a refusal, not a statement's timeout.
const UNREACHABLE_ERRNOS = new Set(['ECONNREFUSED', 'ECONNRESET', 'ENOTFOUND', 'EHOSTUNREACH', 'ENETUNREACH',
	'EAI_AGAIN', 'ETIMEDOUT', 'EPIPE', 'ENOENT']);
function isUnreachable(err) {
	if (isServerError(err)) {
		return /^(08|57P0[123])/.test(err.code);
	}
	return err instanceof Error && (UNREACHABLE_ERRNOS.has(err.code) || /^Connection terminated/.test(err.message));
}

module.exports = {
	IdempotencyError, InProgressError, WaitTimeoutError, KeyReuseError, LostClaimError, ResponseExpiredError,
	InvalidRequestError, ResponseTooLargeError, translate, isServerError, isUnreachable, brokeConnection,
	parseFingerprints,
	// the names before 1.6
	FencedError: LostClaimError, ExpiredError: ResponseExpiredError, InputError: InvalidRequestError,
};
