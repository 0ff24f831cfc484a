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

/*
 * idem_distribute([colocate_with]) (docs/scaling-out.md): on a Citus
 * coordinator, turn the records into distributed tables, colocated, and
 * make the functions that take a key distributed functions, delegated to
 * the node holding the record's shard, where the C code opens the shards.
 * Without colocate_with the records are hash-distributed by key, and
 * records in flight are carried along.  With it, a hash-distributed table
 * of the caller's (distributed by its tenant), the records get a column
 * "tenant" of that table's distribution column's type, are distributed by
 * it and colocated with the table, and every key-taking function gets a
 * tenant form, idem_begin(tenant, operation, key, ...), delegated by the
 * tenant: a record is then on the node of its tenant's rows.  Returns
 * whether it distributed them now (false: they were already).  Run again
 * after adding a node: it prepares the new node's own tables.
 *
 * idem_distribute_node(tenant) prepares one node's tables, as every node
 * needs them: role_id holds the role's name (a role's OID differs from
 * node to node, and Citus copies shards row by row in binary), the tables
 * are in mode 'all' (Citus moves shards by logical replication, which
 * carries no unlogged table), and the settle_records triggers, which
 * Citus does not distribute, are gone (a dump of a distributed cluster is
 * restored by Citus's own procedure).  idem_monitor joins roles by name,
 * and pg_dump keeps the records of roles that exist by name too.  With a
 * tenant type, the tables get their tenant column, last in the primary
 * key, and the node the tenant forms of the functions.
 */
CREATE FUNCTION @extschema@.idem_extension_schema()
RETURNS pg_catalog.name
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
	SELECT n.nspname FROM pg_catalog.pg_extension e
	  JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) e.extnamespace
	 WHERE e.extname OPERATOR(pg_catalog.=) 'idempotency'
$$;

/* The tenant forms of the functions that take a key, with a tenant of type t */
CREATE FUNCTION @extschema@.idem_tenant_functions(t pg_catalog.regtype)
RETURNS SETOF pg_catalog.regprocedure
LANGUAGE sql STABLE
SET search_path = pg_catalog, @extschema@, pg_temp
AS $$
	SELECT p.oid::pg_catalog.regprocedure FROM pg_catalog.pg_proc p
	 WHERE p.pronamespace OPERATOR(pg_catalog.=) idem_extension_schema()::pg_catalog.regnamespace
	   AND p.proname OPERATOR(pg_catalog.=) ANY (ARRAY['idem_begin', 'idem_finish', 'idem_abort',
			'idem_renew', 'idem_checkpoint', 'idem_inspect', 'idem_forget'])
	   AND p.proargtypes[0] OPERATOR(pg_catalog.=) t
	   AND p.proargnames[1] OPERATOR(pg_catalog.=) 'tenant'
$$;

/* ... created, members of the extension */
CREATE FUNCTION @extschema@.idem_create_tenant_functions(t pg_catalog.regtype)
RETURNS pg_catalog.void
LANGUAGE plpgsql
SET search_path = pg_catalog, @extschema@, pg_temp
AS $idem_create_tenant_functions$
DECLARE
	schema CONSTANT name := idem_extension_schema();
	fn regprocedure;
	def text;
BEGIN
	FOREACH def IN ARRAY ARRAY[
		$f$idem_begin(tenant %2$s, operation pg_catalog.text, key pg_catalog.text,
			fingerprint pg_catalog.bytea, in_flight pg_catalog.text DEFAULT NULL,
			lease pg_catalog.interval DEFAULT NULL, ttl pg_catalog.interval DEFAULT NULL,
			takeover pg_catalog.text DEFAULT NULL, remember pg_catalog.interval DEFAULT NULL)
		RETURNS %1$I.idem_claim AS '$libdir/idempotency', 'idem_begin_tenant'
		LANGUAGE C VOLATILE PARALLEL UNSAFE$f$,
		$f$idem_finish(tenant %2$s, operation pg_catalog.text, key pg_catalog.text,
			token pg_catalog.int8, response pg_catalog.jsonb)
		RETURNS pg_catalog.void AS '$libdir/idempotency', 'idem_finish_tenant'
		LANGUAGE C VOLATILE PARALLEL UNSAFE$f$,
		$f$idem_abort(tenant %2$s, operation pg_catalog.text, key pg_catalog.text,
			token pg_catalog.int8)
		RETURNS pg_catalog.bool AS '$libdir/idempotency', 'idem_abort_tenant'
		LANGUAGE C VOLATILE PARALLEL UNSAFE$f$,
		$f$idem_renew(tenant %2$s, operation pg_catalog.text, key pg_catalog.text,
			token pg_catalog.int8, lease pg_catalog.interval)
		RETURNS pg_catalog.timestamptz AS '$libdir/idempotency', 'idem_renew_tenant'
		LANGUAGE C VOLATILE PARALLEL UNSAFE$f$,
		$f$idem_checkpoint(tenant %2$s, operation pg_catalog.text, key pg_catalog.text,
			token pg_catalog.int8, state pg_catalog.jsonb)
		RETURNS pg_catalog.void AS '$libdir/idempotency', 'idem_checkpoint_tenant'
		LANGUAGE C VOLATILE PARALLEL UNSAFE$f$,
		$f$idem_inspect(tenant %2$s, operation pg_catalog.text, key pg_catalog.text,
			OUT state pg_catalog.text, OUT token pg_catalog.int8,
			OUT fingerprint pg_catalog.bytea, OUT created_at pg_catalog.timestamptz,
			OUT lease_until pg_catalog.timestamptz, OUT completed_at pg_catalog.timestamptz,
			OUT expires_at pg_catalog.timestamptz, OUT uncommitted pg_catalog.bool,
			OUT response pg_catalog.jsonb, OUT checkpoint pg_catalog.jsonb,
			OUT takeovers pg_catalog.int4, OUT remembered_until pg_catalog.timestamptz)
		RETURNS SETOF record AS '$libdir/idempotency', 'idem_inspect_tenant'
		LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 1$f$,
		$f$idem_forget(tenant %2$s, operation pg_catalog.text, key pg_catalog.text,
			role pg_catalog.name DEFAULT CURRENT_USER, force pg_catalog.bool DEFAULT false)
		RETURNS pg_catalog.text AS '$libdir/idempotency', 'idem_forget_tenant'
		LANGUAGE C VOLATILE SECURITY DEFINER
		SET search_path = pg_catalog, pg_temp$f$]
	LOOP
		EXECUTE format('CREATE OR REPLACE FUNCTION %1$I.' || def, schema, t);
	END LOOP;
	-- members of the extension, as the functions they are forms of
	FOR fn IN
		SELECT f FROM idem_tenant_functions(t) f
		 WHERE NOT EXISTS (SELECT FROM pg_depend d
							WHERE d.classid OPERATOR(pg_catalog.=) 'pg_proc'::regclass
							  AND d.objid OPERATOR(pg_catalog.=) f::oid
							  AND d.deptype OPERATOR(pg_catalog.=) 'e')
	LOOP
		EXECUTE format('ALTER EXTENSION idempotency ADD FUNCTION %s', fn);
	END LOOP;
END
$idem_create_tenant_functions$;

CREATE FUNCTION @extschema@.idem_distribute_node(tenant pg_catalog.regtype)
RETURNS pg_catalog.bool
LANGUAGE plpgsql
SET search_path = pg_catalog, @extschema@, pg_temp
AS $idem_distribute_node$
DECLARE
	monitor text;
	tbl regclass;
	pkey name;
	changed bool := false;
	filter CONSTANT text :=
		'WHERE role_id OPERATOR(pg_catalog.=) ANY (SELECT rolname FROM pg_catalog.pg_roles)';
BEGIN
	-- the node's own changes: Citus must not send them on
	PERFORM set_config('citus.enable_ddl_propagation', 'off', true);

	IF tenant IS NOT NULL AND NOT EXISTS (SELECT FROM pg_attribute
		 WHERE attrelid OPERATOR(pg_catalog.=) 'idem_record'::regclass
		   AND attname OPERATOR(pg_catalog.=) 'tenant' AND NOT attisdropped) THEN
		-- the tenant, last in the primary key: Citus wants it there
		FOREACH tbl IN ARRAY ARRAY['idem_record', 'idem_result']::regclass[] LOOP
			SELECT conname INTO pkey FROM pg_constraint
			 WHERE conrelid OPERATOR(pg_catalog.=) tbl AND contype OPERATOR(pg_catalog.=) 'p';
			EXECUTE format('ALTER TABLE %s ADD COLUMN tenant %s NOT NULL, DROP CONSTRAINT %I, '
						   'ADD CONSTRAINT %I PRIMARY KEY (role_id, operation, key, tenant)',
						   tbl, tenant, pkey, pkey);
		END LOOP;
		PERFORM idem_create_tenant_functions(tenant);
		changed := true;
	END IF;

	IF (SELECT atttypid FROM pg_attribute
		 WHERE attrelid OPERATOR(pg_catalog.=) 'idem_record'::regclass
		   AND attname OPERATOR(pg_catalog.=) 'role_id') OPERATOR(pg_catalog.=) 'name'::regtype THEN
		RETURN changed;
	END IF;

	-- (a node added after distributing has a shell, whose records are the
	-- shards': Citus would plan a query of it as a distributed one)
	IF NOT EXISTS (SELECT FROM pg_dist_partition
					WHERE logicalrelid OPERATOR(pg_catalog.=) 'idem_record'::regclass) THEN
		IF EXISTS (SELECT FROM idem_record
					WHERE holder IS NOT NULL AND completed_at IS NULL) THEN
			RAISE EXCEPTION 'idempotency records with pending session claims cannot be distributed'
				USING ERRCODE = '55006',
					  DETAIL = 'A claim made with takeover => ''session'' follows its session, which a distributed call does not keep.',
					  HINT = 'Finish or abort the claims made with takeover => ''session'', then call idem_distribute() again.';
		END IF;
	END IF;
	IF (SELECT relpersistence FROM pg_class
		 WHERE oid OPERATOR(pg_catalog.=) 'idem_record'::regclass) OPERATOR(pg_catalog.<>) 'p'
	   OR (SELECT relpersistence FROM pg_class
			WHERE oid OPERATOR(pg_catalog.=) 'idem_result'::regclass) OPERATOR(pg_catalog.<>) 'p' THEN
		IF (SELECT groupid FROM pg_dist_local_group) OPERATOR(pg_catalog.=) 0 THEN
			PERFORM idem_set_durability('all');
		ELSE
			-- a worker's own tables, which no call reads
			ALTER TABLE idem_record SET LOGGED;
			ALTER TABLE idem_result SET LOGGED;
		END IF;
	END IF;
	DROP TRIGGER IF EXISTS settle_records ON idem_record;
	DROP TRIGGER IF EXISTS settle_records ON idem_result;

	monitor := pg_get_viewdef('idem_monitor'::regclass);
	IF strpos(monitor, '(a.oid = (g.role_id)::oid)') OPERATOR(pg_catalog.=) 0 THEN
		RAISE EXCEPTION 'view idem_monitor is not the extension''s'
			USING ERRCODE = '55000', DETAIL = monitor;
	END IF;
	monitor := replace(monitor, '(a.oid = (g.role_id)::oid)', '(a.rolname = g.role_id)');
	ALTER EXTENSION idempotency DROP VIEW idem_monitor;
	DROP VIEW idem_monitor;

	ALTER TABLE idem_record
		ALTER COLUMN role_id TYPE pg_catalog.name COLLATE "C" USING pg_catalog.pg_get_userbyid(role_id);
	ALTER TABLE idem_result
		ALTER COLUMN role_id TYPE pg_catalog.name COLLATE "C" USING pg_catalog.pg_get_userbyid(role_id);

	EXECUTE format('CREATE VIEW %I.idem_monitor WITH (security_barrier) AS %s',
				   idem_extension_schema(), monitor);
	ALTER EXTENSION idempotency ADD VIEW idem_monitor;
	REVOKE ALL ON idem_monitor FROM PUBLIC;
	GRANT SELECT ON idem_monitor TO pg_monitor;

	/* pg_extension_config_dump() runs only in a script: its filters, by hand */
	UPDATE pg_extension
	   SET extcondition = ARRAY(SELECT CASE WHEN c OPERATOR(pg_catalog.~~) '%role_id%' THEN filter ELSE c END
								  FROM unnest(extcondition) WITH ORDINALITY AS u(c, i) ORDER BY i)
	 WHERE extname OPERATOR(pg_catalog.=) 'idempotency';
	RETURN true;
END
$idem_distribute_node$;

/* idem_distribute_node(tenant) on every worker */
CREATE FUNCTION @extschema@.idem_distribute_workers(tenant pg_catalog.regtype)
RETURNS pg_catalog.void
LANGUAGE plpgsql
SET search_path = pg_catalog, @extschema@, pg_temp
AS $idem_distribute_workers$
DECLARE
	failed text;
BEGIN
	SELECT string_agg(format('%s:%s: %s', nodename, nodeport, result), '; ') INTO failed
	  FROM run_command_on_workers(format('SELECT %I.idem_distribute_node(%L::pg_catalog.regtype)',
										 idem_extension_schema(), tenant))
	 WHERE NOT success;
	IF failed IS NOT NULL THEN
		RAISE EXCEPTION 'idempotency records could not be prepared on every worker'
			USING ERRCODE = '55000', DETAIL = failed;
	END IF;
END
$idem_distribute_workers$;

CREATE FUNCTION @extschema@.idem_distribute(colocate_with pg_catalog.regclass DEFAULT NULL)
RETURNS pg_catalog.bool
LANGUAGE plpgsql
SET search_path = pg_catalog, @extschema@, pg_temp
AS $idem_distribute$
DECLARE
	fn regprocedure;
	tenant regtype;
	method "char";
	colocation int;
	by_column text;
BEGIN
	IF NOT EXISTS (SELECT FROM pg_extension WHERE extname OPERATOR(pg_catalog.=) 'citus') THEN
		RAISE EXCEPTION 'idem_distribute() needs Citus'
			USING ERRCODE = '55000', HINT = 'Run it on the coordinator of a Citus cluster.';
	END IF;
	IF NOT (SELECT rolsuper FROM pg_roles WHERE rolname OPERATOR(pg_catalog.=) current_user) THEN
		RAISE EXCEPTION 'permission denied to distribute idempotency records'
			USING ERRCODE = '42501', DETAIL = 'Only a superuser may call idem_distribute().';
	END IF;
	IF (SELECT groupid FROM pg_dist_local_group) OPERATOR(pg_catalog.<>) 0 THEN
		RAISE EXCEPTION 'idem_distribute() runs on the Citus coordinator'
			USING ERRCODE = '0A000';
	END IF;
	IF colocate_with IS NOT NULL THEN
		SELECT p.partmethod, p.colocationid, a.atttypid INTO method, colocation, tenant
		  FROM pg_dist_partition p
		  JOIN pg_attribute a ON a.attrelid OPERATOR(pg_catalog.=) p.logicalrelid
			   AND a.attname OPERATOR(pg_catalog.=) column_to_column_name(p.logicalrelid, p.partkey)
		 WHERE p.logicalrelid OPERATOR(pg_catalog.=) colocate_with;
		IF method IS DISTINCT FROM 'h' THEN
			RAISE EXCEPTION 'table % is not hash-distributed', colocate_with
				USING ERRCODE = '22023',
					  HINT = 'Colocate the records with a table distributed by its tenant: create_distributed_table(table, tenant column).';
		END IF;
	END IF;

	-- distributed already: a node added since gets its own tables
	IF EXISTS (SELECT FROM pg_dist_partition
				WHERE logicalrelid OPERATOR(pg_catalog.=) 'idem_record'::regclass) THEN
		IF colocate_with IS NOT NULL AND colocation IS DISTINCT FROM
			(SELECT colocationid FROM pg_dist_partition
			  WHERE logicalrelid OPERATOR(pg_catalog.=) 'idem_record'::regclass) THEN
			RAISE EXCEPTION 'idempotency records are distributed already, not colocated with %', colocate_with
				USING ERRCODE = '55000',
					  HINT = 'Distributing is one way: the records keep the layout they were given first.';
		END IF;
		PERFORM idem_distribute_workers((SELECT atttypid FROM pg_attribute
										  WHERE attrelid OPERATOR(pg_catalog.=) 'idem_record'::regclass
											AND attname OPERATOR(pg_catalog.=) 'tenant'
											AND NOT attisdropped));
		RETURN false;
	END IF;

	-- no claim or finish runs on the tables while they change
	LOCK TABLE idem_record, idem_result IN ACCESS EXCLUSIVE MODE;
	IF tenant IS NOT NULL AND (EXISTS (SELECT FROM idem_record) OR EXISTS (SELECT FROM idem_result)) THEN
		RAISE EXCEPTION 'idempotency records cannot be colocated with % while there are records', colocate_with
			USING ERRCODE = '55006',
				  DETAIL = 'A record made without a tenant has no place among the tenant''s rows.',
				  HINT = 'Colocate before the first claim, or distribute by key: idem_distribute().';
	END IF;
	PERFORM idem_distribute_node(tenant);
	PERFORM idem_distribute_workers(tenant);
	by_column := CASE WHEN tenant IS NULL THEN 'key' ELSE 'tenant' END;
	PERFORM create_distributed_table('idem_record', by_column,
									 colocate_with => coalesce(colocate_with::text, 'default'));
	PERFORM create_distributed_table('idem_result', by_column,
									 colocate_with => 'idem_record');
	PERFORM truncate_local_data_after_distributing_table('idem_record');
	PERFORM truncate_local_data_after_distributing_table('idem_result');
	IF tenant IS NULL THEN
		FOR fn IN SELECT unnest(ARRAY[
			'idem_begin(text, text, bytea, text, interval, interval, text, interval)',
			'idem_finish(text, text, int8, jsonb)',
			'idem_abort(text, text, int8)',
			'idem_renew(text, text, int8, interval)',
			'idem_checkpoint(text, text, int8, jsonb)',
			'idem_inspect(text, text)',
			'idem_forget(text, text, name, bool)']::regprocedure[])
		LOOP
			PERFORM create_distributed_function(fn, '$2', colocate_with => 'idem_record',
												force_delegation => true);
		END LOOP;
	ELSE
		FOR fn IN SELECT idem_tenant_functions(tenant) LOOP
			PERFORM create_distributed_function(fn, '$1', colocate_with => 'idem_record',
												force_delegation => true);
		END LOOP;
	END IF;
	RETURN true;
END
$idem_distribute$;

REVOKE ALL ON FUNCTION @extschema@.idem_distribute(pg_catalog.regclass) FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.idem_distribute_node(pg_catalog.regtype) FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.idem_distribute_workers(pg_catalog.regtype) FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.idem_create_tenant_functions(pg_catalog.regtype) FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.idem_tenant_functions(pg_catalog.regtype) FROM PUBLIC;
