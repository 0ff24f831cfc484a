'use strict';
// A scratch database per test file on the server the libpq environment
// names (PGHOST, PGPORT, PGUSER: a superuser, who creates the untrusted
// extension), dropped at the end.
//
// Against the portable edition (test/portable/run), IDEM_TEST_INSTALL is
// the command that installs it in a database instead of CREATE EXTENSION
// idempotency (test/portable/install pgtle, or schema), and
// IDEM_TEST_SERVER_OPTIONS the options a server of the tests' own starts
// with (-c shared_preload_libraries=pg_tle).

const { execFileSync } = require('node:child_process');

const pg = require('pg');

const INSTALL = process.env.IDEM_TEST_INSTALL || '';
const SERVER_OPTIONS = process.env.IDEM_TEST_SERVER_OPTIONS || '';

// installEdition(client, { host, port, database }): the edition under test
// in that database, through the connected client `client` of it (CREATE
// EXTENSION idempotency) or the command IDEM_TEST_INSTALL with the libpq
// environment naming the database; a client connected before then does
// not see a search_path the command sets for the database
async function installEdition(client, { host, port, database }) {
	if (INSTALL === '') {
		await client.query('CREATE EXTENSION idempotency');
		return;
	}
	const env = { ...process.env, PGDATABASE: database };
	if (host !== undefined) {
		env.PGHOST = host;
	}
	if (port !== undefined) {
		env.PGPORT = String(port);
	}
	const [command, ...args] = INSTALL.split(/\s+/).filter(Boolean);
	execFileSync(command, args, { env, stdio: ['ignore', 'ignore', 'inherit'] });
}

// isSchemaStatement(statement): one of cases.json's "schema" statements
// other than CREATE EXTENSION idempotency (which installEdition does)
const isSchemaStatement = (statement) => !/^CREATE EXTENSION/i.test(statement);

async function scratchDatabase(label) {
	const name = `idem_node_${label}_${process.pid}`;
	const admin = new pg.Client({ database: process.env.PGDATABASE || 'postgres' });
	await admin.connect();
	await admin.query(`DROP DATABASE IF EXISTS ${name} WITH (FORCE)`);
	await admin.query(`CREATE DATABASE ${name}`);
	let db = new pg.Client({ database: name });
	try {
		await db.connect();
		await installEdition(db, { database: name });
		if (INSTALL !== '') {	// a new session, with the database's search_path
			await db.end();
			db = new pg.Client({ database: name });
			await db.connect();
		}
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

// expireCompleted(db, key): the key's completed record moved past its ttl,
// in the tables that the edition keeps records in: the C edition's
// idem_result and idem_record (which one depends on its durability mode),
// the portable edition's one idem_record (docs/managed-postgresql.md,
// "durability")
async function expireCompleted(db, key) {
	for (const table of ['idem_result', 'idem_record']) {
		const { rows } = await db.query('SELECT to_regclass($1) IS NOT NULL AS found', [table]);
		if (rows[0].found) {
			await db.query(`UPDATE ${table} SET expires_at = now() - interval '1 s'
			                 WHERE key = $1 AND completed_at IS NOT NULL`, [key]);
		}
	}
}

// failFirstFinish(db, key) -> { attempts(), drop() }: a trigger on the
// record tables that fails the first write of the key's completed record
// with a serialization failure (40001), as the extension on Citus answers
// a finish that raced a shard move, and lets later ones through;
// attempts() counts the finishes (a sequence: not rolled back with them)
async function failFirstFinish(db, key) {
	await db.query('CREATE SEQUENCE finish_attempts');
	await db.query(`CREATE FUNCTION fail_first_finish() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF NEW.key = '${key}' AND NEW.completed_at IS NOT NULL AND nextval('finish_attempts') = 1 THEN
				RAISE EXCEPTION 'the record of % moved', NEW.key USING ERRCODE = 'serialization_failure';
			END IF;
			RETURN NEW;
		END $$`);
	// a completed record is written to idem_record, or to idem_result in the
	// modes that keep completed records apart
	for (const table of ['idem_record', 'idem_result']) {
		const { rows } = await db.query('SELECT to_regclass($1) IS NOT NULL AS found', [table]);
		if (rows[0].found) {
			await db.query(`CREATE TRIGGER fail_first_finish BEFORE INSERT OR UPDATE ON ${table}
			                FOR EACH ROW EXECUTE FUNCTION fail_first_finish()`);
		}
	}
	return {
		async attempts() {
			const { rows } = await db.query('SELECT CASE WHEN is_called THEN last_value ELSE 0 END::int AS n FROM finish_attempts');
			return rows[0].n;
		},
		async drop() {
			await db.query('DROP FUNCTION fail_first_finish() CASCADE');
			await db.query('DROP SEQUENCE finish_attempts');
		},
	};
}

module.exports = {
	SERVER_OPTIONS, expireCompleted, failFirstFinish, installEdition, isSchemaStatement, scratchDatabase, sleep,
};
