'use strict';
// What the middleware holds back, stores and replays of the responses a
// handler sends: headers given to writeHead as arrays, a header sent more
// than once, a response without a Content-Type, one a compression after
// the middleware encoded, one that changes its head after a write, and a
// handler that fails after (or while) it answers, with express's own error
// handler; a HEAD, which passes without idempotency.  Real HTTP on 127.0.0.1 (raw header lines) and a real server.

const assert = require('node:assert/strict');
const http = require('node:http');
const zlib = require('node:zlib');
const { after, before, test } = require('node:test');
const { randomUUID } = require('node:crypto');

const express = require('express');

const { IdempotencyClient } = require('..');
const { scratchDatabase } = require('./db');

let s;
let server;
let idem;
const runs = new Map();	// key -> how many times a handler ran
const newKey = (label) => `${label}-${randomUUID()}`;

const ROUTES = {
	// writeHead with a flat array naming Set-Cookie twice, and with pairs
	flat: (req, res) => {
		res.writeHead(201, ['Set-Cookie', 'a=1', 'Set-Cookie', 'b=2', 'Content-Type', 'text/plain']);
		res.end('flat');
	},
	pairs: (req, res) => {
		res.writeHead(201, [['Content-Type', 'text/plain'], ['Location', '/c/1'], ['Set-Cookie', 'a=1'], ['Set-Cookie', 'b=2']]);
		res.end('pairs');
	},
	// cookies whose values hold ", " (Expires), and one Link
	cookies: (req, res) => {
		res.cookie('a', '1', { expires: new Date(0) }).cookie('b', '2').set('Link', '</next>; rel="next"');
		res.status(201).send('cookies');
	},
	// no Content-Type: writeHead + end, write + end
	untyped: (req, res) => {
		res.writeHead(201);
		res.end('untyped');
	},
	written: (req, res) => {
		res.statusCode = 201;
		res.write('writ');
		res.end('ten');
	},
	// as a compression placed after the middleware sends it
	gzip: (req, res) => {
		res.set('Content-Encoding', 'gzip').set('Vary', 'Accept-Encoding').type('text').status(201).send(zlib.gzipSync('compressed'));
	},
	// the handler answers, then fails: express 5 hands the error to its
	// error handler, while the middleware stores the answer
	'json-then-throw': async (req, res) => {
		res.status(201).json({ id: 'ch_1' });
		throw new Error('audit log failed');
	},
	'end-then-next': (req, res, next) => {
		res.status(201).type('text');
		res.write('ans');
		res.end('wered');
		next(new Error('audit log failed'));
	},
	// the status changed after a write: Node sends the first head, 200
	'write-then-status': (req, res) => {
		res.write('part1-');
		res.statusCode = 201;
		res.end('part2');
	},
	// fails midway: a partial body, then express's error page
	'write-then-throw': (req, res) => {
		res.type('text');
		res.write('partial-');
		throw new Error('the handler failed');
	},
	// an error with a 4xx status, answered by express's error handler
	declined: () => {
		throw Object.assign(new Error('card declined'), { status: 402, expose: true });
	},
};

before(async () => {
	s = await scratchDatabase('responses');
	idem = new IdempotencyClient(s.pool(), { log: { debug() {}, error() {} } });
	const app = express();
	app.set('env', 'test');	// express's error handler does not log
	for (const [name, handler] of Object.entries(ROUTES)) {
		app.post(`/${name}`, idem.middleware({ operation: `responses.${name}`, replayHeaders: ['Location', 'Set-Cookie', 'Link'] }),
			(req, res, next) => {
				runs.set(req.idempotency.key, (runs.get(req.idempotency.key) ?? 0) + 1);
				return handler(req, res, next);
			});
	}
	// express serves a HEAD through it too
	app.get('/resource', idem.middleware({ operation: 'responses.resource' }), (req, res) => {
		const key = req.get('Idempotency-Key');
		runs.set(key, (runs.get(key) ?? 0) + 1);
		res.type('text').send('resource body');
	});
	await new Promise((resolve) => { server = app.listen(0, '127.0.0.1', resolve); });
});

after(async () => {
	await new Promise((resolve) => server?.close(resolve) ?? resolve());
	await s?.drop();
});

// A request (POST unless `method` says) to the route with the key ->
// { status, lines (the header lines, [name lower case, value]),
// header(name) (the values), body (bytes) }; rejects on a malformed message
function post(route, key, method = 'POST') {
	return new Promise((resolve, reject) => {
		const req = http.request({
			host: '127.0.0.1', port: server.address().port, method, path: `/${route}`, agent: false,
			headers: { 'Idempotency-Key': key, ...(method === 'POST' ? { 'Content-Length': 0 } : {}) },
		}, (res) => {
			const chunks = [];
			res.on('data', (chunk) => chunks.push(chunk));
			res.on('error', reject);
			res.on('end', () => {
				const lines = [];
				for (let i = 0; i < res.rawHeaders.length; i += 2) {
					lines.push([res.rawHeaders[i].toLowerCase(), res.rawHeaders[i + 1]]);
				}
				const header = (name) => lines.filter(([n]) => n === name).map(([, v]) => v);
				resolve({ status: res.statusCode, lines, header, body: Buffer.concat(chunks) });
			});
		});
		req.on('error', reject);
		req.end();
	});
}

// the first answer and the replay of route with a new key
async function twice(route) {
	const key = newKey(route);
	const first = await post(route, key);
	const replay = await post(route, key);
	return { key, first, replay };
}

async function storedHeaders(route, key) {
	const { rows } = await s.db.query('SELECT response FROM idem_inspect($1, $2)', [`responses.${route}`, key]);
	return rows[0].response.headers;
}

test('writeHead with a flat array naming a header twice keeps both values, as Node does; an array of pairs works', async () => {
	for (const route of ['flat', 'pairs']) {
		const { first, replay } = await twice(route);
		for (const r of [first, replay]) {
			assert.equal(r.status, 201, route);
			assert.deepEqual(r.header('set-cookie'), ['a=1', 'b=2'], route);
			assert.deepEqual(r.header('content-type'), ['text/plain'], route);
			assert.equal(r.body.toString(), route);
		}
		assert.deepEqual(replay.header('idempotent-replayed'), ['true']);
	}
	assert.deepEqual((await twice('pairs')).replay.header('location'), ['/c/1']);
});

test('a header sent more than once is stored as an array of its values and replayed as a line each', async () => {
	const { key, first, replay } = await twice('cookies');
	const cookies = ['a=1; Path=/; Expires=Thu, 01 Jan 1970 00:00:00 GMT', 'b=2; Path=/'];
	assert.deepEqual(first.header('set-cookie'), cookies);
	assert.deepEqual(replay.header('set-cookie'), cookies);
	assert.deepEqual(replay.header('link'), ['</next>; rel="next"']);
	const stored = await storedHeaders('cookies', key);
	assert.deepEqual(stored['set-cookie'], cookies);
	assert.equal(stored.link, '</next>; rel="next"', 'a header sent once stays a string');
});

test('a response without a Content-Type is replayed without one', async () => {
	for (const route of ['untyped', 'written']) {
		const { first, replay } = await twice(route);
		for (const r of [first, replay]) {
			assert.equal(r.status, 201, route);
			assert.deepEqual(r.header('content-type'), [], route);
			assert.equal(r.body.toString(), route);
		}
	}
});

test('Content-Encoding and Vary are stored always: a body a compression after the middleware encoded is replayed decodable', async () => {
	const { first, replay } = await twice('gzip');
	for (const r of [first, replay]) {
		assert.deepEqual(r.header('content-encoding'), ['gzip']);
		assert.deepEqual(r.header('vary'), ['Accept-Encoding']);
		assert.equal(zlib.gunzipSync(r.body).toString(), 'compressed');
	}
});

test('a handler that fails after its answer: the answer is sent as it was ended, stored, replayed; one run', async () => {
	for (const [route, type, text] of [['json-then-throw', 'application/json; charset=utf-8', '{"id":"ch_1"}'],
		['end-then-next', 'text/plain; charset=utf-8', 'answered']]) {
		const { key, first, replay } = await twice(route);
		for (const r of [first, replay]) {
			assert.equal(r.status, 201, route);
			assert.deepEqual(r.header('content-type'), [type], route);
			assert.deepEqual(r.header('content-length'), [String(Buffer.byteLength(text))], route);
			assert.equal(r.body.toString(), text, route);
		}
		assert.deepEqual(first.header('content-security-policy'), [], 'nothing of the error page');
		assert.deepEqual(replay.header('idempotent-replayed'), ['true']);
		assert.equal(runs.get(key), 1);
	}
});

test('a head changed after a write: the first head and the whole body, as Node sends them, stored and replayed', async () => {
	const { key, first, replay } = await twice('write-then-status');
	for (const r of [first, replay]) {
		assert.equal(r.status, 200);
		assert.deepEqual(r.header('content-length'), ['11']);
		assert.equal(r.body.toString(), 'part1-part2');
	}
	assert.deepEqual(replay.header('idempotent-replayed'), ['true']);
	const { rows } = await s.db.query('SELECT response FROM idem_inspect($1, $2)', ['responses.write-then-status', key]);
	assert.equal(rows[0].response.status, 200);
	assert.equal(rows[0].response.text, 'part1-part2');
	assert.equal(runs.get(key), 1);
});

test('a handler that fails after a partial write: express\'s error page alone, well formed, not stored', async () => {
	const { key, first, replay } = await twice('write-then-throw');
	for (const r of [first, replay]) {
		assert.equal(r.status, 500);
		assert.deepEqual(r.header('content-type'), ['text/html; charset=utf-8']);
		assert.deepEqual(r.header('content-length'), [String(r.body.length)]);
		assert.match(r.body.toString(), /^<!DOCTYPE html>/, 'the partial body is not sent');
	}
	assert.deepEqual(replay.header('idempotent-replayed'), [], 'errors are not cached');
	assert.equal(runs.get(key), 2);
});

test('an error with a 4xx status answered by express\'s error handler is stored and replayed, as a 4xx the handler sends', async () => {
	const { key, first, replay } = await twice('declined');
	assert.equal(first.status, 402);
	assert.equal(replay.status, 402);
	assert.deepEqual(replay.header('idempotent-replayed'), ['true']);
	assert.equal(replay.body.toString(), first.body.toString());
	assert.match(first.body.toString(), /card declined/);
	assert.equal(runs.get(key), 1);
});

test('a HEAD with a key passes without idempotency: the handler\'s Content-Length, nothing claimed; a GET then runs as new', async () => {
	const key = newKey('head');
	const head = await post('resource', key, 'HEAD');
	assert.equal(head.status, 200);
	assert.deepEqual(head.header('content-length'), [String(Buffer.byteLength('resource body'))]);
	assert.equal(head.body.length, 0);
	const { rows } = await s.db.query('SELECT state FROM idem_inspect($1, $2)', ['responses.resource', key]);
	assert.deepEqual(rows, [], 'nothing claimed');
	const get = await post('resource', key, 'GET');
	assert.equal(get.status, 200);
	assert.equal(get.body.toString(), 'resource body');
	assert.deepEqual(get.header('idempotent-replayed'), []);
	assert.equal(runs.get(key), 2);
	const replay = await post('resource', key, 'GET');
	assert.equal(replay.body.toString(), 'resource body');
	assert.deepEqual(replay.header('idempotent-replayed'), ['true']);
	assert.equal(runs.get(key), 2);
});
