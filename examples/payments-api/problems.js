// Error responses of the API's own: RFC 9457 problem details
// (application/problem+json), and the documentation of every problem type the
// API answers, including those the idempotency-pg middleware sends for the
// extension's SQLSTATEs (docs/errors.md, "Errors and HTTP"; node/README.md).
//
// The titles of the three Idempotency-Key problems are the ones the IETF
// draft (draft-ietf-httpapi-idempotency-key-header, section 2.7) uses.  Each
// problem type is a relative URI that this API serves as plain text, so a
// client (or a person) can look it up.

import { ProviderError, ProviderTimeoutError } from './provider.js';

export const PROBLEM_TYPES = {
	'idempotency-key-missing': {
		title: 'Idempotency-Key is missing',
		doc: 'POST /charges and POST /orders require an Idempotency-Key header: a unique string of 1 to 255 ' +
			'printable ASCII characters, sent as a quoted string, e.g. Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324". ' +
			'Send the same key when you retry the same request.',
	},
	'idempotency-key-malformed': {
		title: 'Idempotency-Key is malformed',
		doc: 'The Idempotency-Key header must be one quoted string (RFC 8941 String) of 1 to 255 printable ASCII characters, ' +
			'or the same characters unquoted without spaces, quotes, backslashes, commas or semicolons.',
	},
	'idempotency-key-reused': {
		title: 'Idempotency-Key is already used',
		doc: 'This operation is idempotent and it requires correct usage of Idempotency Key. ' +
			'Idempotency Key MUST not be reused across different payloads of this operation. ' +
			'The request fingerprint covers customer, amount and currency.',
	},
	'request-in-progress': {
		title: 'A request is outstanding for this Idempotency-Key',
		doc: 'A request with the same Idempotency-Key for the same operation is being processed or is outstanding. ' +
			'Retry later with the same key to get its response.',
	},
	'idempotency-key-expired': {
		title: 'The response for this Idempotency-Key has expired',
		doc: 'The request with this Idempotency-Key was completed, and its stored response is no longer kept. ' +
			'Do not retry it; a new request needs a new key.',
	},
	'response-not-stored': {
		title: 'The response for this Idempotency-Key was not stored',
		doc: 'The request with this Idempotency-Key was processed, but its response could not be stored ' +
			'(docs/http.md). Answered 410 to every retry: do not retry it; a new request needs a new key. ' +
			'Answered 500 to an attempt that lost its claim to another: retry with the same key to get that one\'s response.',
	},
	'invalid-request': {
		title: 'Invalid request',
		doc: 'POST /charges takes a JSON object {"customer": string, "amount": positive integer in minor units, "currency": ISO 4217 code}.',
	},
	'provider-unavailable': {
		title: 'Payment provider unavailable',
		doc: 'The payment provider refused or failed the charge. Nothing was stored for the Idempotency-Key: ' +
			'retry with the same key.',
	},
	'provider-timeout': {
		title: 'Payment provider timed out',
		doc: 'The payment provider did not answer in time: the charge may or may not have been made. ' +
			'Nothing was stored for the Idempotency-Key: retry with the same key. The key is passed on to the ' +
			'provider, which deduplicates by it, so the retry does not charge twice.',
	},
	'not-found': {
		title: 'Not found',
		doc: 'No such resource.',
	},
	'internal-error': {
		title: 'Internal error',
		doc: 'The server could not complete the request.',
	},
	'service-unavailable': {
		title: 'Service unavailable',
		doc: 'The server cannot handle the request right now; retry it with the same Idempotency-Key.',
	},
};

export class Problem extends Error {
	// status: HTTP status; type: a key of PROBLEM_TYPES; detail: a sentence for
	// this occurrence; extra: extension members; headers: response headers
	constructor(status, type, detail, { extra = {}, headers = {} } = {}) {
		super(detail);
		this.status = status;
		this.type = type;
		this.detail = detail;
		this.extra = extra;
		this.headers = headers;
	}

	body() {
		return {
			type: `/problems/${this.type}`,
			title: PROBLEM_TYPES[this.type].title,
			status: this.status,
			detail: this.detail,
			...this.extra,
		};
	}
}

export function sendProblem(res, problem) {
	for (const [name, value] of Object.entries(problem.headers)) {
		res.set(name, value);
	}
	res.status(problem.status)
		.type('application/problem+json')
		.send(JSON.stringify(problem.body()));
}

// A failed provider call: 504 when it timed out (whether it charged is not
// known), 502 otherwise.  Either way the claim was released: a retry with
// the same key calls the provider again, passing the same key.
export function providerProblem(err, log) {
	if (err instanceof ProviderTimeoutError) {
		return new Problem(504, 'provider-timeout',
			'The payment provider did not answer in time; the charge may or may not have been made. ' +
			'Retry with the same Idempotency-Key: the provider deduplicates by it.');
	}
	if (!(err instanceof ProviderError)) {
		log.error('provider call failed:', err);
	}
	return new Problem(502, 'provider-unavailable',
		'The payment provider did not confirm the charge. Retry with the same Idempotency-Key.');
}
