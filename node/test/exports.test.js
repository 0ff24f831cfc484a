'use strict';
// The package from ESM: every CommonJS export is a named export too.

const assert = require('node:assert/strict');
const { test } = require('node:test');

test('import { ... } from "idempotency-pg" finds every export', async () => {
	const esm = await import('idempotency-pg');
	const cjs = require('idempotency-pg');
	assert.deepEqual(Object.keys(cjs).filter((k) => !(k in esm)), []);
	assert.equal(esm.IdempotencyClient, cjs.IdempotencyClient);
});
