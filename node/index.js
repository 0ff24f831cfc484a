'use strict';
// idempotency-pg: the idempotency extension for node-pg, and an express
// middleware for the Idempotency-Key header.  See README.md; the HTTP
// answers are docs/http.md's.

const { IdempotencyClient, Claim, beginStatement, finishStatement, statements } = require('./lib/client');
const {
	IdempotencyError, InProgressError, WaitTimeoutError, KeyReuseError, LostClaimError, ResponseExpiredError,
	InvalidRequestError, ResponseTooLargeError, FencedError, ExpiredError, InputError, translate: translateError,
} = require('./lib/errors');
const { fingerprint, textForm } = require('./lib/fingerprint');
const { MAX_KEY_LENGTH, parseIdempotencyKey } = require('./lib/key');
const {
	IdempotentRoute, idempotencyKey, middleware, sendStored, sendProblem, problemFor, PROBLEM_TYPE_BASE,
} = require('./lib/middleware');

// Each export by name (shorthand), so that ESM's `import { ... } from
// 'idempotency-pg'` finds them all.
module.exports = {
	IdempotencyClient,
	Claim,
	IdempotentRoute,
	IdempotencyError,
	InProgressError,
	WaitTimeoutError,
	KeyReuseError,
	LostClaimError,
	ResponseExpiredError,
	InvalidRequestError,
	ResponseTooLargeError,
	// the names before 1.6, the same classes
	FencedError,
	ExpiredError,
	InputError,
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
	PROBLEM_TYPE_BASE,
	beginStatement,
	finishStatement,
	statements,
};
