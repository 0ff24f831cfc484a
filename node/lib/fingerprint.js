'use strict';
// idem_fingerprint(...) computed in JavaScript: the same 32 bytes as the
// server's (docs/api.md, "API reference").  The server hashes with SHA-256, for
// each argument, a tag byte -- 0 for NULL, 1 for a value -- and, for a value,
// the length in bytes of its text form as four bytes big-endian followed by
// the text form (UTF-8).  So ('a', 'bc') and ('ab', 'c') differ, and so do
// NULL and ''.
//
// The text form of a JavaScript value is the one PostgreSQL prints for the
// type it stands for; only values whose text form does not depend on session
// settings are accepted (README: pass timestamps and floats as text of a
// fixed format):
//
//   null, undefined        NULL
//   string                 itself                 (text)
//   boolean                't' / 'f'              (boolean)
//   integer number         its decimal digits     (bigint), a safe integer only
//   bigint                 its decimal digits     (bigint, numeric)
//
// Anything else (a fraction, NaN, a Date, an object) throws a TypeError.

const { createHash } = require('node:crypto');

function textForm(value) {
	if (value === null || value === undefined) {
		return null;
	}
	switch (typeof value) {
	case 'string':
		return value;
	case 'boolean':
		return value ? 't' : 'f';
	case 'bigint':
		return value.toString();
	case 'number':
		if (Number.isSafeInteger(value)) {
			return Object.is(value, -0) ? '0' : String(value);
		}
		throw new TypeError(`cannot fingerprint the number ${value}: only safe integers have one text form; ` +
			'pass it as a string of a fixed format (docs/api.md, "API reference")');
	default:
		throw new TypeError(`cannot fingerprint a ${value?.constructor?.name ?? typeof value}: its text form may ` +
			'depend on session settings; pass it as a string of a fixed format');
	}
}

// fingerprint(...values) -> Buffer (32 bytes)
function fingerprint(...values) {
	const hash = createHash('sha256');
	for (const value of values) {
		const text = textForm(value);
		if (text === null) {
			hash.update(Buffer.from([0]));
		} else {
			const bytes = Buffer.from(text, 'utf8');
			const header = Buffer.alloc(5);
			header[0] = 1;
			header.writeUInt32BE(bytes.length, 1);
			hash.update(header);
			hash.update(bytes);
		}
	}
	return hash.digest();
}

module.exports = { fingerprint, textForm };
