/*
 * 30_wait.sql: waiting for another attempt, and the sessions of
 * takeover => 'session' claims.
 *
 * Three kinds of waiting, all of them on a lock, none of them polling for
 * the common cases:
 *
 *	Uncommitted claim	idem_begin inserts with ON CONFLICT DO NOTHING: an
 *						insert of the same key by a transaction in progress
 *						makes it wait on that transaction (the unique
 *						index's wait), which wakes it at its commit or
 *						rollback.
 *	A version being		idem_begin locks the row FOR SHARE in a
 *	written				subtransaction that it then rolls back: it sleeps on
 *						the writer's transaction and keeps no lock.
 *	Committed claim		Held by no transaction.  Every backend that makes a
 *						claim holds, at session level, one exclusive advisory
 *						lock on its own "wake" key (classid 0x494B0001,
 *						objid its process ID): one lock per session,
 *						however many claims.  A duplicate waits for a share
 *						lock on the claiming backend's wake key, with
 *						lock_timeout at the lease end, in a subtransaction
 *						that it then rolls back (a transaction lock: an
 *						error at the moment it is granted leaves nothing
 *						held); idem_finish and idem_abort on that backend
 *						release the lock, which hands it to the waiters,
 *						and take it back.
 *
 * The "gate" (classid 0x494B0002, objid the claiming backend's process ID)
 * closes the race between a duplicate's look at the claim and its lock
 * request: the duplicate holds the gate in share mode from before that look
 * until its wait ends, and a finish, after releasing its wake lock, takes
 * the gate in exclusive mode and lets it go before it takes the wake lock
 * back.  So a duplicate either looked after the finish wrote the row (and
 * sees it written), or asks for the wake lock before the finish takes it
 * back (and is granted it at once): nothing waits on a claim that was
 * finished before it asked, and no duplicate needs a short first wait.
 * A finish waits at the gate for at most 0.5 s (a duplicate stopped there
 * must not hold it up; that duplicate may then see the finish only at its
 * next look).
 *
 * What PL/pgSQL cannot do: wake a waiter from another backend.  A claim
 * finished or aborted on another connection than the one that made it
 * (a transaction pool) is seen by its waiters at the next look, at most
 * _idem_wait_look() seconds later; so is a claim whose backend no longer
 * holds its wake lock (DISCARD ALL released it).  Under REPEATABLE READ a
 * duplicate's look sees its snapshot, not the finish: there a first wait
 * of 0.05 s, then a look that finds a newer version (40001), closes the
 * race.
 *
 * A 'session' claim's holder is alive while a backend with its process ID
 * and start time runs (pg_stat_get_activity); where the start time is not
 * visible to the caller (another login role's backend), while a backend
 * with its process ID runs.  Neither DISCARD ALL, RESET, a role change nor
 * a cancelled call ends it: only finishing or aborting does, or the
 * session's end.  A waiter on such a claim waits on the holder's wake
 * lock, which the session's end releases.
 */

/*
 * The longest a waiter sleeps between two looks at a claim, in seconds:
 * what a finish on another connection can cost a waiter, against the CPU
 * that looking costs (50 waiters looking every second: 0.3 CPU-s in 5 s
 * here)
 */
CREATE FUNCTION @extschema@._idem_wait_look()
RETURNS pg_catalog.float8
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS 'SELECT 10.0::pg_catalog.float8';

/* classid of the wake locks ('I','K', 0, 1); the gates' is 1229651970 ('I','K', 0, 2) */
CREATE FUNCTION @extschema@._idem_wake_class()
RETURNS pg_catalog.int4
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS 'SELECT 1229651969';

/*
 * Hold this backend's wake lock.  A session setting remembers that it is
 * held (idempotency_portable.wake_lock: the prefix idempotency is the C
 * edition's, which reserves it where its library is loaded), so that the lock table is looked at only at a session's first
 * claim, after DISCARD ALL (which releases the lock and resets the
 * setting) or after a rollback undid the setting.
 */
CREATE FUNCTION @extschema@._idem_hold_wake_lock()
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, @extschema@, pg_temp
AS $_idem_hold_wake_lock$
DECLARE
	me CONSTANT int := pg_backend_pid();
BEGIN
	IF current_setting('idempotency_portable.wake_lock', true) = me::text THEN
		RETURN;
	END IF;
	IF EXISTS (SELECT FROM pg_locks l
				WHERE l.locktype = 'advisory' AND l.pid = me
				  AND l.classid = _idem_wake_class()::oid AND l.objid = me::oid
				  AND l.objsubid = 2 AND l.mode = 'ExclusiveLock' AND l.granted)
	   OR _idem_take_wake_lock() THEN
		PERFORM set_config('idempotency_portable.wake_lock', me::text, false);
	END IF;
END
$_idem_hold_wake_lock$;

/*
 * Take this backend's wake lock, after passing its gate (see above): wait a
 * moment for the duplicates that hold the gate or the wake lock in share
 * mode to let them go (they do at once; one that never did must not hold
 * up a claim or a finish: then the lock is taken at a later call, and
 * duplicates meanwhile look again every _idem_wait_look() seconds).
 */
CREATE FUNCTION @extschema@._idem_take_wake_lock()
RETURNS pg_catalog.bool
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, @extschema@, pg_temp
AS $_idem_take_wake_lock$
DECLARE
	me CONSTANT int := pg_backend_pid();
	saved CONSTANT text := current_setting('lock_timeout');
BEGIN
	IF pg_try_advisory_lock(1229651970, me) THEN
		PERFORM pg_advisory_unlock(1229651970, me);
	ELSE
		/* a transaction lock, undone with the subtransaction, whatever ends the wait */
		BEGIN
			PERFORM set_config('lock_timeout', '500', true);
			PERFORM pg_advisory_xact_lock(1229651970, me);
			RAISE EXCEPTION USING ERRCODE = 'IK000';
		EXCEPTION
			WHEN SQLSTATE 'IK000' THEN
				NULL;			/* passed */
			WHEN lock_not_available THEN
				NULL;			/* a duplicate that holds the gate may miss this finish */
		END;
	END IF;
	IF pg_try_advisory_lock(_idem_wake_class(), me) THEN
		RETURN true;
	END IF;
	BEGIN
		PERFORM set_config('lock_timeout', '1000', true);
		PERFORM pg_advisory_lock(_idem_wake_class(), me);
		PERFORM set_config('lock_timeout', saved, true);
	EXCEPTION WHEN lock_not_available THEN
		RETURN false;			/* (the setting is restored with the subtransaction) */
	END;
	RETURN true;
END
$_idem_take_wake_lock$;

/*
 * Wake the backends waiting on this backend's claims: release the wake lock,
 * which grants it to them, pass the gate, and take the wake lock back
 * (after they let both go, which they do at once).
 */
CREATE FUNCTION @extschema@._idem_wake_waiters()
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, @extschema@, pg_temp
AS $_idem_wake_waiters$
DECLARE
	me CONSTANT int := pg_backend_pid();
BEGIN
	IF current_setting('idempotency_portable.wake_lock', true) = me::text THEN
		IF NOT (pg_advisory_unlock(1229651969, me) AND pg_try_advisory_lock(1229651970, me)
				AND pg_advisory_unlock(1229651970, me) AND pg_try_advisory_lock(1229651969, me)) THEN
			IF NOT _idem_take_wake_lock() THEN
				PERFORM set_config('idempotency_portable.wake_lock', '', false);
			END IF;
		END IF;
	END IF;
END
$_idem_wake_waiters$;

/* This session's holder number for a 'session' claim (as the C edition's) */
CREATE FUNCTION @extschema@._idem_session_holder()
RETURNS pg_catalog.int8
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
	SELECT (pg_backend_pid()::int8 << 32)
		   | coalesce(((extract(epoch FROM a.backend_start) - 946684800) * 1000000)::int8
					  & 4294967295, 0)
	  FROM pg_stat_get_activity(pg_backend_pid()) a
$$;

/* Is the session that made a 'session' claim still connected? */
CREATE FUNCTION @extschema@._idem_session_alive(holder pg_catalog.int8)
RETURNS pg_catalog.bool
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
	SELECT EXISTS (
		SELECT FROM pg_stat_get_activity((holder >> 32)::int4) a
		 WHERE a.pid = (holder >> 32)::int4
		   AND (a.backend_start IS NULL OR holder & 4294967295 = 0
				OR ((extract(epoch FROM a.backend_start) - 946684800) * 1000000)::int8
				   & 4294967295 = holder & 4294967295))
$$;

/*
 * Sleep until the backend waker finishes or aborts one of its claims,
 * ends, or until "until" (the lease end), whichever comes first, and at
 * most "most" seconds.  lock_deadline (NULL: none) is when lock_timeout
 * ends for the calling idem_begin.  The caller looked at the calling
 * role's record of (operation, key) and found it pending with this token,
 * waker and lease end, and its version's xmax "mark" ('0', or what a
 * writer or locker that has ended left there); this function looks again
 * through the gate (see above) and sleeps only if that is still so.  The
 * mark tells a finish that wrote the version after the caller's look but
 * has not committed (it passed the gate before this function took it, and
 * may have taken its wake lock back): its write sets the version's xmax,
 * and then the caller looks again and waits for that transaction
 * (role_id NULL: no look, for REPEATABLE READ, whose snapshot would not
 * see a change).
 * Returns 1 if a wake-up (or the waker's end) ended the sleep or the
 * record changed, 0 if the time is up, 2 if nobody holds the waker's wake
 * lock (the caller looks again at once, and passes free_before = true:
 * then this function sleeps the time out).  The caller looks again
 * afterwards.
 */
CREATE FUNCTION @extschema@._idem_wait_for_claim(role_id pg_catalog.regrole, operation pg_catalog.text,
												 key pg_catalog.text, token pg_catalog.int8,
												 mark pg_catalog.text,
												 waker pg_catalog.int4, until pg_catalog.timestamptz,
												 lock_deadline pg_catalog.timestamptz,
												 most pg_catalog.float8, free_before pg_catalog.bool)
RETURNS pg_catalog.int4
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, @extschema@, pg_temp
SET enable_seqscan = off
AS $_idem_wait_for_claim$
DECLARE
	now CONSTANT timestamptz := clock_timestamp();
	stop timestamptz := least(until, lock_deadline, now + make_interval(secs => most));
	ms bigint;
BEGIN
	IF lock_deadline <= now THEN
		RAISE EXCEPTION 'canceling statement due to lock timeout'
			USING ERRCODE = '55P03',
				  DETAIL = 'Another attempt holds the idempotency key.';
	END IF;
	ms := greatest(ceil(extract(epoch FROM stop - now) * 1000), 1);
	IF waker IS NOT NULL AND waker <> pg_backend_pid() THEN
		/*
		 * Transaction locks in a subtransaction rolled back at once, never
		 * session locks: an error that comes as the finish hands the lock
		 * over (this lock_timeout, a cancel, statement_timeout) must not
		 * leave it held, or the owner's next claim or finish, which waits
		 * for its wake lock inside the transaction that wrote the row, and
		 * this backend, waiting on that row at its next look, deadlock.
		 */
		BEGIN
			PERFORM set_config('lock_timeout', ms::text, true);
			PERFORM pg_advisory_xact_lock_shared(1229651970, waker);
			IF role_id IS NOT NULL THEN
				PERFORM FROM idem_record t
				 WHERE t.role_id OPERATOR(pg_catalog.=) _idem_wait_for_claim.role_id
				   AND t.operation = _idem_wait_for_claim.operation
				   AND t.key = _idem_wait_for_claim.key
				   AND t.token = _idem_wait_for_claim.token AND t.waker = _idem_wait_for_claim.waker
				   AND t.expires_at = until AND t.completed_at IS NULL
				   AND t.xmax::text = mark;
				IF NOT FOUND THEN
					RAISE EXCEPTION USING ERRCODE = 'IK000';	/* changed: look again */
				END IF;
			END IF;
			IF pg_try_advisory_xact_lock_shared(1229651969, waker) THEN
				RAISE EXCEPTION USING ERRCODE = 'IK001';	/* nobody holds that wake lock */
			END IF;
			PERFORM pg_advisory_xact_lock_shared(1229651969, waker);
			RAISE EXCEPTION USING ERRCODE = 'IK000';
		EXCEPTION
			WHEN lock_not_available THEN
				RETURN 0;		/* the time is up (the setting is restored) */
			WHEN SQLSTATE 'IK001' THEN	/* (before IK000, which names its whole class) */
				IF NOT free_before THEN
					RETURN 2;
				END IF;
			WHEN SQLSTATE 'IK000' THEN
				RETURN 1;		/* woken; the locks and the setting are undone */
		END;
	END IF;
	/* nothing to sleep on but time */
	PERFORM pg_sleep(ms / 1000.0);
	RETURN 0;
END
$_idem_wait_for_claim$;

/*
 * Sleep until no transaction is writing the calling role's record of
 * (operation, key): lock it FOR SHARE in a subtransaction, rolled back so
 * that no lock stays.  Under REPEATABLE READ a version newer than the
 * snapshot fails with 40001, which is what a caller that cannot look
 * again with a fresh snapshot needs.
 */
CREATE FUNCTION @extschema@._idem_wait_for_writer(role_id pg_catalog.regrole, operation pg_catalog.text,
												  key pg_catalog.text)
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, @extschema@, pg_temp
SET enable_seqscan = off
AS $_idem_wait_for_writer$
BEGIN
	BEGIN
		PERFORM FROM idem_record r
		 WHERE r.role_id OPERATOR(pg_catalog.=) _idem_wait_for_writer.role_id
		   AND r.operation = _idem_wait_for_writer.operation
		   AND r.key = _idem_wait_for_writer.key
		   FOR SHARE;
		RAISE EXCEPTION USING ERRCODE = 'IK000';
	EXCEPTION WHEN SQLSTATE 'IK000' THEN
		NULL;
	END;
END
$_idem_wait_for_writer$;
