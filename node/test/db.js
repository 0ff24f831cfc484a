'use strict';
// A scratch database per test file on the server the libpq environment
// names (PGHOST, PGPORT, PGUSER: a superuser, who creates the untrusted
// extension), dropped at the end.

const pg = require('pg');

async function scratchDatabase(label) {
	const name = `idem_node_${label}_${process.pid}`;
	const admin = new pg.Client({ database: process.env.PGDATABASE || 'postgres' });
	await admin.connect();
	await admin.query(`DROP DATABASE IF EXISTS ${name} WITH (FORCE)`);
	await admin.query(`CREATE DATABASE ${name}`);
	const db = new pg.Client({ database: name });
	try {
		await db.connect();
		await db.query('CREATE EXTENSION idempotency');
	} catch (err) {
		await db.end().catch(() => {});
		await admin.query(`DROP DATABASE IF EXISTS ${name} WITH (FORCE)`).catch(() => {});
		await admin.end();
		throw err;
	}
	const pools = [];
	return {
		name,
		db,
		pool(options = {}) {
			const p = new pg.Pool({ database: name, max: 10, ...options });
			p.on('error', () => {});
			pools.push(p);
			return p;
		},
		async drop() {
			await Promise.all(pools.map((p) => p.end().catch(() => {})));
			await db.end();
			await admin.query(`DROP DATABASE IF EXISTS ${name} WITH (FORCE)`);
			await admin.end();
		},
	};
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

module.exports = { scratchDatabase, sleep };
