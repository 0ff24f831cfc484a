'use strict';
// The small express app of the HTTP conformance cases (test/http/cases.json,
// "app"): the same routes and handler as the Python package's app, so that
// both packages answer the same cases the same way (docs/http.md).

const net = require('node:net');

const express = require('express');
const pg = require('pg');

const { IdempotencyClient } = require('..');

// a port nothing listens on: one the system gave us, closed again
async function closedPort() {
	const server = net.createServer();
	await new Promise((resolve) => server.listen(0, '127.0.0.1', resolve));
	const { port } = server.address();
	await new Promise((resolve) => server.close(resolve));
	return port;
}

const quiet = process.env.CONFORMANCE_LOG ? { debug() {}, error: console.error } : { debug() {}, error() {} };

// createApp(s): s is test/db.js's scratch database (the schema made)
async function createApp(s) {
	const claims = s.pool({ max: 20, application_name: 'conformance-claims' });
	const handlers = s.pool({ max: 20, application_name: 'conformance-handlers' });
	const down = new pg.Pool({ host: '127.0.0.1', port: await closedPort(), database: s.name, connectionTimeoutMillis: 5000 });
	down.on('error', () => {});
	const idem = new IdempotencyClient(claims, { log: quiet });
	const unreachable = new IdempotencyClient(down, { log: quiet });

	async function charge(req, res) {
		const key = req.idempotency?.key ?? req.idempotencyKey ?? '';
		const b = req.body;
		if (Number.isInteger(b.hold)) {
			await handlers.query('SELECT pg_advisory_xact_lock_shared(4242, $1)', [b.hold]);
		}
		await handlers.query(`INSERT INTO conformance_runs VALUES ($1, 'handler')`, [key]);
		if (Number.isInteger(b.hold_after)) {
			// only a pause after the effect: a restart ends the wait, and the
			// handler goes on once the server answers again
			const waited = await handlers.query('SELECT pg_advisory_xact_lock_shared(4242, $1)', [b.hold_after]).then(() => true, () => false);
			while (!waited && !await handlers.query('SELECT 1').then(() => true, () => false)) {
				await new Promise((resolve) => setTimeout(resolve, 50));
			}
		}
		let status = 201;
		let body;
		if (b.answer === undefined) {
			res.set('Location', `/charges/${key}`).set('ETag', '"v1"');
			body = { zeta: 'last', id: `ch_${key}`, amount: b.amount, alpha: 'first' };
		} else if (typeof b.answer === 'number') {
			status = b.answer;
			body = { error: 'answer', status: b.answer };
		} else if (b.answer === 'throw') {
			throw new Error('the handler failed');
		} else if (b.answer === 'large') {
			body = { id: `ch_${key}`, padding: 'x'.repeat(70000) };
		} else if (b.answer === 'empty') {
			res.status(204).end();
			return;
		}
		const text = JSON.stringify(body);
		if (b.style === 'writeHead') {
			res.writeHead(status, { 'Content-Type': 'application/json; charset=utf-8' });
			res.end(text);
		} else if (b.style === 'write') {
			res.status(status).type('json');
			res.write(text.slice(0, 10));
			res.end(Buffer.from(text.slice(10)));
		} else {
			res.status(status).json(body);
		}
	}

	async function recover(req, res) {
		await handlers.query(`INSERT INTO conformance_runs VALUES ($1, 'recover')`, [req.idempotency.key]);
		res.status(200).json({ recovered: req.idempotency.recovered });
	}

	const fingerprint = ['body.customer', 'body.amount'];
	const app = express();
	app.disable('etag');
	app.disable('x-powered-by');
	app.use(express.json());
	app.post('/charges', idem.middleware({ operation: 'conformance.charge', fingerprint, takeover: 'session' }), charge);
	app.post('/charges-raise', idem.middleware({
		operation: 'conformance.charge-raise', fingerprint, inFlight: 'raise', lease: '60 s', takeover: 'session',
	}), charge);
	app.post('/charges-wait', idem.middleware({
		operation: 'conformance.charge-wait', fingerprint, waitTimeout: '1 s', takeover: 'session',
	}), charge);
	app.post('/charges-checkpointed', idem.middleware({
		operation: 'conformance.charge-checkpointed', fingerprint, takeover: 'session',
		checkpoint: (req) => ({ customer: req.body.customer }), recover,
	}), charge);
	app.post('/charges-optional', idem.middleware({ operation: 'conformance.charge', fingerprint, required: false }), charge);
	app.post('/unreachable', unreachable.middleware({ operation: 'conformance.unreachable', fingerprint }), charge);
	app.post('/unreachable-run', unreachable.middleware({
		operation: 'conformance.unreachable', fingerprint, onStoreError: 'run',
	}), charge);
	// eslint-disable-next-line no-unused-vars
	app.use((err, req, res, next) => {
		res.status(500).json({ error: err.message });
	});
	// connect before the first request (cases.json, "app", "start")
	await Promise.all([claims.query('SELECT 1'), handlers.query('SELECT 1')]);
	return { app, close: () => down.end().catch(() => {}) };
}

module.exports = { createApp };

// Run as a process of its own (the runner's 'process_cases': node
// conformance-app.js --listen): serve the app on 127.0.0.1 for the database
// PGDATABASE of the server the libpq environment names; print the port once
// the app listens.  Without --listen, as `node --test test/` runs every file
// of the directory, it only loads.
if (require.main === module && process.argv.includes('--listen')) {
	(async () => {
		const pools = [];
		const s = {
			name: process.env.PGDATABASE,
			pool(options) {
				const p = new pg.Pool({ database: process.env.PGDATABASE, ...options });
				p.on('error', () => {});
				pools.push(p);
				return p;
			},
		};
		const { app } = await createApp(s);
		const server = app.listen(0, '127.0.0.1', () => {
			process.stdout.write(`${server.address().port}\n`);
		});
		process.on('SIGTERM', () => process.exit(0));
	})().catch((err) => {
		console.error(err);
		process.exit(1);
	});
}
