/* idempotency--1.3--1.4.sql: takeover by session, checkpoints, remembered keys; the mode survives a dump */

\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.4'" to load this file. \quit

/*
 * New columns of both record tables (src/storage.c finds every column by
 * name; a DBA's own columns may sit anywhere):
 *	holder		the session that made a claim with takeover => 'session'
 *	checkpoint	the last idem_checkpoint state of a pending claim
 *	takeovers	how many times the key was taken over
 *	forget_at	until when a completed key is remembered after its
 *				response has expired (remember => ...)
 * None of them rewrites the table: records in flight stay as they are.
 */
ALTER TABLE @extschema@.idem_record
	ADD COLUMN holder pg_catalog.int8,
	ADD COLUMN checkpoint pg_catalog.jsonb,
	ADD COLUMN takeovers pg_catalog.int4 NOT NULL DEFAULT 0,
	ADD COLUMN forget_at pg_catalog.timestamptz;
ALTER TABLE @extschema@.idem_result
	ADD COLUMN holder pg_catalog.int8,
	ADD COLUMN checkpoint pg_catalog.jsonb,
	ADD COLUMN takeovers pg_catalog.int4 NOT NULL DEFAULT 0,
	ADD COLUMN forget_at pg_catalog.timestamptz;

/*
 * idem_begin gains takeover and remember.  A new argument list is a new
 * function: the old one is dropped (a view that calls it would stop this
 * update, which then says so).
 */
DROP FUNCTION @extschema@.idem_begin(pg_catalog.text, pg_catalog.text, pg_catalog.bytea,
									 pg_catalog.text, pg_catalog.interval, pg_catalog.interval);
CREATE FUNCTION @extschema@.idem_begin(
	operation	pg_catalog.text,
	key			pg_catalog.text,
	fingerprint	pg_catalog.bytea,
	in_flight	pg_catalog.text DEFAULT NULL,
	lease		pg_catalog.interval DEFAULT NULL,
	ttl			pg_catalog.interval DEFAULT NULL,
	takeover	pg_catalog.text DEFAULT NULL,
	remember	pg_catalog.interval DEFAULT NULL)
RETURNS @extschema@.idem_claim
AS 'MODULE_PATHNAME', 'idem_begin'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION @extschema@.idem_checkpoint(
	operation	pg_catalog.text,
	key			pg_catalog.text,
	token		pg_catalog.int8,
	state		pg_catalog.jsonb)
RETURNS pg_catalog.void
AS 'MODULE_PATHNAME', 'idem_checkpoint'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

/* idem_inspect shows the checkpoint, the takeovers and remembering */
DROP FUNCTION @extschema@.idem_inspect(pg_catalog.text, pg_catalog.text);
CREATE FUNCTION @extschema@.idem_inspect(
	operation	pg_catalog.text,
	key			pg_catalog.text,
	OUT state		pg_catalog.text,
	OUT token		pg_catalog.int8,
	OUT fingerprint	pg_catalog.bytea,
	OUT created_at	pg_catalog.timestamptz,
	OUT lease_until	pg_catalog.timestamptz,
	OUT completed_at pg_catalog.timestamptz,
	OUT expires_at	pg_catalog.timestamptz,
	OUT uncommitted	pg_catalog.bool,
	OUT response	pg_catalog.jsonb,
	OUT checkpoint	pg_catalog.jsonb,
	OUT takeovers	pg_catalog.int4,
	OUT remembered_until pg_catalog.timestamptz)
RETURNS SETOF record
AS 'MODULE_PATHNAME', 'idem_inspect'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 1;

/* two counters more: 'recover' results and IK410 refusals */
DROP VIEW @extschema@.idem_stats_counters;
DROP FUNCTION @extschema@.idem_counters();
CREATE FUNCTION @extschema@.idem_counters(
	OUT claims				pg_catalog.int8,
	OUT replays				pg_catalog.int8,
	OUT waits				pg_catalog.int8,
	OUT wait_time_ms		pg_catalog.float8,
	OUT in_progress_refusals pg_catalog.int8,
	OUT key_reuse_refusals	pg_catalog.int8,
	OUT takeovers			pg_catalog.int8,
	OUT fencing_refusals	pg_catalog.int8,
	OUT aborts				pg_catalog.int8,
	OUT purged				pg_catalog.int8,
	OUT recoveries			pg_catalog.int8,
	OUT expired_refusals	pg_catalog.int8,
	OUT stats_reset			pg_catalog.timestamptz)
RETURNS record
AS 'MODULE_PATHNAME', 'idem_counters'
LANGUAGE C VOLATILE PARALLEL SAFE;

CREATE VIEW @extschema@.idem_stats_counters AS
	SELECT * FROM @extschema@.idem_counters();

GRANT EXECUTE ON FUNCTION
	@extschema@.idem_begin(pg_catalog.text, pg_catalog.text, pg_catalog.bytea,
						   pg_catalog.text, pg_catalog.interval, pg_catalog.interval,
						   pg_catalog.text, pg_catalog.interval),
	@extschema@.idem_checkpoint(pg_catalog.text, pg_catalog.text, pg_catalog.int8, pg_catalog.jsonb),
	@extschema@.idem_inspect(pg_catalog.text, pg_catalog.text),
	@extschema@.idem_counters()
TO PUBLIC;
GRANT SELECT ON @extschema@.idem_stats_counters TO PUBLIC;

/*
 * The durability mode, kept where a dump finds it.  The mode itself is the
 * tables' persistence, which a dump does not carry: CREATE EXTENSION in the
 * restored database starts in 'completed'.  idem_set_durability writes the
 * mode here too (no row: 'completed', where a new installation starts);
 * pg_dump dumps this row, and restoring it switches the
 * restored database to the mode that was dumped (idem_mode_restored).
 * Records restored into either table are settled where the mode keeps them
 * (idem_settle): a statement trigger, which the idem_* functions' own
 * writes never fire, only INSERT and COPY do.
 */
CREATE TABLE @extschema@.idem_mode (
	durability	pg_catalog.text NOT NULL
		CHECK (durability OPERATOR(pg_catalog.=) 'none'
			   OR durability OPERATOR(pg_catalog.=) 'completed'
			   OR durability OPERATOR(pg_catalog.=) 'all'),
	one_row		pg_catalog.bool NOT NULL DEFAULT true PRIMARY KEY CHECK (one_row)
);
REVOKE ALL ON @extschema@.idem_mode FROM PUBLIC;
GRANT SELECT ON @extschema@.idem_mode TO pg_database_owner;
SELECT pg_catalog.pg_extension_config_dump('idem_mode', '');

COMMENT ON TABLE @extschema@.idem_mode IS
	'The durability mode, for pg_dump. Written by idem_set_durability; restoring it switches to that mode.';

CREATE FUNCTION @extschema@.idem_mode_restored()
RETURNS trigger
AS 'MODULE_PATHNAME', 'idem_mode_restored'
LANGUAGE C VOLATILE
SET search_path = pg_catalog, pg_temp;

CREATE FUNCTION @extschema@.idem_settle()
RETURNS trigger
AS 'MODULE_PATHNAME', 'idem_settle'
LANGUAGE C VOLATILE
SET search_path = pg_catalog, pg_temp;

REVOKE ALL ON FUNCTION
	@extschema@.idem_mode_restored(),
	@extschema@.idem_settle()
FROM PUBLIC;

CREATE TRIGGER restore_mode BEFORE INSERT OR UPDATE ON @extschema@.idem_mode
	FOR EACH ROW EXECUTE FUNCTION @extschema@.idem_mode_restored();
CREATE TRIGGER settle_records AFTER INSERT ON @extschema@.idem_record
	FOR EACH STATEMENT EXECUTE FUNCTION @extschema@.idem_settle();
CREATE TRIGGER settle_records AFTER INSERT ON @extschema@.idem_result
	FOR EACH STATEMENT EXECUTE FUNCTION @extschema@.idem_settle();

/* the current mode, so that a dump of the updated database carries it */
SELECT @extschema@.idem_set_durability(@extschema@.idem_durability());

/*
 * The cluster that started the last token epoch (src/tokens.c): timeline
 * numbers mean something only within one cluster, and a dump restored
 * elsewhere, or pg_upgrade, starts over on lower ones.  Logged and dumped
 * like idem_token_epoch; set now to this cluster.
 */
CREATE SEQUENCE @extschema@.idem_token_cluster AS pg_catalog.int8
	MINVALUE -9223372036854775808 NO CYCLE;
REVOKE ALL ON SEQUENCE @extschema@.idem_token_cluster FROM PUBLIC;
GRANT SELECT ON SEQUENCE @extschema@.idem_token_cluster TO pg_database_owner;
SELECT pg_catalog.pg_extension_config_dump('idem_token_cluster', '');
SELECT pg_catalog.setval('idem_token_cluster',
	(SELECT system_identifier FROM pg_catalog.pg_control_system()));

/*
 * Publications (src/admin.c): idem_result is logged in modes 'completed'
 * and 'all', so FOR ALL TABLES (or FOR TABLES IN SCHEMA of this schema)
 * would send its changes to subscribers that may not have the extension,
 * whose apply worker then stops, and the application's tables with it.
 * The guard refuses such a publication, and the installation or update of
 * the extension while one exists (idem_set_durability, at the end of the
 * script, checks), unless idempotency.publish_records is on (README,
 * "Replication").
 */
CREATE FUNCTION @extschema@.idem_publication_guard()
RETURNS event_trigger
AS 'MODULE_PATHNAME', 'idem_publication_guard'
LANGUAGE C VOLATILE
SET search_path = pg_catalog, pg_temp;
REVOKE ALL ON FUNCTION @extschema@.idem_publication_guard() FROM PUBLIC;

CREATE EVENT TRIGGER idempotency_publication_guard ON ddl_command_end
	WHEN TAG IN ('CREATE PUBLICATION', 'ALTER PUBLICATION')
	EXECUTE FUNCTION @extschema@.idem_publication_guard();

/*
 * An online durability switch (src/admin.c): records move between the
 * tables in committed batches while claims go on, and each table changes
 * its persistence in a short transaction once it holds few records.  A
 * procedure that commits may have neither SECURITY DEFINER nor SET: it runs
 * with the caller's rights (the tables' owner) and names every object
 * fully qualified.
 */
CREATE PROCEDURE @extschema@.idem_set_durability_online(
	mode		pg_catalog.text,
	batch_size	pg_catalog.int4 DEFAULT 200)
AS 'MODULE_PATHNAME', 'idem_set_durability_online'
LANGUAGE C;
REVOKE ALL ON PROCEDURE @extschema@.idem_set_durability_online(pg_catalog.text, pg_catalog.int4) FROM PUBLIC;

/*
 * Monitoring (README, "Monitoring"): what a member of pg_monitor may read,
 * and nothing else -- no key, no fingerprint, no response, no write.
 *
 * idem_monitor counts every role's records by role, operation and state.
 * A view reads the tables with its owner's rights (the extension's owner),
 * so its readers need no right on them; its query is parsed here, once, so
 * a reader's search_path plays no part.  security_barrier: a reader's WHERE
 * clause is applied to the view's rows, never to the records under them.
 * state is idem_inspect's: pending, lapsed (pending, lease over),
 * completed, expired (completed, retention over).  role is NULL for the
 * records of a role dropped since.  oldest_age is the age of the group's
 * oldest record (since its claim).  A later update that changes the type
 * of a column read here drops and re-creates the view.
 */
CREATE VIEW @extschema@.idem_monitor WITH (security_barrier) AS
SELECT a.rolname AS role, g.operation, g.state, g.records, g.oldest_age
  FROM (SELECT r.role_id, r.operation,
			   CASE WHEN r.completed_at IS NULL
					THEN CASE WHEN r.expires_at OPERATOR(pg_catalog.<=) pg_catalog.statement_timestamp()
							  THEN 'lapsed' ELSE 'pending' END
					ELSE CASE WHEN r.expires_at OPERATOR(pg_catalog.<=) pg_catalog.statement_timestamp()
							  THEN 'expired' ELSE 'completed' END
			   END AS state,
			   pg_catalog.count(*) AS records,
			   pg_catalog.statement_timestamp() OPERATOR(pg_catalog.-)
				 pg_catalog.min(r.created_at) AS oldest_age
		  FROM (SELECT role_id, operation, created_at, completed_at, expires_at
				  FROM @extschema@.idem_record
				UNION ALL
				SELECT role_id, operation, created_at, completed_at, expires_at
				  FROM @extschema@.idem_result) r
		 GROUP BY 1, 2, 3) g
  LEFT JOIN pg_catalog.pg_roles a
	ON a.oid OPERATOR(pg_catalog.=) g.role_id::pg_catalog.oid;

/*
 * The server-wide counters, a row per counter in base units (wait_seconds
 * in seconds), every counter the library has: one added later shows here
 * with no change to this definition.  Like idem_counters(), it needs
 * shared_preload_libraries.
 */
CREATE FUNCTION @extschema@.idem_monitor_counters(
	OUT counter		pg_catalog.text,
	OUT value		pg_catalog.float8)
RETURNS SETOF record
AS 'MODULE_PATHNAME', 'idem_monitor_counters'
LANGUAGE C VOLATILE PARALLEL SAFE;

REVOKE ALL ON @extschema@.idem_monitor FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.idem_monitor_counters() FROM PUBLIC;
GRANT SELECT ON @extschema@.idem_monitor TO pg_monitor;
GRANT EXECUTE ON FUNCTION @extschema@.idem_monitor_counters() TO pg_monitor;
