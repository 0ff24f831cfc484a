/* idempotency--1.5--1.6.sql: ALTER EXTENSION idempotency UPDATE TO '1.6' */

\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.6'" to load this file. \quit

/* ---- one definition of a record's state, and 'unknown' on a standby ---- */

/*
 * A record's state as idem_begin decides by it, for SQL: idem_monitor names
 * each record's state with it, as idem_inspect and idem_stats do in C, so
 * that a 'session' claim whose session has ended is 'lapsed' in every view.
 * xmin tells a version of the calling transaction; now is the moment to
 * judge at.  On a hot standby a 'session' claim within its lease is
 * 'unknown': whether its session lives only the primary can tell.
 */
CREATE FUNCTION @extschema@.idem_record_state(
	xmin			pg_catalog.xid,
	completed_at	pg_catalog.timestamptz,
	expires_at		pg_catalog.timestamptz,
	forget_at		pg_catalog.timestamptz,
	holder			pg_catalog.int8,
	now				pg_catalog.timestamptz)
RETURNS pg_catalog.text
AS 'MODULE_PATHNAME', 'idem_record_state_sql'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

REVOKE ALL ON FUNCTION @extschema@.idem_record_state(pg_catalog.xid,
	pg_catalog.timestamptz, pg_catalog.timestamptz, pg_catalog.timestamptz,
	pg_catalog.int8, pg_catalog.timestamptz) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION @extschema@.idem_record_state(pg_catalog.xid,
	pg_catalog.timestamptz, pg_catalog.timestamptz, pg_catalog.timestamptz,
	pg_catalog.int8, pg_catalog.timestamptz) TO pg_monitor;

/*
 * idem_stats gains the column unknown (the 'session' claims a standby
 * cannot judge), and its function binds the entry point of this
 * definition; both are dropped and created again, with their privileges.
 */
DROP VIEW @extschema@.idem_stats;
DROP FUNCTION @extschema@.idem_stats_records();

CREATE FUNCTION @extschema@.idem_stats_records(
	OUT operation	pg_catalog.text,
	OUT pending		pg_catalog.int8,
	OUT lapsed		pg_catalog.int8,
	OUT completed	pg_catalog.int8,
	OUT expired		pg_catalog.int8,
	OUT remembered	pg_catalog.int8,
	OUT unknown		pg_catalog.int8)
RETURNS SETOF record
AS 'MODULE_PATHNAME', 'idem_stats_records_1_6'
LANGUAGE C STABLE PARALLEL UNSAFE;

CREATE VIEW @extschema@.idem_stats AS
	SELECT operation, pending, lapsed, completed, expired, remembered, unknown
	  FROM @extschema@.idem_stats_records();

GRANT EXECUTE ON FUNCTION @extschema@.idem_stats_records() TO PUBLIC;
GRANT SELECT ON @extschema@.idem_stats TO PUBLIC;

/* idem_monitor: each record's state by idem_record_state */
DROP VIEW @extschema@.idem_monitor;

CREATE VIEW @extschema@.idem_monitor WITH (security_barrier) AS
SELECT a.rolname AS role, g.operation, g.state, g.records, g.oldest_age
  FROM (SELECT r.role_id, r.operation,
			   @extschema@.idem_record_state(r.xmin, r.completed_at, r.expires_at,
											 r.forget_at, r.holder,
											 pg_catalog.statement_timestamp()) AS state,
			   pg_catalog.count(*) AS records,
			   pg_catalog.statement_timestamp() OPERATOR(pg_catalog.-)
				 pg_catalog.min(r.created_at) AS oldest_age
		  FROM (SELECT xmin, role_id, operation, created_at, completed_at,
					   expires_at, forget_at, holder
				  FROM @extschema@.idem_record
				UNION ALL
				SELECT xmin, role_id, operation, created_at, completed_at,
					   expires_at, forget_at, holder
				  FROM @extschema@.idem_result) r
		 GROUP BY 1, 2, 3) g
  LEFT JOIN pg_catalog.pg_roles a
	ON a.oid OPERATOR(pg_catalog.=) g.role_id::pg_catalog.oid;

REVOKE ALL ON @extschema@.idem_monitor FROM PUBLIC;
GRANT SELECT ON @extschema@.idem_monitor TO pg_monitor;

/* ---- each SQL definition binds the C symbol of its own version ---- */

/*
 * idem_counters binds idem_counters_1_5, the symbol of the definition with
 * forgotten (the symbol idem_counters keeps serving the older ones).  The
 * function and the view over it are dropped and created again, with their
 * privileges.
 */
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
AS 'MODULE_PATHNAME', 'idem_counters_1_5'
LANGUAGE C VOLATILE PARALLEL SAFE;

CREATE VIEW @extschema@.idem_stats_counters AS
	SELECT * FROM @extschema@.idem_counters();

GRANT EXECUTE ON FUNCTION @extschema@.idem_counters() TO PUBLIC;
GRANT SELECT ON @extschema@.idem_stats_counters TO PUBLIC;

/*
 * idem_begin and idem_inspect bind the entry points of their argument and
 * column lists (idem_begin and idem_inspect serve the definitions of the
 * earlier scripts).  The functions are replaced in place, not dropped:
 * they keep their OIDs, privileges and dependents, and on a Citus cluster
 * their distribution, which Citus keeps by OID.  PostgreSQL lets an
 * extension's script replace only the extension's own functions.
 */
CREATE OR REPLACE FUNCTION @extschema@.idem_begin(
	operation	pg_catalog.text,
	key			pg_catalog.text,
	fingerprint	pg_catalog.bytea,
	in_flight	pg_catalog.text DEFAULT NULL,
	lease		pg_catalog.interval DEFAULT NULL,
	ttl			pg_catalog.interval DEFAULT NULL,
	takeover	pg_catalog.text DEFAULT NULL,
	remember	pg_catalog.interval DEFAULT NULL)
RETURNS @extschema@.idem_claim
AS 'MODULE_PATHNAME', 'idem_begin_1_4'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE OR REPLACE FUNCTION @extschema@.idem_inspect(
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
AS 'MODULE_PATHNAME', 'idem_inspect_1_4'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 1;
