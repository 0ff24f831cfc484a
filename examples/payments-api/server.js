// Entry point: `node server.js`.  The database comes from the usual libpq
// environment (PGHOST, PGPORT, PGUSER, PGPASSWORD, PGDATABASE); the database
// needs the extension and schema.sql (README.md).  Other settings, all
// optional:
//
//   PORT=3000 HOST=127.0.0.1     where to listen
//   IN_FLIGHT=wait|raise         a retry of a running request waits for its
//                                response (default) or gets 409 at once
//   LEASE='30 s'                 lease of a claim (longer than the slowest
//                                honest provider call)
//   WAIT_TIMEOUT_MS=10000        longest a retry waits for a running request
//                                before it gets 409 (statement_timeout)
//   PROVIDER_DELAY_MS=300        the simulated provider's latency
//   PROVIDER_FLAKY_CUSTOMERS=a,b customers whose first call per key times out
//   POOL_SIZE=10                 connections of each pool; a charge in
//                                flight keeps one of the claims' pool (app.js)
//   POOL_IDLE_TIMEOUT_MS=10000   an idle pooled connection is closed after
//                                this long (node-pg's idleTimeoutMillis; 0:
//                                never); it never closes a claim's connection
//   CHECKPOINT=off|on            on: before calling the provider, record a
//                                checkpoint on the claim, so that after a
//                                crash the retry gets 'recover' and asks the
//                                provider for the charge instead of calling
//                                it again.  Needed only with a provider that
//                                must not be called twice with one key; the
//                                default relies on the provider deduplicating
//                                by the key it is passed (app.js, README.md)
//   RECOVERY=off                 no session takeover nor checkpoints even when
//                                the extension has them (1.4): app.js

import pg from 'pg';

import { createApp, hasRecovery } from './app.js';
import { createProvider } from './provider.js';

const env = process.env;
const port = Number(env.PORT ?? 3000);
const host = env.HOST ?? '127.0.0.1';
const inFlight = env.IN_FLIGHT ?? 'wait';
const lease = env.LEASE ?? '30 s';
const waitTimeoutMs = Number(env.WAIT_TIMEOUT_MS ?? 10000);

if (inFlight !== 'wait' && inFlight !== 'raise') {
	console.error(`IN_FLIGHT must be "wait" or "raise", not ${JSON.stringify(inFlight)}`);
	process.exit(2);
}
const checkpointOption = env.CHECKPOINT ?? 'off';
if (checkpointOption !== 'on' && checkpointOption !== 'off') {
	console.error(`CHECKPOINT must be "on" or "off", not ${JSON.stringify(checkpointOption)}`);
	process.exit(2);
}

// bytea_output = hex: the IK422 DETAIL carries the fingerprints in hex
// Two pools (app.js): claims, which may wait, apart from the finishing
// statements, which must never wait behind them.  The orders' one-statement
// claims run on `pool`: they wait as long as a claim may, too.
const options = '-c bytea_output=hex';
const max = Number(env.POOL_SIZE ?? 10);
const idleTimeoutMillis = Number(env.POOL_IDLE_TIMEOUT_MS ?? 10000);
const claimPool = new pg.Pool({
	max, idleTimeoutMillis, options, application_name: 'payments-api claims', statement_timeout: waitTimeoutMs,
});
const pool = new pg.Pool({
	max, idleTimeoutMillis, options, application_name: 'payments-api', statement_timeout: waitTimeoutMs,
});
const providerPool = new pg.Pool({ max, idleTimeoutMillis, application_name: 'simulated provider' });
for (const p of [claimPool, pool, providerPool]) {
	// an idle connection that breaks (server restart) must not kill the process
	p.on('error', (err) => console.error('idle connection error:', err.message));
}

const provider = createProvider({
	pool: providerPool,
	delayMs: Number(env.PROVIDER_DELAY_MS ?? 300),
	flakyCustomers: (env.PROVIDER_FLAKY_CUSTOMERS ?? '').split(',').filter(Boolean),
});

// session takeover when the extension has it (1.4), and checkpoints if asked
let sessionTakeover = false;
try {
	sessionTakeover = env.RECOVERY !== 'off' && await hasRecovery(pool);
} catch (err) {
	console.error(`cannot reach the database: ${err.message}`);
	process.exit(1);
}
const checkpoint = checkpointOption === 'on';
if (checkpoint && !sessionTakeover) {
	console.error('CHECKPOINT=on needs the extension\'s version 1.4 or later, and not RECOVERY=off');
	process.exit(2);
}
const app = createApp({ claimPool, pool, provider, inFlight, lease, sessionTakeover, checkpoint });

const server = app.listen(port, host, (err) => {
	if (err) {
		console.error(`cannot listen on ${host}:${port}: ${err.message}`);
		process.exit(1);
	}
	console.log(`payments-api listening on http://${host}:${port} (in_flight=${inFlight}, lease=${lease}, ` +
		`takeover=${sessionTakeover ? 'session' : 'lease'}, checkpoint=${checkpoint ? 'on' : 'off'})`);
});

function shutdown() {
	server.close(() => {
		Promise.all([claimPool.end(), pool.end(), providerPool.end()]).finally(() => process.exit(0));
	});
	// requests still waiting on a claim do not hold us up for long
	setTimeout(() => process.exit(0), 2000).unref();
}
process.on('SIGTERM', shutdown);
process.on('SIGINT', shutdown);
