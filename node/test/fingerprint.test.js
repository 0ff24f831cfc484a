'use strict';
// fingerprint(...) against the server's idem_fingerprint, byte for byte.

const assert = require('node:assert/strict');
const { after, before, test } = require('node:test');

const { fingerprint, textForm } = require('..');
const { scratchDatabase } = require('./db');

let s;
let portable;
before(async () => {
	s = await scratchDatabase('fp');
	portable = (await s.db.query("SELECT to_regprocedure('idem_portable_version()') IS NOT NULL AS p")).rows[0].p;
});
after(async () => { await s?.drop(); });

// the SQL type each JavaScript value stands for
function sqlType(v) {
	if (v === null || v === undefined) {
		return 'text';
	}
	switch (typeof v) {
	case 'string': return 'text';
	case 'boolean': return 'boolean';
	case 'bigint': return 'numeric';
	default: return 'bigint';
	}
}

// The portable edition takes one or two arguments of any types, or text
// ones (docs/managed-postgresql.md, "idem_fingerprint"): more that are not
// all text do not resolve (42883), and a caller passes their text forms.
async function server(values) {
	const sql = (types) => `SELECT encode(idem_fingerprint(${types.map((t, i) => `$${i + 1}::${t}`).join(', ')}), 'hex') AS fp`;
	const types = values.map(sqlType);
	const params = values.map((v) => (v === undefined ? null : typeof v === 'bigint' ? v.toString() : v));
	if (portable && types.length > 2 && types.some((t) => t !== 'text')) {
		await assert.rejects(s.db.query(sql(types), params), { code: '42883' });
		const { rows } = await s.db.query(sql(types.map(() => 'text')), values.map(textForm));
		return rows[0].fp;
	}
	const { rows } = await s.db.query(sql(types), params);
	return rows[0].fp;
}

const CASES = [
	['one text', ['order-7']],
	['text and bigint', ['order-7', 4200]],
	['the README example', ['cus_1', 4200, 'EUR']],
	['("a", "bc") is not ("ab", "c") (1)', ['a', 'bc']],
	['("a", "bc") is not ("ab", "c") (2)', ['ab', 'c']],
	['NULL and the empty string (1)', [null]],
	['NULL and the empty string (2)', ['']],
	['undefined is NULL', [undefined, 'x']],
	['booleans', [true, false, 'x']],
	['negative, zero, -0 and large integers', [-42, 0, -0, Number.MAX_SAFE_INTEGER, Number.MIN_SAFE_INTEGER]],
	['BigInts beyond 2^63', [2n ** 70n, -(2n ** 64n), 0n]],
	['non-ASCII text (UTF-8 lengths)', ['Zürich', '東京', '🙂 emoji', 'ñ']],
	['a 300-character and a 70,000-character text', ['k'.repeat(300), 'x'.repeat(70000)]],
	['quotes, backslashes, newlines', ['a"b', 'c\\d', 'line\nbreak', '\t']],
];

for (const [what, values] of CASES) {
	test(`fingerprint equals idem_fingerprint: ${what}`, async () => {
		const local = fingerprint(...values).toString('hex');
		assert.equal(local, await server(values));
		assert.equal(fingerprint(...values).length, 32);
	});
}

test('idem_fingerprint(VARIADIC text[]) with NULLs equals fingerprint of the same list', async () => {
	const values = ['a', null, 'b', ''];
	const { rows } = await s.db.query(`SELECT encode(idem_fingerprint(VARIADIC $1::text[]), 'hex') AS fp`, [values]);
	assert.equal(fingerprint(...values).toString('hex'), rows[0].fp);
});

test('ambiguous values are refused: fractions, NaN, unsafe integers, dates, objects', () => {
	for (const v of [1.5, NaN, Infinity, 2 ** 60, new Date(0), { a: 1 }, [1], Symbol('s')]) {
		assert.throws(() => fingerprint(v), TypeError, String(v?.toString?.() ?? typeof v));
	}
	assert.equal(textForm(-0), '0');
	assert.equal(textForm(true), 't');
	assert.equal(textForm(null), null);
});
