/*
 * 50_stats.sql: the records as a DBA looks at them -- idem_inspect (one key
 * of the calling role), idem_stats (its records per operation) and, for a
 * monitoring role, idem_monitor (every role's, without keys or responses).
 */

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
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE ROWS 1
SET search_path = pg_catalog, @extschema@, pg_temp
SET enable_seqscan = off
AS $idem_inspect$
DECLARE
	now CONSTANT timestamptz := clock_timestamp();
BEGIN
	PERFORM _idem_check_name(idem_inspect.operation, 'operation'),
			_idem_check_name(idem_inspect.key, 'key');
	RETURN QUERY
	SELECT _idem_state(t.completed_at, t.expires_at, t.forget_at, t.holder,
					   coalesce(t.writer = pg_current_xact_id_if_assigned(), false), now),
		   t.token, t.fingerprint, t.created_at,
		   CASE WHEN t.completed_at IS NULL THEN t.expires_at END,
		   t.completed_at,
		   CASE WHEN t.completed_at IS NOT NULL THEN t.expires_at END,
		   coalesce(t.writer = pg_current_xact_id_if_assigned(), false),
		   t.response, t.checkpoint, t.takeovers,
		   CASE WHEN t.completed_at IS NOT NULL THEN t.forget_at END
	  FROM idem_record t
	 WHERE t.role_id OPERATOR(pg_catalog.=) quote_ident(current_user)::regrole
	   AND t.operation = idem_inspect.operation AND t.key = idem_inspect.key;
END
$idem_inspect$;

CREATE FUNCTION @extschema@.idem_stats_records(
	OUT operation	pg_catalog.text,
	OUT pending		pg_catalog.int8,
	OUT lapsed		pg_catalog.int8,
	OUT completed	pg_catalog.int8,
	OUT expired		pg_catalog.int8,
	OUT remembered	pg_catalog.int8,
	OUT unknown		pg_catalog.int8)
RETURNS SETOF record
LANGUAGE sql STABLE PARALLEL UNSAFE
SET search_path = pg_catalog, @extschema@, pg_temp
AS $$
	SELECT s.operation,
		   count(*) FILTER (WHERE s.state = 'pending'),
		   count(*) FILTER (WHERE s.state = 'lapsed'),
		   count(*) FILTER (WHERE s.state = 'completed'),
		   count(*) FILTER (WHERE s.state = 'expired'),
		   count(*) FILTER (WHERE s.state = 'remembered'),
		   count(*) FILTER (WHERE s.state = 'unknown')
	  FROM (SELECT t.operation,
				   _idem_state(t.completed_at, t.expires_at, t.forget_at, t.holder,
							   coalesce(t.writer = pg_current_xact_id_if_assigned(), false),
							   clock_timestamp()) AS state
			  FROM idem_record t
			 WHERE t.role_id OPERATOR(pg_catalog.=) quote_ident(current_user)::regrole) s
	 GROUP BY s.operation
	 ORDER BY s.operation
$$;

CREATE VIEW @extschema@.idem_stats AS
	SELECT operation, pending, lapsed, completed, expired, remembered, unknown
	  FROM @extschema@.idem_stats_records();

GRANT EXECUTE ON FUNCTION
	@extschema@.idem_inspect(pg_catalog.text, pg_catalog.text),
	@extschema@.idem_stats_records()
TO PUBLIC;
GRANT SELECT ON @extschema@.idem_stats TO PUBLIC;

/* every role's records, as the C edition's view (its owner passes row-level security) */
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
		  FROM @extschema@.idem_record r
		 GROUP BY 1, 2, 3) g
  LEFT JOIN pg_catalog.pg_roles a
	ON a.oid OPERATOR(pg_catalog.=) g.role_id::pg_catalog.oid;

REVOKE ALL ON @extschema@.idem_monitor FROM PUBLIC;
GRANT SELECT ON @extschema@.idem_monitor TO pg_monitor;
