'use strict';
// index.d.ts against test/types/options.ts, which uses every documented
// option and export: tsc --strict (TypeScript from the dev dependencies).

const assert = require('node:assert/strict');
const { execFile } = require('node:child_process');
const path = require('node:path');
const { test } = require('node:test');

test('index.d.ts passes tsc --strict for every documented option', async () => {
	const tsc = path.join(__dirname, '..', 'node_modules', 'typescript', 'bin', 'tsc');
	const result = await new Promise((resolve) => {
		execFile(process.execPath, [tsc, '-p', path.join(__dirname, 'types')], (err, stdout, stderr) => {
			resolve({ code: err ? err.code : 0, output: stdout + stderr });
		});
	});
	assert.equal(result.code, 0, result.output);
});
