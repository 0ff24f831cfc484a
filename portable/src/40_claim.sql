/*
 * 40_claim.sql: the claim logic -- idem_begin, idem_finish, idem_abort,
 * idem_renew, idem_checkpoint and idem_forget -- with the rules and the
 * errors of the C edition (src/claim.c):
 *
 *	absent or expired			claim it: status 'new' with a fresh token, or
 *								'recover' when it takes over a claim that
 *								has a checkpoint
 *	live, other fingerprint		IK422
 *	pending, ours				IK409 (a transaction never waits on itself)
 *	pending, another's			raise: IK409; wait: sleep until its finish,
 *								abort, rollback or lease end, then look again
 *	completed					'replay' -- or 40001 when a REPEATABLE READ
 *								snapshot cannot see that result
 *	completed, past its ttl		IK410
 *	but remembered
 *
 * Every function runs with the caller's rights: the calling role is the
 * records' namespace, and row-level security keeps it to its own rows.
 * The functions that look a key up have enable_seqscan off: PL/pgSQL keeps
 * a statement's generic plan, made when the table was small, and a
 * sequential scan chosen then would make a batch that claims and finishes
 * many keys in one transaction quadratic (12,000 keys: 89 s; with the
 * primary key always: 3 s).
 * No lock is held per key until commit (a transaction may claim any
 * number of keys); how waiting works is in 30_wait.sql.
 */

/* ---- errors ---- */

/* A fingerprint for a message: hex, whole up to 64 bytes, cut beyond */
CREATE FUNCTION @extschema@._idem_fingerprint_text(fp pg_catalog.bytea)
RETURNS pg_catalog.text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
	SELECT CASE
		WHEN fp IS NULL THEN 'NULL'
		WHEN length(fp) > 64
		THEN '\x' || encode(substr(fp, 1, 64), 'hex') || format('... (%s bytes)', length(fp))
		ELSE '\x' || encode(fp, 'hex') END
$$;

/* A time for a message, in ISO form whatever DateStyle is (as the C edition's) */
CREATE FUNCTION @extschema@._idem_time_text(t pg_catalog.timestamptz)
RETURNS pg_catalog.text
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
	SELECT regexp_replace(to_char(t, 'YYYY-MM-DD HH24:MI:SS.US'), '\.?0+$', '') || to_char(t, 'OF')
$$;

CREATE FUNCTION @extschema@._idem_check_fingerprint(key pg_catalog.text, stored pg_catalog.bytea,
													fingerprint pg_catalog.bytea)
RETURNS void
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, @extschema@, pg_temp
AS $_idem_check_fingerprint$
BEGIN
	IF stored IS NOT DISTINCT FROM fingerprint THEN
		RETURN;
	END IF;
	RAISE EXCEPTION 'idempotency key "%" was already used for a different request', key
		USING ERRCODE = 'IK422',
			  DETAIL = format('Stored fingerprint: %s. Request fingerprint: %s.',
							  _idem_fingerprint_text(stored), _idem_fingerprint_text(fingerprint)),
			  HINT = 'Use a new key for a new request.';
END
$_idem_check_fingerprint$;

CREATE FUNCTION @extschema@._idem_raise_in_progress(operation pg_catalog.text, key pg_catalog.text,
													ours pg_catalog.bool)
RETURNS void
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $_idem_raise_in_progress$
BEGIN
	IF ours THEN
		RAISE EXCEPTION 'request with idempotency key "%" is already in progress', key
			USING ERRCODE = 'IK409',
				  DETAIL = format('This transaction already holds the key for operation "%s".', operation);
	END IF;
	RAISE EXCEPTION 'request with idempotency key "%" is already in progress', key
		USING ERRCODE = 'IK409',
			  DETAIL = format('Another attempt holds the key for operation "%s".', operation),
			  HINT = 'Retry after the other attempt has finished.';
END
$_idem_raise_in_progress$;

/*
 * IK412 for a token that does not hold the key; the DETAIL says what the
 * key's record shows, looked up once more for the message
 */
CREATE FUNCTION @extschema@._idem_raise_stale_token(operation pg_catalog.text, key pg_catalog.text,
													token pg_catalog.int8)
RETURNS void
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, @extschema@, pg_temp
SET enable_seqscan = off
AS $_idem_raise_stale_token$
DECLARE
	r record;
	detail text;
BEGIN
	SELECT t.token, t.completed_at INTO r FROM idem_record t
	 WHERE t.role_id OPERATOR(pg_catalog.=) quote_ident(current_user)::regrole
	   AND t.operation = _idem_raise_stale_token.operation
	   AND t.key = _idem_raise_stale_token.key;
	IF NOT FOUND THEN
		detail := format('Role "%s" has no record of operation "%s" with this key: '
						 'the claim was aborted, rolled back or purged after it expired, '
						 'or the token was never issued for this key.',
						 current_user, operation);
	ELSIF r.token > token THEN
		detail := format('The key is held by a claim with a greater token, now %s: '
						 'this token''s claim was taken over after its lease lapsed, or was aborted, '
						 'or the token was never issued for this key.',
						 CASE WHEN r.completed_at IS NULL THEN 'pending' ELSE 'completed' END);
	ELSIF r.token < token THEN
		detail := 'The key''s record has a smaller token: '
				  'this token was never issued for this key, '
				  'or the transaction that claimed the key with it rolled back.';
	ELSIF r.completed_at IS NOT NULL THEN
		detail := 'The claim was finished already: its response is stored.';
	ELSE
		/* the caller's write matched nothing, yet the record is as it wants */
		PERFORM _idem_check_skipped(key, 'UPDATE');
		detail := 'The claim was changed by a concurrent transaction.';
	END IF;
	RAISE EXCEPTION 'token % does not hold idempotency key "%"', token, key
		USING ERRCODE = 'IK412', DETAIL = detail;
END
$_idem_raise_stale_token$;

/*
 * 09000 when a write of idem_record found nothing to write although the
 * row is there, and a BEFORE ROW trigger for the event ('INSERT', 'UPDATE'
 * or 'DELETE') is on the table: the trigger skipped it (returned NULL).
 * Reporting a claim or a result that was not written is how a second
 * effect happens.  Without such a trigger it returns: the row changed
 * meanwhile, and the caller looks again.
 */
CREATE FUNCTION @extschema@._idem_check_skipped(key pg_catalog.text, event pg_catalog.text)
RETURNS void
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, @extschema@, pg_temp
AS $_idem_check_skipped$
BEGIN
	/* tgtype: 1 row, 2 before, 4 insert, 8 delete, 16 update */
	IF EXISTS (SELECT FROM pg_trigger g
				WHERE g.tgrelid = 'idem_record'::regclass AND NOT g.tgisinternal
				  AND g.tgenabled <> 'D' AND g.tgtype & 3 = 3
				  AND g.tgtype & CASE event WHEN 'INSERT' THEN 4 WHEN 'DELETE' THEN 8 ELSE 16 END <> 0) THEN
		RAISE EXCEPTION 'a trigger on table "idem_record" skipped the write of idempotency key "%"', key
			USING ERRCODE = '09000',
				  DETAIL = 'A BEFORE ROW trigger on the table returned NULL or changed the extension''s columns; nothing was recorded.',
				  HINT = 'Triggers on the idempotency tables must return the row they are given, with the extension''s columns unchanged.';
	END IF;
END
$_idem_check_skipped$;

/* 22023 for a lease longer than the ttl, showing both */
CREATE FUNCTION @extschema@._idem_raise_lease_over_ttl(lease pg_catalog.int8, ttl pg_catalog.interval)
RETURNS void
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $_idem_raise_lease_over_ttl$
BEGIN
	RAISE EXCEPTION 'idempotency lease must not be longer than its ttl'
		USING ERRCODE = '22023',
			  DETAIL = format('The lease is %s and the ttl is %s.',
							  make_interval(secs => lease / 1000000.0), ttl);
END
$_idem_raise_lease_over_ttl$;

/*
 * A record's state as idem_begin takes it: pending, lapsed (the next claim
 * takes it over), completed, remembered or expired.  mine: this
 * transaction wrote it.
 */
CREATE FUNCTION @extschema@._idem_state(completed_at pg_catalog.timestamptz,
										expires_at pg_catalog.timestamptz,
										forget_at pg_catalog.timestamptz,
										holder pg_catalog.int8, mine pg_catalog.bool,
										now pg_catalog.timestamptz)
RETURNS pg_catalog.text
LANGUAGE sql STABLE
SET search_path = pg_catalog, @extschema@, pg_temp
AS $$
	SELECT CASE
		WHEN completed_at IS NULL THEN
			CASE WHEN mine THEN 'pending'
				 WHEN expires_at <= now THEN 'lapsed'
				 /* whether its session lives only the primary can tell */
				 WHEN holder IS NOT NULL AND pg_is_in_recovery() THEN 'unknown'
				 WHEN holder IS NOT NULL AND NOT _idem_session_alive(holder) THEN 'lapsed'
				 ELSE 'pending' END
		WHEN expires_at > now THEN 'completed'
		WHEN forget_at > now THEN 'remembered'
		ELSE 'expired' END
$$;

/* Insert a claim of an absent key; NULL when a record is there (committed meanwhile) */
CREATE FUNCTION @extschema@._idem_insert_claim(me pg_catalog.regrole, op pg_catalog.text,
	k pg_catalog.text, fp pg_catalog.bytea, ttl_iv pg_catalog.interval,
	now pg_catalog.timestamptz, lease_iv pg_catalog.interval, take pg_catalog.text,
	remember_iv pg_catalog.interval)
RETURNS pg_catalog.int8
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, @extschema@, pg_temp
AS $$
	INSERT INTO idem_record AS t
		(role_id, operation, key, token, fingerprint, ttl, created_at,
		 expires_at, holder, forget_at, waker, writer)
	VALUES (me, op, k, nextval('idem_token_seq'), fp, ttl_iv, now,
			now + lease_iv,
			CASE WHEN take = 'session' THEN _idem_session_holder() END,
			now + remember_iv,
			pg_backend_pid(), pg_current_xact_id())
	ON CONFLICT DO NOTHING
	RETURNING t.token
$$;

/* ---- idem_begin ---- */

/*
 * idem_begin's arguments in full, as the C edition checks them before it
 * looks at the key: the names and the fingerprint, then each option from
 * its argument or else its setting, then the transaction.  Returns the
 * options; raises what is wrong.
 */
CREATE FUNCTION @extschema@._idem_begin_options(
	op pg_catalog.text, k pg_catalog.text, fp pg_catalog.bytea,
	in_flight pg_catalog.text, lease pg_catalog.interval, ttl pg_catalog.interval,
	takeover pg_catalog.text, remember pg_catalog.interval,
	OUT policy pg_catalog.text, OUT take pg_catalog.text, OUT lease_iv pg_catalog.interval,
	OUT ttl_iv pg_catalog.interval, OUT remember_iv pg_catalog.interval)
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, @extschema@, pg_temp
AS $_idem_begin_options$
DECLARE
	lease_us bigint;
	ttl_us bigint;
	remember_us bigint;
BEGIN
	PERFORM _idem_check_name(op, 'operation'), _idem_check_name(k, 'key');
	IF length(fp) > 1024 THEN
		RAISE EXCEPTION 'argument "%" is too long', 'fingerprint'
			USING ERRCODE = '22023',
				  DETAIL = format('It has %s bytes; at most %s are allowed.', length(fp), 1024),
				  HINT = 'Pass a hash of the request, such as idem_fingerprint(...).';
	END IF;
	policy := lower(in_flight);
	IF policy IS NULL THEN
		policy := coalesce(_idem_setting_word('idempotency.in_flight', '{wait,raise}'), 'wait');
	ELSIF policy NOT IN ('wait', 'raise') THEN
		RAISE EXCEPTION 'unknown in_flight policy "%"', in_flight
			USING ERRCODE = '22023', HINT = 'Use ''wait'' or ''raise''.';
	END IF;
	take := lower(takeover);
	IF take IS NULL THEN
		take := coalesce(_idem_setting_word('idempotency.takeover', '{lease,session}'), 'lease');
	ELSIF take NOT IN ('lease', 'session') THEN
		RAISE EXCEPTION 'unknown takeover policy "%"', takeover
			USING ERRCODE = '22023', HINT = 'Use ''lease'' or ''session''.';
	END IF;
	IF lease IS NOT NULL THEN
		lease_us := _idem_usecs(lease, 'lease');
	ELSIF nullif(current_setting('idempotency.lease', true), '') IS NULL THEN
		lease_us := 30000000;
	ELSE
		lease_us := _idem_setting_number('idempotency.lease', 'ms', 1000, 2147483647000);
	END IF;
	IF ttl IS NOT NULL THEN
		ttl_iv := ttl;
		ttl_us := _idem_usecs(ttl, 'ttl');
	ELSIF nullif(current_setting('idempotency.ttl', true), '') IS NULL THEN
		ttl_iv := interval '24 hours';
		ttl_us := 86400000000;
	ELSE
		ttl_us := _idem_setting_number('idempotency.ttl', 's', 60000000, 2147483647000000);
		ttl_iv := make_interval(secs => ttl_us / 1000000.0);
	END IF;
	IF remember IS NOT NULL THEN
		remember_us := _idem_usecs(remember, 'remember');
	ELSIF nullif(current_setting('idempotency.remember', true), '') IS NULL THEN
		remember_us := 0;
	ELSE
		remember_us := _idem_setting_number('idempotency.remember', 's', 0, 2147483647000000);
	END IF;
	IF nullif(current_setting('idempotency.max_response_size', true), '') IS NOT NULL THEN
		PERFORM _idem_max_response_size();		/* an invalid one fails every call */
	END IF;
	IF remember_us < 0 THEN
		RAISE EXCEPTION 'idempotency remember must not be negative' USING ERRCODE = '22023';
	END IF;
	IF lease_us <= 0 THEN
		RAISE EXCEPTION 'idempotency lease must be positive' USING ERRCODE = '22023';
	END IF;
	IF ttl_us < 60000000 THEN
		RAISE EXCEPTION 'idempotency ttl must be at least 1 minute' USING ERRCODE = '22023';
	END IF;
	IF lease_us > ttl_us THEN
		PERFORM _idem_raise_lease_over_ttl(lease_us, ttl_iv);
	END IF;
	/* a default shorter than the ttl adds nothing; an argument that says so is an error */
	IF remember_us <> 0 AND remember_us < ttl_us AND remember IS NULL THEN
		remember_us := 0;
	END IF;
	IF remember_us <> 0 AND remember_us < ttl_us THEN
		RAISE EXCEPTION 'idempotency remember must not be shorter than its ttl'
			USING ERRCODE = '22023',
				  DETAIL = 'A key is remembered from its completion, after its response has been kept for the ttl.';
	END IF;
	IF current_setting('transaction_read_only') = 'on' THEN
		PERFORM _idem_check_writable('idem_begin()');
	END IF;
	lease_iv := make_interval(secs => lease_us / 1000000.0);
	remember_iv := CASE WHEN remember_us > 0 THEN make_interval(secs => remember_us / 1000000.0) END;
END
$_idem_begin_options$;

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
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, @extschema@, pg_temp
SET enable_seqscan = off
AS $idem_begin$
DECLARE
	op ALIAS FOR idem_begin.operation;
	k ALIAS FOR idem_begin.key;
	fp ALIAS FOR idem_begin.fingerprint;
	usual bool;
	policy text;				/* these, once the call is checked */
	take text;
	lease_iv interval;
	ttl_iv interval;
	remember_iv interval;
	me regrole;
	r record;
	now timestamptz;
	state text;
	probed bool;
	woke int;
	lock_deadline timestamptz;
	new_token bigint;
	new_checkpoint jsonb;
	saved_lock_timeout text;
BEGIN
	/*
	 * The usual call: no optional argument, no setting, a writable
	 * transaction.  What it leaves out is what must fail even a replay, as
	 * in the C edition.  Its replay needs nothing more than the lookup: a
	 * completed record with this fingerprint vouches for the names and the
	 * fingerprint.  Every other path checks the call in full before it
	 * acts.  (PL/pgSQL builds its expressions anew in every transaction,
	 * some thousand instructions for each function in them: the replay and
	 * the new key evaluate as few as they can.)
	 */
	usual := num_nonnulls(in_flight, lease, ttl, takeover, remember) = 0
			 AND concat(current_setting('idempotency.in_flight', true),
						current_setting('idempotency.takeover', true),
						current_setting('idempotency.lease', true),
						current_setting('idempotency.ttl', true),
						current_setting('idempotency.remember', true),
						current_setting('idempotency.max_response_size', true),
						current_setting('transaction_read_only')) = 'off';
	LOOP
		/*
		 * The role is written as the row-level security policy writes it,
		 * not as the variable me: the planner then takes the two quals for
		 * one, and the policy costs the look-up nothing
		 */
		now := clock_timestamp();
		SELECT t.token, t.fingerprint, t.completed_at, t.expires_at, t.response,
			   t.forget_at, t.holder, t.waker, t.writer, t.xmax::text AS mark
		  INTO r
		  FROM idem_record t
		 WHERE t.role_id OPERATOR(pg_catalog.=) quote_ident(current_user)::regrole
		   AND t.operation = op AND t.key = k;

		IF usual AND r.completed_at IS NOT NULL AND r.expires_at > now
		   AND r.fingerprint IS NOT DISTINCT FROM fp THEN
			RETURN ROW('replay', NULL, r.response)::idem_claim;
		END IF;
		IF policy IS NULL THEN
			/* the call, checked in full once */
			IF usual AND coalesce(char_length(op) BETWEEN 1 AND 255 AND char_length(k) BETWEEN 1 AND 255
								  AND coalesce(length(fp) <= 1024, true), false) THEN
				policy := 'wait';
				take := 'lease';
				lease_iv := interval '30 seconds';
				ttl_iv := interval '24 hours';
			ELSE
				SELECT o.policy, o.take, o.lease_iv, o.ttl_iv, o.remember_iv
				  INTO policy, take, lease_iv, ttl_iv, remember_iv
				  FROM _idem_begin_options(op, k, fp, in_flight, lease, ttl, takeover, remember) o;
			END IF;
			me := quote_ident(current_user)::regrole;
			probed := false;
			woke := 1;
		END IF;

		IF r.token IS NULL THEN
			/*
			 * Absent (the look found no row): insert.  A transaction
			 * inserting the same key makes the insert wait for its end
			 * (raise: at most a millisecond, then IK409); a committed record
			 * makes it do nothing: look again.  Under REPEATABLE READ a
			 * record committed after the snapshot is a serialization
			 * failure.
			 */
			IF policy = 'wait' AND current_setting('transaction_isolation') = 'read committed' THEN
				INSERT INTO idem_record AS t
					(role_id, operation, key, token, fingerprint, ttl, created_at,
					 expires_at, holder, forget_at, waker, writer)
				VALUES (me, op, k, nextval('idem_token_seq'), fp, ttl_iv, now,
						now + lease_iv,
						CASE WHEN take = 'session' THEN _idem_session_holder() END,
						now + remember_iv,
						pg_backend_pid(), pg_current_xact_id())
				ON CONFLICT DO NOTHING
				RETURNING t.token INTO new_token;
			ELSE
				saved_lock_timeout := current_setting('lock_timeout');
				BEGIN
					IF policy = 'raise' THEN
						PERFORM set_config('lock_timeout', '1', true);
					END IF;
					new_token := _idem_insert_claim(me, op, k, fp, ttl_iv, now, lease_iv, take, remember_iv);
					PERFORM set_config('lock_timeout', saved_lock_timeout, true);
				EXCEPTION
					WHEN lock_not_available THEN
						PERFORM _idem_raise_in_progress(op, k, false);
					WHEN serialization_failure THEN
						RAISE EXCEPTION 'could not serialize access due to a concurrent request with idempotency key "%"', k
							USING ERRCODE = '40001',
								  DETAIL = 'Its result was committed after this transaction''s snapshot was taken.',
								  HINT = 'Retry the transaction: the retry will replay the result.';
				END;
			END IF;
			IF new_token IS NULL THEN
				/* nothing inserted: a record committed meanwhile, or a trigger */
				PERFORM FROM idem_record t
				 WHERE t.role_id OPERATOR(pg_catalog.=) me AND t.operation = op AND t.key = k;
				IF NOT FOUND THEN
					PERFORM _idem_check_skipped(k, 'INSERT');
				END IF;
				CONTINUE;
			END IF;
			IF current_setting('idempotency_portable.wake_lock', true) IS DISTINCT FROM pg_backend_pid()::text THEN
				PERFORM _idem_hold_wake_lock();
			END IF;
			RETURN ROW('new', new_token, NULL)::idem_claim;
		END IF;

		/*
		 * The record's state as idem_begin takes it (_idem_state, inline;
		 * 'ours': pending, and this transaction wrote it)
		 */
		state := CASE WHEN r.completed_at IS NOT NULL THEN
						  CASE WHEN r.expires_at > now THEN 'completed'
							   WHEN r.forget_at > now THEN 'remembered'
							   ELSE 'expired' END
					  WHEN r.writer = pg_current_xact_id_if_assigned() THEN 'ours'
					  WHEN r.expires_at <= now THEN 'lapsed'
					  WHEN r.holder IS NOT NULL AND NOT _idem_session_alive(r.holder) THEN 'lapsed'
					  ELSE 'pending' END;
		IF state IN ('pending', 'ours', 'completed') THEN
			IF r.fingerprint IS DISTINCT FROM fp THEN
				PERFORM _idem_check_fingerprint(k, r.fingerprint, fp);
			END IF;
			IF state = 'completed' THEN
				RETURN ROW('replay', NULL, r.response)::idem_claim;
			END IF;
			IF state = 'ours' THEN
				PERFORM _idem_raise_in_progress(op, k, true);
			END IF;
			IF policy = 'raise' THEN
				PERFORM _idem_raise_in_progress(op, k, false);
			END IF;
			/* wait: for a transaction writing it, or for the claim's end */
			IF r.mark <> '0' AND NOT probed THEN
				PERFORM _idem_wait_for_writer(me, op, k);
				probed := true;
				CONTINUE;
			END IF;
			IF lock_deadline IS NULL AND current_setting('lock_timeout') NOT IN ('0', '0ms') THEN
				lock_deadline := now + current_setting('lock_timeout')::interval;
			END IF;
			IF current_setting('transaction_isolation') = 'read committed' THEN
				woke := _idem_wait_for_claim(me, op, k, r.token, r.mark, r.waker, r.expires_at,
											 lock_deadline, _idem_wait_look(), woke = 2);
			ELSE
				/*
				 * No fresh snapshot, so no look through the gate: short after
				 * a look that followed a wake-up, then long; a newer version
				 * is a serialization failure
				 */
				woke := _idem_wait_for_claim(NULL, op, k, r.token, r.mark, r.waker, r.expires_at,
											 lock_deadline,
											 CASE WHEN woke = 1 THEN 0.05 ELSE _idem_wait_look() END,
											 woke = 2);
				PERFORM _idem_wait_for_writer(me, op, k);
			END IF;
			probed := false;
			CONTINUE;
		END IF;

		IF state = 'remembered' THEN
			PERFORM _idem_check_fingerprint(k, r.fingerprint, fp);
			RAISE EXCEPTION 'request with idempotency key "%" was completed, and its stored response has expired', k
				USING ERRCODE = 'IK410',
					  DETAIL = format('It was completed at %s; its response was kept until %s, the key is remembered until %s.',
									  _idem_time_text(r.completed_at), _idem_time_text(r.expires_at),
									  _idem_time_text(r.forget_at)),
					  HINT = 'Do not run the request again; use a new key for a new request.';
		END IF;

		/*
		 * Lapsed or expired: take it over, if it is still the version we
		 * looked at.  An update waits for a transaction writing it (in
		 * either policy, as the C edition does: a purge or a takeover), then
		 * finds the row changed and looks again.
		 */
		UPDATE idem_record t
		   SET token = greatest(nextval('idem_token_seq'), t.token + 1),
			   fingerprint = fp, ttl = ttl_iv, created_at = now, completed_at = NULL,
			   expires_at = now + lease_iv,
			   response = NULL,
			   holder = CASE WHEN take = 'session' THEN _idem_session_holder() END,
			   checkpoint = CASE WHEN t.completed_at IS NULL THEN t.checkpoint END,
			   takeovers = CASE WHEN t.completed_at IS NULL THEN t.takeovers + 1 ELSE 0 END,
			   forget_at = now + remember_iv,
			   waker = pg_backend_pid(), writer = pg_current_xact_id()
		 WHERE t.role_id OPERATOR(pg_catalog.=) me AND t.operation = op AND t.key = k
		   AND t.token = r.token AND t.expires_at = r.expires_at
		   AND t.completed_at IS NOT DISTINCT FROM r.completed_at
		RETURNING t.token, t.checkpoint INTO new_token, new_checkpoint;
		IF NOT FOUND THEN
			/* changed meanwhile: look again; unchanged: a trigger skipped it */
			PERFORM FROM idem_record t
			 WHERE t.role_id OPERATOR(pg_catalog.=) me AND t.operation = op AND t.key = k
			   AND t.token = r.token AND t.expires_at = r.expires_at
			   AND t.completed_at IS NOT DISTINCT FROM r.completed_at;
			IF FOUND THEN
				PERFORM _idem_check_skipped(k, 'UPDATE');
			END IF;
			CONTINUE;
		END IF;
		IF current_setting('idempotency_portable.wake_lock', true) IS DISTINCT FROM pg_backend_pid()::text THEN
			PERFORM _idem_hold_wake_lock();
		END IF;
		RETURN ROW(CASE WHEN new_checkpoint IS NULL THEN 'new' ELSE 'recover' END,
				   new_token, new_checkpoint)::idem_claim;
	END LOOP;
END
$idem_begin$;

/* ---- idem_finish, idem_abort, idem_renew, idem_checkpoint ---- */

CREATE FUNCTION @extschema@.idem_finish(
	operation	pg_catalog.text,
	key			pg_catalog.text,
	token		pg_catalog.int8,
	response	pg_catalog.jsonb)
RETURNS pg_catalog.void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, @extschema@, pg_temp
SET enable_seqscan = off
AS $idem_finish$
DECLARE
	now CONSTANT timestamptz := clock_timestamp();
	w int;
BEGIN
	/*
	 * The usual call in one expression, as in idem_begin: a response within
	 * the default size, no setting, a writable transaction.  Its names are
	 * checked only if the claim is not found: a record vouches for them.
	 */
	IF NOT coalesce(pg_column_size(response) <= 65536 AND octet_length(response::text) <= 65536
					AND concat(current_setting('idempotency.max_response_size', true),
							   current_setting('transaction_read_only')) = 'off', false) THEN
		/* these raise what is wrong: a null, a name out of range, a response too large */
		PERFORM _idem_check_name(operation, 'operation'), _idem_check_name(key, 'key'),
				_idem_require(token IS NULL, 'token'), _idem_check_response(response, 'response');
		IF current_setting('transaction_read_only') = 'on' THEN
			PERFORM _idem_check_writable('idem_finish()');
		END IF;
	END IF;
	/*
	 * The ttl in seconds, a day 86,400 and a month 30 days, as in the C
	 * edition (extract(epoch) counts a year as 365.25 days: 5.25 too many)
	 */
	UPDATE idem_record t
	   SET completed_at = now,
		   expires_at = now + make_interval(secs => extract(epoch FROM t.ttl)
													- extract(year FROM t.ttl) * 453600),
		   response = idem_finish.response, checkpoint = NULL, holder = NULL,
		   forget_at = now + (t.forget_at - t.created_at),
		   writer = pg_current_xact_id()
	 WHERE t.role_id OPERATOR(pg_catalog.=) quote_ident(current_user)::regrole
	   AND t.operation = idem_finish.operation AND t.key = idem_finish.key
	   AND t.token = idem_finish.token AND t.completed_at IS NULL
	RETURNING t.waker INTO w;
	IF NOT FOUND THEN
		PERFORM _idem_check_name(operation, 'operation'), _idem_check_name(key, 'key'),
				_idem_require(token IS NULL, 'token');
		PERFORM _idem_raise_stale_token(operation, key, token);
	END IF;
	IF w = pg_backend_pid() AND current_setting('idempotency_portable.wake_lock', true) = w::text THEN
		/* _idem_wake_waiters, inline: with nobody waiting it costs four lock calls */
		IF NOT (pg_advisory_unlock(1229651969, w) AND pg_try_advisory_lock(1229651970, w)
				AND pg_advisory_unlock(1229651970, w) AND pg_try_advisory_lock(1229651969, w)) THEN
			IF NOT _idem_take_wake_lock() THEN
				PERFORM set_config('idempotency_portable.wake_lock', '', false);
			END IF;
		END IF;
	END IF;
END
$idem_finish$;

CREATE FUNCTION @extschema@.idem_abort(
	operation	pg_catalog.text,
	key			pg_catalog.text,
	token		pg_catalog.int8)
RETURNS pg_catalog.bool
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, @extschema@, pg_temp
SET enable_seqscan = off
AS $idem_abort$
DECLARE
	w int;
BEGIN
	IF operation IS NULL OR key IS NULL OR token IS NULL
	   OR char_length(operation) NOT BETWEEN 1 AND 255 OR char_length(key) NOT BETWEEN 1 AND 255 THEN
		PERFORM _idem_check_name(operation, 'operation'), _idem_check_name(key, 'key'),
				_idem_require(token IS NULL, 'token');
	END IF;
	IF current_setting('transaction_read_only') = 'on' THEN
		PERFORM _idem_check_writable('idem_abort()');
	END IF;
	DELETE FROM idem_record t
	 WHERE t.role_id OPERATOR(pg_catalog.=) quote_ident(current_user)::regrole
	   AND t.operation = idem_abort.operation AND t.key = idem_abort.key
	   AND t.token = idem_abort.token AND t.completed_at IS NULL
	RETURNING t.waker INTO w;
	IF NOT FOUND THEN
		PERFORM FROM idem_record t
		 WHERE t.role_id OPERATOR(pg_catalog.=) quote_ident(current_user)::regrole
		   AND t.operation = idem_abort.operation AND t.key = idem_abort.key
		   AND t.token = idem_abort.token AND t.completed_at IS NULL;
		IF FOUND THEN
			PERFORM _idem_check_skipped(key, 'DELETE');
		END IF;
		RETURN false;
	END IF;
	IF w = pg_backend_pid() THEN
		PERFORM _idem_wake_waiters();
	END IF;
	RETURN true;
END
$idem_abort$;

CREATE FUNCTION @extschema@.idem_renew(
	operation	pg_catalog.text,
	key			pg_catalog.text,
	token		pg_catalog.int8,
	lease		pg_catalog.interval)
RETURNS pg_catalog.timestamptz
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, @extschema@, pg_temp
SET enable_seqscan = off
AS $idem_renew$
DECLARE
	lease_us bigint;
	r record;
BEGIN
	PERFORM _idem_check_name(operation, 'operation'), _idem_check_name(key, 'key'),
			_idem_require(token IS NULL, 'token'), _idem_require(lease IS NULL, 'lease');
	lease_us := _idem_usecs(lease, 'lease');
	IF lease_us <= 0 THEN
		RAISE EXCEPTION 'idempotency lease must be positive' USING ERRCODE = '22023';
	END IF;
	PERFORM _idem_check_writable('idem_renew()');
	SELECT t.ttl INTO r FROM idem_record t
	 WHERE t.role_id OPERATOR(pg_catalog.=) quote_ident(current_user)::regrole
	   AND t.operation = idem_renew.operation AND t.key = idem_renew.key
	   AND t.token = idem_renew.token AND t.completed_at IS NULL;
	IF FOUND AND lease_us > _idem_usecs(r.ttl, 'ttl') THEN
		PERFORM _idem_raise_lease_over_ttl(lease_us, r.ttl);
	END IF;
	UPDATE idem_record t
	   SET expires_at = clock_timestamp() + make_interval(secs => lease_us / 1000000.0),
		   writer = pg_current_xact_id()
	 WHERE t.role_id OPERATOR(pg_catalog.=) quote_ident(current_user)::regrole
	   AND t.operation = idem_renew.operation AND t.key = idem_renew.key
	   AND t.token = idem_renew.token AND t.completed_at IS NULL
	RETURNING t.expires_at, t.waker INTO r;
	IF NOT FOUND THEN
		PERFORM _idem_raise_stale_token(operation, key, token);
	END IF;
	/* a duplicate asleep on the claim sleeps until the old lease end: wake it to look again */
	IF r.waker = pg_backend_pid() THEN
		PERFORM _idem_wake_waiters();
	END IF;
	RETURN r.expires_at;
END
$idem_renew$;

CREATE FUNCTION @extschema@.idem_checkpoint(
	operation	pg_catalog.text,
	key			pg_catalog.text,
	token		pg_catalog.int8,
	state		pg_catalog.jsonb)
RETURNS pg_catalog.void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, @extschema@, pg_temp
SET enable_seqscan = off
AS $idem_checkpoint$
BEGIN
	PERFORM _idem_check_name(operation, 'operation'), _idem_check_name(key, 'key'),
			_idem_require(token IS NULL, 'token'), _idem_check_response(state, 'state'),
			_idem_check_writable('idem_checkpoint()');
	UPDATE idem_record t
	   SET checkpoint = idem_checkpoint.state, writer = pg_current_xact_id()
	 WHERE t.role_id OPERATOR(pg_catalog.=) quote_ident(current_user)::regrole
	   AND t.operation = idem_checkpoint.operation AND t.key = idem_checkpoint.key
	   AND t.token = idem_checkpoint.token AND t.completed_at IS NULL;
	IF NOT FOUND THEN
		PERFORM _idem_raise_stale_token(operation, key, token);
	END IF;
END
$idem_checkpoint$;

GRANT EXECUTE ON FUNCTION
	@extschema@.idem_begin(pg_catalog.text, pg_catalog.text, pg_catalog.bytea,
						   pg_catalog.text, pg_catalog.interval, pg_catalog.interval,
						   pg_catalog.text, pg_catalog.interval),
	@extschema@.idem_finish(pg_catalog.text, pg_catalog.text, pg_catalog.int8, pg_catalog.jsonb),
	@extschema@.idem_abort(pg_catalog.text, pg_catalog.text, pg_catalog.int8),
	@extschema@.idem_renew(pg_catalog.text, pg_catalog.text, pg_catalog.int8, pg_catalog.interval),
	@extschema@.idem_checkpoint(pg_catalog.text, pg_catalog.text, pg_catalog.int8, pg_catalog.jsonb)
TO PUBLIC;
