/*
 * 60_admin.sql: administration -- idem_purge, idem_forget and the
 * durability modes this edition has.  Not granted to PUBLIC; they run with
 * the extension owner's rights (the table's owner passes row-level
 * security), their search_path pinned.
 */

/*
 * Delete up to max_rows expired records, as the C edition does: skipping
 * records other transactions are working on, keeping a lapsed claim with a
 * checkpoint for its ttl, and a remembered key (its response dropped)
 * until the end of remembering.
 */
CREATE FUNCTION @extschema@.idem_purge(max_rows pg_catalog.int4 DEFAULT 10000)
RETURNS pg_catalog.int8
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, @extschema@, pg_temp
AS $idem_purge$
DECLARE
	deleted bigint;
BEGIN
	PERFORM _idem_require(max_rows IS NULL, 'max_rows');
	IF max_rows < 1 THEN
		RAISE EXCEPTION 'argument "%" must be positive', 'max_rows' USING ERRCODE = '22023';
	END IF;
	DELETE FROM idem_record
	 WHERE ctid = ANY (ARRAY(
		SELECT t.ctid FROM idem_record t
		 WHERE t.expires_at <= clock_timestamp()
		   AND CASE WHEN t.completed_at IS NULL
					THEN t.checkpoint IS NULL OR t.created_at + t.ttl <= clock_timestamp()
					ELSE t.forget_at IS NULL OR t.forget_at <= clock_timestamp()
			   END
		 LIMIT max_rows FOR UPDATE SKIP LOCKED));
	GET DIAGNOSTICS deleted = ROW_COUNT;
	IF deleted < max_rows THEN
		UPDATE idem_record SET response = NULL
		 WHERE ctid = ANY (ARRAY(
			SELECT t.ctid FROM idem_record t
			 WHERE t.expires_at <= clock_timestamp()
			   AND t.completed_at IS NOT NULL AND t.response IS NOT NULL
			   AND t.forget_at > clock_timestamp()
			 LIMIT max_rows - deleted FOR UPDATE SKIP LOCKED));
	END IF;
	RETURN deleted;
END
$idem_purge$;

/*
 * Delete one role's record of a key on purpose (a support team's way out of
 * a stored response that is wrong); returns the state it was in, or NULL
 */
CREATE FUNCTION @extschema@.idem_forget(
	operation	pg_catalog.text,
	key			pg_catalog.text,
	role		pg_catalog.name DEFAULT CURRENT_USER,
	force		pg_catalog.bool DEFAULT false)
RETURNS pg_catalog.text
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, @extschema@, pg_temp
SET enable_seqscan = off
AS $idem_forget$
DECLARE
	rid regrole;
	r record;
	state text;
BEGIN
	PERFORM _idem_require(idem_forget.role IS NULL, 'role'),
			_idem_require(idem_forget.force IS NULL, 'force'),
			_idem_check_name(idem_forget.operation, 'operation'),
			_idem_check_name(idem_forget.key, 'key'),
			_idem_check_writable('idem_forget()');
	SELECT a.oid::regrole INTO rid FROM pg_roles a WHERE a.rolname = idem_forget.role;
	IF rid IS NULL THEN
		RAISE EXCEPTION 'role "%" does not exist', idem_forget.role USING ERRCODE = '42704';
	END IF;
	SELECT t.token, t.completed_at, t.expires_at, t.forget_at, t.holder, t.waker,
		   t.xmax::text <> '0' AS busy
	  INTO r FROM idem_record t
	 WHERE t.role_id OPERATOR(pg_catalog.=) rid
	   AND t.operation = idem_forget.operation AND t.key = idem_forget.key;
	IF NOT FOUND THEN
		RETURN NULL;
	END IF;
	PERFORM FROM idem_record t
	 WHERE t.role_id OPERATOR(pg_catalog.=) rid
	   AND t.operation = idem_forget.operation AND t.key = idem_forget.key
	   FOR UPDATE SKIP LOCKED;
	IF NOT FOUND THEN
		RAISE EXCEPTION 'idempotency key "%" is being written by another transaction', idem_forget.key
			USING ERRCODE = 'IK409', HINT = 'Forget it once that transaction has ended.';
	END IF;
	/* the version we locked (newer than the one looked at if it changed meanwhile) */
	SELECT t.token, t.completed_at, t.expires_at, t.forget_at, t.holder, t.waker
	  INTO r FROM idem_record t
	 WHERE t.role_id OPERATOR(pg_catalog.=) rid
	   AND t.operation = idem_forget.operation AND t.key = idem_forget.key;
	state := _idem_state(r.completed_at, r.expires_at, r.forget_at, r.holder, false,
						 clock_timestamp());
	IF state = 'pending' AND NOT force THEN
		RAISE EXCEPTION 'idempotency key "%" is held by a live attempt', idem_forget.key
			USING ERRCODE = 'IK409',
				  DETAIL = format('Its claim (token %s) is pending until %s.', r.token, _idem_time_text(r.expires_at)),
				  HINT = 'Pass force => true to forget it anyway: the attempt''s finish then fails with IK412.';
	END IF;
	DELETE FROM idem_record t
	 WHERE t.role_id OPERATOR(pg_catalog.=) rid
	   AND t.operation = idem_forget.operation AND t.key = idem_forget.key;
	IF r.waker = pg_backend_pid() THEN
		PERFORM _idem_wake_waiters();
	END IF;
	RETURN state;
END
$idem_forget$;

/* The durability mode: 'all' (logged, the default here) or 'none' (unlogged) */
CREATE FUNCTION @extschema@.idem_durability()
RETURNS pg_catalog.text
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, @extschema@, pg_temp
AS $$
	SELECT CASE c.relpersistence WHEN 'p' THEN 'all' ELSE 'none' END
	  FROM pg_class c WHERE c.oid = 'idem_record'::regclass
$$;

/*
 * Switch the mode by rewriting the table (ALTER TABLE SET LOGGED /
 * UNLOGGED), holding every call up meanwhile.  'completed' needs the C
 * edition's second table.
 */
CREATE FUNCTION @extschema@.idem_set_durability(mode pg_catalog.text)
RETURNS pg_catalog.void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, @extschema@, pg_temp
AS $idem_set_durability$
BEGIN
	PERFORM _idem_require(mode IS NULL, 'mode');
	CASE lower(mode)
		WHEN 'all' THEN
			IF idem_durability() <> 'all' THEN
				ALTER TABLE idem_record SET LOGGED;
			END IF;
		WHEN 'none' THEN
			IF idem_durability() <> 'none' THEN
				ALTER TABLE idem_record SET UNLOGGED;
			END IF;
		WHEN 'completed' THEN
			PERFORM _idem_unavailable('idem_set_durability(''completed'')',
				'Mode ''completed'' keeps pending claims in an unlogged table and completed records in a logged one; this edition has one table, logged (''all'') or not (''none'').');
		ELSE
			RAISE EXCEPTION 'unknown durability mode "%"', mode
				USING ERRCODE = '22023', HINT = 'Use ''none'', ''completed'' or ''all''.';
	END CASE;
END
$idem_set_durability$;

CREATE FUNCTION @extschema@.idem_set_logged(logged pg_catalog.bool)
RETURNS pg_catalog.void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, @extschema@, pg_temp
AS $idem_set_logged$
BEGIN
	PERFORM _idem_require(logged IS NULL, 'logged');
	PERFORM idem_set_durability(CASE WHEN logged THEN 'all' ELSE 'none' END);
END
$idem_set_logged$;

REVOKE ALL ON FUNCTION
	@extschema@.idem_purge(pg_catalog.int4),
	@extschema@.idem_forget(pg_catalog.text, pg_catalog.text, pg_catalog.name, pg_catalog.bool),
	@extschema@.idem_durability(),
	@extschema@.idem_set_durability(pg_catalog.text),
	@extschema@.idem_set_logged(pg_catalog.bool)
FROM PUBLIC;
