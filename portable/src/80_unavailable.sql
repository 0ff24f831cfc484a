/*
 * 80_unavailable.sql: what only the C edition can do.  Each is here under
 * the C edition's name and signature, and fails with 0A000 saying so:
 * never a silent wrong answer.  portable/README.md lists them.
 */

CREATE FUNCTION @extschema@._idem_unavailable(what pg_catalog.text, why pg_catalog.text)
RETURNS void
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $_idem_unavailable$
BEGIN
	RAISE EXCEPTION '% is not available in the portable edition of idempotency', what
		USING ERRCODE = '0A000', DETAIL = why,
			  HINT = 'It needs the C edition of idempotency (a server that can load its library).';
END
$_idem_unavailable$;

/* server-wide counters live in shared memory, which only a preloaded library has */
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
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, @extschema@, pg_temp
AS $idem_counters$
BEGIN
	PERFORM _idem_unavailable('idem_counters()',
		'The server-wide counters live in shared memory, which only a library in shared_preload_libraries can have. idem_stats works.');
END
$idem_counters$;

CREATE VIEW @extschema@.idem_stats_counters AS
	SELECT * FROM @extschema@.idem_counters();

CREATE FUNCTION @extschema@.idem_stats_reset()
RETURNS pg_catalog.void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, @extschema@, pg_temp
AS $idem_stats_reset$
BEGIN
	PERFORM _idem_unavailable('idem_stats_reset()',
		'The server-wide counters live in shared memory, which only a library in shared_preload_libraries can have.');
END
$idem_stats_reset$;

CREATE FUNCTION @extschema@.idem_monitor_counters(
	OUT counter		pg_catalog.text,
	OUT value		pg_catalog.float8)
RETURNS SETOF record
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, @extschema@, pg_temp
AS $idem_monitor_counters$
BEGIN
	PERFORM _idem_unavailable('idem_monitor_counters()',
		'The server-wide counters live in shared memory, which only a library in shared_preload_libraries can have. The view idem_monitor works.');
END
$idem_monitor_counters$;

CREATE PROCEDURE @extschema@.idem_set_durability_online(
	mode		pg_catalog.text,
	batch_size	pg_catalog.int4 DEFAULT 200)
LANGUAGE plpgsql
SET search_path = pg_catalog, @extschema@, pg_temp
AS $idem_set_durability_online$
BEGIN
	PERFORM _idem_unavailable('idem_set_durability_online()',
		'An online switch moves records between the C edition''s two tables in batches; this edition switches its one table with idem_set_durability, in one step.');
END
$idem_set_durability_online$;

CREATE FUNCTION @extschema@.idem_distribute(colocate_with pg_catalog.regclass DEFAULT NULL)
RETURNS pg_catalog.bool
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, @extschema@, pg_temp
AS $idem_distribute$
BEGIN
	PERFORM _idem_unavailable('idem_distribute()',
		'Distributing the records over a Citus cluster needs the C edition''s routing of each call to the node that holds its key.');
	RETURN NULL;
END
$idem_distribute$;

GRANT EXECUTE ON FUNCTION @extschema@.idem_counters() TO PUBLIC;
GRANT SELECT ON @extschema@.idem_stats_counters TO PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.idem_stats_reset() FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.idem_monitor_counters() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION @extschema@.idem_monitor_counters() TO pg_monitor;
REVOKE ALL ON PROCEDURE @extschema@.idem_set_durability_online(pg_catalog.text, pg_catalog.int4) FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.idem_distribute(pg_catalog.regclass) FROM PUBLIC;
