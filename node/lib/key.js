'use strict';
// The Idempotency-Key request header, as the IETF draft defines it
// (draft-ietf-httpapi-idempotency-key-header): an RFC 8941 Structured Field
// Item whose value is a String, e.g.
//
//     Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"
//
// Many clients written for older APIs send the key unquoted; that is
// accepted too, as long as it is one run of visible ASCII characters with no
// quote, backslash, comma or semicolon (so it cannot be mistaken for a list
// or for parameters).  Keys are at most 255 characters (the extension's
// limit, docs/errors.md, "Errors and HTTP"): longer ones are a client error, reported
// before anything is claimed.

const MAX_KEY_LENGTH = 255;

// parseIdempotencyKey(headerValue) -> { ok: true, key } | { ok: false, missing, reason }
//
// headerValue is what Node gives for the header: undefined when absent; when
// a client sent the header twice Node joins the values with ", ", which
// parses as neither form and so is rejected as malformed.
function parseIdempotencyKey(headerValue) {
	if (headerValue === undefined || headerValue === null) {
		return { ok: false, missing: true, reason: 'The Idempotency-Key header is missing.' };
	}
	if (Array.isArray(headerValue)) {
		headerValue = headerValue.join(', ');
	}
	// RFC 8941 §4.2: parsers discard leading and trailing spaces
	const value = String(headerValue).replace(/^ +| +$/g, '');
	let key;
	if (value.startsWith('"')) {
		key = parseSfString(value);
		if (key === null) {
			return {
				ok: false,
				missing: false,
				reason: 'The Idempotency-Key header is not a valid Structured Field String ' +
					'(printable ASCII inside double quotes, \\" and \\\\ as the only escapes, nothing after the closing quote).',
			};
		}
	} else if (/^[!#-+\--:<-[\]-~]+$/.test(value)) {
		// bare key: %x21-7E without  " , ; \
		key = value;
	} else {
		return {
			ok: false,
			missing: value === '',
			reason: value === ''
				? 'The Idempotency-Key header is empty.'
				: 'The Idempotency-Key header must be a quoted string (Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324") ' +
					'or one run of visible ASCII without quote, backslash, comma or semicolon.',
		};
	}
	if (key.length === 0) {
		return { ok: false, missing: false, reason: 'The Idempotency-Key must not be empty.' };
	}
	if (key.length > MAX_KEY_LENGTH) {
		return {
			ok: false,
			missing: false,
			reason: `The Idempotency-Key has ${key.length} characters; at most ${MAX_KEY_LENGTH} are allowed.`,
		};
	}
	return { ok: true, key };
}

// RFC 8941 §4.2.5 (Parsing a String), requiring the whole input to be that
// one string: no parameters are defined for the header.
function parseSfString(input) {
	let out = '';
	for (let i = 1; i < input.length; i++) {
		const c = input[i];
		if (c === '\\') {
			const next = input[++i];
			if (next !== '"' && next !== '\\') {
				return null;
			}
			out += next;
		} else if (c === '"') {
			return i === input.length - 1 ? out : null;
		} else {
			const code = c.charCodeAt(0);
			if (code < 0x20 || code > 0x7e) {
				return null;
			}
			out += c;
		}
	}
	return null; // no closing quote
}

module.exports = { MAX_KEY_LENGTH, parseIdempotencyKey };
