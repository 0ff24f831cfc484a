'use strict';
// idempotency-pg: the idempotency extension for node-pg, and an express
// middleware for the Idempotency-Key header.  See README.md.

const { IdempotencyClient, Claim, beginStatement, finishStatement, statements } = require('./lib/client');
const {
	IdempotencyError, InProgressError, KeyReuseError, FencedError, ExpiredError, InputError, ResponseTooLargeError,
	translate: translateError,
} = require('./lib/errors');
const { fingerprint, textForm } = require('./lib/fingerprint');
const { MAX_KEY_LENGTH, parseIdempotencyKey } = require('./lib/key');
const mw = require('./lib/middleware');

const { idempotencyKey, middleware, sendStored, sendProblem, problemFor } = mw;

IdempotencyClient.prototype.middleware = function middleware(options) {
	return mw.middleware(this, options);
};
IdempotencyClient.prototype.sendError = function sendError(res, err, context) {
	return mw.sendError(this, res, err, context);
};

// Each export by name (shorthand), so that ESM's `import { ... } from
// 'idempotency-pg'` finds them all.
module.exports = {
	IdempotencyClient,
	Claim,
	IdempotencyError,
	InProgressError,
	KeyReuseError,
	FencedError,
	ExpiredError,
	InputError,
	ResponseTooLargeError,
	translateError,
	fingerprint,
	textForm,
	MAX_KEY_LENGTH,
	parseIdempotencyKey,
	idempotencyKey,
	middleware,
	sendStored,
	sendProblem,
	problemFor,
	beginStatement,
	finishStatement,
	statements,
};
