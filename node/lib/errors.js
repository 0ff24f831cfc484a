'use strict';
// The extension's errors as classes (docs/errors.md, "Errors and HTTP").  Each
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
// storedFingerprint / requestFingerprint: hex (no \x), null for NULL.
class KeyReuseError extends IdempotencyError {
	constructor(message, options = {}) {
		super(message, options);
		const found = parseFingerprints(options.detail);
		this.storedFingerprint = found ? found.stored : null;
		this.requestFingerprint = found ? found.request : (options.requestFingerprint ?? null);
	}
}

// IK412: the token no longer holds the key (finished, aborted or taken over).
class FencedError extends IdempotencyError {}

// IK410: the key was completed and is remembered, its response expired.
class ExpiredError extends IdempotencyError {}

// 22023, 22004, 54000: the caller's input: an empty or over-long key or
// operation, a bad lease or ttl, a NULL, a response too large to store.
class InputError extends IdempotencyError {}
class ResponseTooLargeError extends InputError {}

const CLASSES = {
	IK409: InProgressError,
	IK422: KeyReuseError,
	IK412: FencedError,
	IK410: ExpiredError,
	22023: InputError,
	22004: InputError,
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

// The DETAIL of IK422 is "Stored fingerprint: \x....  Request fingerprint:
// \x...." (bytea in hex, the default bytea_output).  The two as bare hex,
// stored first; null when the DETAIL does not have that shape.
function parseFingerprints(detail) {
	const found = [...(detail ?? '').matchAll(/\\x([0-9a-f]*)|NULL/g)]
		.map((m) => (m[0] === 'NULL' ? null : m[1]));
	return found.length === 2 ? { stored: found[0], request: found[1] } : null;
}

module.exports = {
	IdempotencyError, InProgressError, KeyReuseError, FencedError, ExpiredError, InputError,
	ResponseTooLargeError, translate, isServerError, brokeConnection, parseFingerprints,
};
