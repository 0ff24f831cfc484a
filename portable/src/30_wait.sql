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
 *						release and take back the lock, which hands it to
 *						the waiters first.
 *
 * What PL/pgSQL cannot do: wake a waiter from another backend.  A claim
 * finished or aborted on another connection than the one that made it
 * (a transaction pool) is seen by its waiters at the next look, at most
 * _idem_wait_look() seconds later; so is a claim whose backend no longer
 * holds its wake lock (DISCARD ALL released it).  A finish between a
 * waiter's look and its lock request is seen 0.05 s later (see
 * _idem_wait_for_claim).
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

/* classid of the wake locks ('I','K', 0, 1) */
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
 * Take this backend's wake lock, waiting a moment for waiters that hold it
 * in share mode to let it go (they do at once; a waiter that never did
 * must not hold up a claim or a finish: then the lock is taken at a later
 * call, and waiters meanwhile look again every _idem_wait_look() seconds).
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
 * which grants it to them, and take it back (after they let it go, which
 * they do at once).
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
		PERFORM pg_advisory_unlock(_idem_wake_class(), me);
		IF NOT (pg_try_advisory_lock(_idem_wake_class(), me) OR _idem_take_wake_lock()) THEN
			PERFORM set_config('idempotency_portable.wake_lock', '', false);
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
 * ends for the calling idem_begin.  Returns whether a wake-up (or the
 * waker's end) ended the sleep, not the time.  The caller looks again
 * afterwards.
 *
 * A finish that comes between the caller's look and its lock request wakes
 * nobody: so the caller sleeps a moment first (idem_begin passes 0.05 s
 * after a look that followed a wake-up), then, after one more look, long.
 */
CREATE FUNCTION @extschema@._idem_wait_for_claim(waker pg_catalog.int4, until pg_catalog.timestamptz,
												 lock_deadline pg_catalog.timestamptz,
												 most pg_catalog.float8)
RETURNS pg_catalog.bool
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, @extschema@, pg_temp
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
	/* one expression: nothing runs between taking and releasing the lock */
	IF waker IS NULL OR waker = pg_backend_pid()
	   OR (pg_try_advisory_lock_shared(_idem_wake_class(), waker)
		   AND pg_advisory_unlock_shared(_idem_wake_class(), waker)) THEN
		/* nobody holds that wake lock: nothing to sleep on but time */
		PERFORM pg_sleep(ms / 1000.0);
		RETURN false;
	END IF;
	/*
	 * A transaction lock in a subtransaction rolled back at once, never a
	 * session lock: an error that comes as the finish hands the lock over
	 * (this lock_timeout, a cancel, statement_timeout) must not leave it
	 * held, or the owner's next claim or finish, which waits for its wake
	 * lock inside the transaction that wrote the row, and this backend,
	 * waiting on that row at its next look, deadlock.
	 */
	BEGIN
		PERFORM set_config('lock_timeout', ms::text, true);
		PERFORM pg_advisory_xact_lock_shared(_idem_wake_class(), waker);
		RAISE EXCEPTION USING ERRCODE = 'IK000';
	EXCEPTION
		WHEN lock_not_available THEN
			RETURN false;		/* the time is up (the setting is restored) */
		WHEN SQLSTATE 'IK000' THEN
			RETURN true;		/* woken; the lock and the setting are undone */
	END;
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
