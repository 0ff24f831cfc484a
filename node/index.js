'use strict';
// idempotency-pg: the idempotency extension for node-pg, and an express
// middleware for the Idempotency-Key header.  See README.md.

const { IdempotencyClient, Claim, beginStatement, finishStatement, statements } = require('./lib/client');
const {
	IdempotencyError, InProgressError, KeyReuseError, FencedError, ExpiredError, InputError, ResponseTooLargeError,
	translate,
} = require('./lib/errors');
const { fingerprint, textForm } = require('./lib/fingerprint');
const { MAX_KEY_LENGTH, parseIdempotencyKey } = require('./lib/key');
const mw = require('./lib/middleware');

IdempotencyClient.prototype.middleware = function middleware(options) {
	return mw.middleware(this, options);
};
IdempotencyClient.prototype.sendError = function sendError(res, err, context) {
	return mw.sendError(this, res, err, context);
};

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
	translateError: translate,
	fingerprint,
	textForm,
	MAX_KEY_LENGTH,
	parseIdempotencyKey,
	idempotencyKey: mw.idempotencyKey,
	middleware: mw.middleware,
	sendStored: mw.sendStored,
	sendProblem: mw.sendProblem,
	problemFor: mw.problemFor,
	beginStatement,
	finishStatement,
	statements,
};
