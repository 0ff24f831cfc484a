/* idempotency--1.3--1.4.sql: version 1.4 */

\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.4'" to load this file. \quit

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
