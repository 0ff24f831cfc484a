// One contender of `test/run bench http`: the payments service, over HTTP,
// with one way of handling the Idempotency-Key (or none).
//
//   CONTENDER=base       no idempotency: every request charges
//   CONTENDER=ext        examples/payments-api's app itself (this extension)
//   CONTENDER=expidem    express-idempotency + express-idempotency-redis-adapter
//   CONTENDER=nodeidem   @node-idempotency/core + its redis storage adapter
//
// Every contender serves the same two routes with the same validation,
// provider and SQL, and records each charge (order) in PostgreSQL:
//   POST /charges   external call: the provider, then INSERT INTO charges
//   POST /orders    in-transaction: the effect is the order row
// The extension's service is the example's; for the others the bench wires
// the library in the way its README shows (express-idempotency: its
// middleware, isHit() and reportError(); @node-idempotency/core has no
// express integration: onRequest()/onResponse() around the handler, storing
// what the handler answered as its NestJS interceptor does, errors included).
//
// Environment: PORT, HOST (127.0.0.1), PG* (the database), REDIS_SOCKET (the
// Redis libraries), LEASE, CHECKPOINT and RECOVERY (ext: as in the example's
// server.js), EXAMPLE_DIR (ext: the example's app from that directory, with
// the Node package of its tree: another revision's), POOL_SIZE (10), PROVIDER=memory|ledger:
// memory: a provider that answers at once and keeps nothing (throughput: a
// real provider's work is not done on this machine); ledger: the example's
// provider (provider_charges table, deduplicates by key, PROVIDER_DELAY_MS,
// PROVIDER_FLAKY_CUSTOMERS), which the correctness cases count.

import { randomUUID } from 'node:crypto';
import { pathToFileURL } from 'node:url';

import express from 'express';
import pg from 'pg';

import { createApp, hasRecovery, validateCharge } from '../../../examples/payments-api/app.js';
import { createProvider } from '../../../examples/payments-api/provider.js';

const env = process.env;
const contender = env.CONTENDER ?? 'base';
// idleTimeoutMillis 0: connections stay open between slices (the same for
// every contender), so their backends' CPU is counted where it is spent
const max = Number(env.POOL_SIZE ?? 10);
const poolOptions = { max, idleTimeoutMillis: 0 };
const pool = new pg.Pool({ ...poolOptions, application_name: `httpbench ${contender}` });
pool.on('error', (err) => console.error('idle connection error:', err.message));

const provider = env.PROVIDER === 'ledger'
	? createProvider({
		pool: new pg.Pool({ ...poolOptions, application_name: 'httpbench provider' }),
		delayMs: Number(env.PROVIDER_DELAY_MS ?? 300),
		flakyCustomers: (env.PROVIDER_FLAKY_CUSTOMERS ?? '').split(',').filter(Boolean),
	})
	: memoryProvider();

// A provider on another machine: its id and timestamp, nothing else here.
function memoryProvider() {
	const prefix = `ch_${randomUUID().slice(0, 8)}_`;
	let n = 0;
	return {
		find: async () => null,
		charge: async () => ({ id: `${prefix}${++n}`, created: new Date().toISOString() }),
	};
}

// The statements every contender but ext runs (ext: the example's own).
const INSERT_CHARGE = {
	name: 'bench_insert_charge',
	text: `INSERT INTO charges (id, idempotency_key, customer, amount, currency, created_at)
	       VALUES ($1, $2, $3, $4, $5, $6)`,
};
const INSERT_ORDER = {
	name: 'bench_insert_order',
	text: `INSERT INTO orders (idempotency_key, customer, amount, currency)
	       VALUES ($1, $2, $3, $4) RETURNING id, created_at`,
};

// The handlers of base, expidem and nodeidem: validate, act, record, answer
// 201 (or 400 / 502).  `key` is the header as sent.
async function charge(req, res) {
	const c = validateCharge(req.body);
	if (c.error) {
		return res.status(400).json({ error: c.error });
	}
	let result;
	try {
		result = await provider.charge({ idempotencyKey: req.get('Idempotency-Key'), ...c });
	} catch (err) {
		await req.onActionFailed?.();
		return res.status(502).json({ error: err.message });
	}
	await pool.query({
		...INSERT_CHARGE,
		values: [result.id, req.get('Idempotency-Key') ?? '', c.customer, c.amount, c.currency, result.created],
	});
	res.status(201).set('location', `/charges/${result.id}`)
		.json({ id: result.id, object: 'charge', ...c, created: result.created });
}

async function order(req, res) {
	const c = validateCharge(req.body);
	if (c.error) {
		return res.status(400).json({ error: c.error });
	}
	const { rows } = await pool.query({
		...INSERT_ORDER, values: [req.get('Idempotency-Key') ?? '', c.customer, c.amount, c.currency],
	});
	const id = `ord_${rows[0].id}`;
	res.status(201).set('location', `/orders/${id}`)
		.json({ id, object: 'order', ...c, created: rows[0].created_at });
}

// A failed statement (the baseline recording a charge that the provider,
// deduplicating by key, returned twice) is a 500, not a stack trace.
// eslint-disable-next-line no-unused-vars
function onError(err, req, res, next) {
	res.status(res.statusCode >= 400 ? res.statusCode : 500).json({ error: err.message });
}

// express as the example configures it (app.js): no ETag
function newApp() {
	const app = express();
	app.disable('etag');
	app.use(express.json({ limit: '16kb' }));
	return app;
}

async function baseApp() {
	const app = newApp();
	app.post('/charges', charge);
	app.post('/orders', order);
	app.use(onError);
	return app;
}

async function extApp() {
	// as examples/payments-api/server.js: claims and finishing statements on
	// two pools
	const options = '-c bytea_output=hex';
	const claimPool = new pg.Pool({ ...poolOptions, options, application_name: 'httpbench ext claims' });
	const finishPool = new pg.Pool({ ...poolOptions, options, application_name: 'httpbench ext' });
	// as server.js: session takeover when the extension has it, a
	// checkpoint with CHECKPOINT=on
	const example = env.EXAMPLE_DIR ? await import(pathToFileURL(`${env.EXAMPLE_DIR}/app.js`)) : { createApp, hasRecovery };
	const sessionTakeover = env.RECOVERY === 'off' ? false : await example.hasRecovery(finishPool);
	const checkpoint = sessionTakeover && env.CHECKPOINT === 'on';
	return example.createApp({ claimPool, pool: finishPool, provider, lease: env.LEASE ?? '30 s', sessionTakeover, checkpoint });
}

async function expidemApp() {
	const { idempotency, getSharedIdempotencyService } = await import('express-idempotency');
	// CommonJS with exports.default: import() wraps it once more
	const adapterModule = await import('express-idempotency-redis-adapter');
	const RedisAdapter = adapterModule.default.default ?? adapterModule.default;
	const dataAdapter = new RedisAdapter({ connectionConfig: { socket: { path: env.REDIS_SOCKET } } });
	await dataAdapter.connect();
	const app = newApp();
	const service = () => getSharedIdempotencyService();
	const guarded = (handler) => async (req, res) => {
		if (service().isHit(req)) {
			return; // the middleware sent the stored response (or a 409 / 417)
		}
		req.onActionFailed = () => service().reportError(req);
		return handler(req, res);
	};
	app.use(idempotency({ dataAdapter }));
	app.post('/charges', guarded(charge));
	app.post('/orders', guarded(order));
	// the middleware reports "in progress" (409) and "misuse" (417) as errors
	app.use(onError);
	return app;
}

async function nodeidemApp() {
	const { Idempotency, IdempotencyError, IdempotencyErrorCodes } = await import('@node-idempotency/core');
	const { RedisStorageAdapter } = await import('@node-idempotency/storage-adapter-redis');
	const storage = new RedisStorageAdapter({ socket: { path: env.REDIS_SOCKET } });
	await storage.connect();
	const idem = new Idempotency(storage, {});
	const httpStatus = {
		[IdempotencyErrorCodes.REQUEST_IN_PROGRESS]: 409,
		[IdempotencyErrorCodes.IDEMPOTENCY_FINGERPRINT_MISSMATCH]: 422,
	};
	const guarded = (handler) => async (req, res) => {
		const ireq = { headers: req.headers, body: req.body, path: req.url, method: req.method };
		let cached;
		try {
			cached = await idem.onRequest(ireq);
		} catch (err) {
			if (!(err instanceof IdempotencyError)) {
				throw err;
			}
			return res.status(httpStatus[err.code] ?? 400).json({ error: err.message });
		}
		if (cached) {
			res.set('Idempotent-Replayed', 'true');
			return res.status(cached.additional.statusCode).json(cached.body ?? cached.error);
		}
		// store what the handler answers, as the library's NestJS interceptor
		// does: a body on success, the error otherwise
		const json = res.json.bind(res);
		res.json = (body) => {
			const statusCode = res.statusCode;
			const stored = statusCode < 400 ? { additional: { statusCode }, body } : { additional: { statusCode }, error: body };
			idem.onResponse(ireq, stored).then(() => json(body), (err) => {
				console.error('onResponse failed:', err.message);
				json(body);
			});
			return res;
		};
		return handler(req, res);
	};
	const app = newApp();
	app.post('/charges', guarded(charge));
	app.post('/orders', guarded(order));
	app.use(onError);
	return app;
}

const apps = { base: baseApp, ext: extApp, expidem: expidemApp, nodeidem: nodeidemApp };
if (!apps[contender]) {
	console.error(`CONTENDER must be one of ${Object.keys(apps).join(', ')}`);
	process.exit(2);
}
const app = await apps[contender]();
app.listen(Number(env.PORT ?? 3000), env.HOST ?? '127.0.0.1', (err) => {
	if (err) {
		console.error(`cannot listen: ${err.message}`);
		process.exit(1);
	}
	console.log(`${contender} listening on ${env.PORT}`);
});
process.on('SIGTERM', () => process.exit(0));
