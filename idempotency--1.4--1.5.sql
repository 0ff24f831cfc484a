/* idempotency--1.4--1.5.sql: ALTER EXTENSION idempotency UPDATE TO '1.5' */

\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.5'" to load this file. \quit

/*
 * A remembered key -- completed, past its retention, kept until forget_at
 * so that a retry gets IK410 -- is a state of its own, 'remembered', in
 * idem_stats and idem_monitor as in idem_inspect: it is not 'expired',
 * which purge deletes.  idem_stats_records gains a column, so it and the
 * view over it are dropped and created again (a view of a user's on
 * idem_stats or idem_monitor stops this update, which then says so), with
 * the privileges they had.
 */
DROP VIEW @extschema@.idem_stats;
DROP FUNCTION @extschema@.idem_stats_records();

/* The calling role's records per operation, as the current snapshot sees them */
CREATE FUNCTION @extschema@.idem_stats_records(
	OUT operation	pg_catalog.text,
	OUT pending		pg_catalog.int8,
	OUT lapsed		pg_catalog.int8,
	OUT completed	pg_catalog.int8,
	OUT expired		pg_catalog.int8,
	OUT remembered	pg_catalog.int8)
RETURNS SETOF record
AS 'MODULE_PATHNAME', 'idem_stats_records'
LANGUAGE C STABLE PARALLEL UNSAFE;

CREATE VIEW @extschema@.idem_stats AS
	SELECT operation, pending, lapsed, completed, expired, remembered
	  FROM @extschema@.idem_stats_records();

GRANT EXECUTE ON FUNCTION @extschema@.idem_stats_records() TO PUBLIC;
GRANT SELECT ON @extschema@.idem_stats TO PUBLIC;

/*
 * idem_monitor (docs/operations.md, "Monitoring"): every role's records, counted by
 * role, operation and state.  A view reads the tables with its owner's
 * rights (the extension's owner), so its readers need no right on them;
 * its query is parsed here, once, so a reader's search_path plays no
 * part.  security_barrier: a reader's WHERE clause is applied to the
 * view's rows, never to the records under them.  state is idem_inspect's:
 * pending, lapsed (pending, lease over), completed, remembered (completed,
 * retention over, key kept until forget_at), expired (completed, retention
 * over, not remembered: purge deletes it).  role is NULL for the records
 * of a role dropped since.  oldest_age is the age of the group's oldest
 * record (since its claim).
 */
DROP VIEW @extschema@.idem_monitor;

CREATE VIEW @extschema@.idem_monitor WITH (security_barrier) AS
SELECT a.rolname AS role, g.operation, g.state, g.records, g.oldest_age
  FROM (SELECT r.role_id, r.operation,
			   CASE WHEN r.completed_at IS NULL
					THEN CASE WHEN r.expires_at OPERATOR(pg_catalog.<=) pg_catalog.statement_timestamp()
							  THEN 'lapsed' ELSE 'pending' END
					WHEN r.expires_at OPERATOR(pg_catalog.>) pg_catalog.statement_timestamp()
					THEN 'completed'
					WHEN r.forget_at OPERATOR(pg_catalog.>) pg_catalog.statement_timestamp()
					THEN 'remembered'
					ELSE 'expired'
			   END AS state,
			   pg_catalog.count(*) AS records,
			   pg_catalog.statement_timestamp() OPERATOR(pg_catalog.-)
				 pg_catalog.min(r.created_at) AS oldest_age
		  FROM (SELECT role_id, operation, created_at, completed_at, expires_at, forget_at
				  FROM @extschema@.idem_record
				UNION ALL
				SELECT role_id, operation, created_at, completed_at, expires_at, forget_at
				  FROM @extschema@.idem_result) r
		 GROUP BY 1, 2, 3) g
  LEFT JOIN pg_catalog.pg_roles a
	ON a.oid OPERATOR(pg_catalog.=) g.role_id::pg_catalog.oid;

REVOKE ALL ON @extschema@.idem_monitor FROM PUBLIC;
GRANT SELECT ON @extschema@.idem_monitor TO pg_monitor;

/*
 * The publication guard also runs at the end of ALTER TABLE, which may move
 * one of the extension's tables into a schema published FOR TABLES IN
 * SCHEMA.
 */
DROP EVENT TRIGGER idempotency_publication_guard;
CREATE EVENT TRIGGER idempotency_publication_guard ON ddl_command_end
	WHEN TAG IN ('CREATE PUBLICATION', 'ALTER PUBLICATION', 'ALTER TABLE')
	EXECUTE FUNCTION @extschema@.idem_publication_guard();

/*
 * idem_forget: a key's record deleted on purpose, by an administrator (a
 * support team that stored a wrong response).  The next idem_begin of the
 * key gets 'new'.  A pending claim a live attempt holds is refused unless
 * force.  Not granted to PUBLIC; it runs with the owner's rights, for the
 * role it is given (the caller by default).
 */
CREATE FUNCTION @extschema@.idem_forget(
	operation	pg_catalog.text,
	key			pg_catalog.text,
	role		pg_catalog.name DEFAULT CURRENT_USER,
	force		pg_catalog.bool DEFAULT false)
RETURNS pg_catalog.text
AS 'MODULE_PATHNAME', 'idem_forget'
LANGUAGE C VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp;

REVOKE ALL ON FUNCTION
	@extschema@.idem_forget(pg_catalog.text, pg_catalog.text, pg_catalog.name, pg_catalog.bool)
FROM PUBLIC;

/* one counter more: records forgotten */
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
	OUT forgotten			pg_catalog.int8,
	OUT stats_reset			pg_catalog.timestamptz)
RETURNS record
AS 'MODULE_PATHNAME', 'idem_counters'
LANGUAGE C VOLATILE PARALLEL SAFE;

CREATE VIEW @extschema@.idem_stats_counters AS
	SELECT * FROM @extschema@.idem_counters();

GRANT EXECUTE ON FUNCTION @extschema@.idem_counters() TO PUBLIC;
GRANT SELECT ON @extschema@.idem_stats_counters TO PUBLIC;

/*
 * Records that an online switch cut short left in the table the mode does
 * not keep them in are moved where it does, so that the mode promised
 * holds from here on.
 */
SELECT @extschema@.idem_set_durability(@extschema@.idem_durability());
