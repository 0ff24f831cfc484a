
# Copyright (c) 2024, idempotency authors
#
# IdemTest: helpers shared by the TAP tests in test/t -- a psql session
# driven statement by statement.
#
# A session is what $node->background_psql($db, on_error_stop => 0)
# returns (a PostgreSQL::Test::BackgroundPsql: {run}, {stdin}, {stdout},
# {stderr}).  Exported:
#
#   send_sql($s, $sql)   start $sql in session $s without waiting for it
#   sql_done($s)         has the statement started by send_sql finished?
#   wait_sql($s)         wait for it: (output, sqlstate, stderr); dies if
#                        psql exits or after timeout_default
#   run_sql($s, $sql)    send_sql then wait_sql
#
# and, for a PostgreSQL::Test::Cluster $node (database postgres):
#
#   key_records($node, $key)
#                        the records of $key, one line per record in token
#                        order: "token|pending|" or "token|completed|response"
#   $IDEM_RECORDS        SQL for every record, in whichever table the
#                        durability mode keeps it (from 1.3: idem_record,
#                        and in mode 'completed' idem_result for completed
#                        records): "(SELECT * FROM idem_record UNION ALL
#                        SELECT * FROM idem_result)", to use as a table
#                        ("FROM $IDEM_RECORDS r")
#   idem_lock_count($node)
#                        how many idempotency advisory locks (classes 0x494B
#                        and 0x494C) pg_locks shows: 0 once every claim and
#                        wait has ended
#   idem_wait_event($node, $name)
#                        what pg_stat_activity.wait_event shows for the
#                        extension's sleep named $name (IdempotencyClaim,
#                        IdempotencyPurgeMain, IdempotencyPurgeDelay,
#                        IdempotencyTokenSyncRep): $name on PostgreSQL 17
#                        and later, "Extension" before
#   token_max(@tokens)   the greatest of @tokens, compared as integers:
#                        List::Util's max may compare them as doubles, which
#                        cannot tell apart tokens of one epoch (above 2^53
#                        they are 64 or more apart) and then returns any of
#                        them
#
# Each statement is followed by "\echo __done__ :SQLSTATE" and
# "\warn __done__", so its end, its SQLSTATE (00000 on success) and all of
# its stderr are known without ON_ERROR_STOP.
#
# Exported on request only (use IdemTest qw(:DEFAULT :bench): some tests
# define subs of their own named try_sql, claim and token_of), for database
# $db of $node -- the loads of the durability tests:
#
#   try_sql($node, $db, $sql)
#                        run $sql with psql (ON_ERROR_STOP, VERBOSITY
#                        verbose): (sqlstate, stdout, stderr), 00000 on
#                        success
#   claim($node, $db, $key, $extra)
#                        a claim of $key in operation 'det' (its fingerprint
#                        that of the key; $extra: more idem_begin arguments,
#                        "lease => '1 h'"): "status|token|response", or
#                        "ERROR sqlstate"
#   token_of($claim)     the token of a new claim ("new|token|"); dies
#                        otherwise
#   start_bench($node, $db, shape => ..., keys => N, clients => C,
#               seconds => S, ...)
#                        pgbench in the background, C clients (jobs => J
#                        threads, else 1; user => ...: connected as that
#                        role) for S seconds, each transaction an attempt
#                        at a key "op-k", k random in 1..N, of op (the shape
#                        unless op => ...), in shape intx (BEGIN; claim;
#                        effect; finish; COMMIT, one time in ten ROLLBACK)
#                        or ext (autocommit claim, effect, finish, then a
#                        row in "finished"), as bench_script below writes
#                        them.  Options of the script: epoch => E (pgbench
#                        -D epoch=E, and the effect and finished rows carry
#                        it in a column epoch), lease => ... (of ext's
#                        claims), stop_flag => 1 (each transaction first
#                        checks the flag in table ctl).  Returns a handle:
#                        {name} ("shape/epoch E", or "shape" without an
#                        epoch, unless name => ...), {run} (the IPC::Run
#                        harness)
#   start_sweep($node, $db, shape => ..., keys => N, ...)
#                        psql in the background retrying every key 1..N
#                        once, one after the other: start_bench's script
#                        (the same options; epoch => E: psql -v epoch=E)
#                        without its random parts, always committing.
#                        Returns a handle as start_bench's, named
#                        "shape/sweep" unless name => ...
#   finish_bench($h, stop => 1)
#                        wait for the pgbench or psql of handle $h to exit,
#                        or with stop => 1 end it at once (SIGINT); sets
#                        $h->{rc} (the exit code), $h->{stdout} and
#                        $h->{stderr}, and returns $h
#
# Exported on request only (use IdemTest qw(:DEFAULT :pgbouncer)), for the
# tests behind a connection pooler:
#
#   pgbouncer_binary()   the pgbouncer to run: $ENV{PGBOUNCER}, else the first
#                        on PATH, /usr/sbin or /usr/bin; undef if none (the
#                        test then skips: plan skip_all)
#   start_pgbouncer($node, pool_size => N)
#                        pgbouncer in transaction pooling mode in front of
#                        database postgres of $node: N server connections
#                        (default 2, server_round_robin), users app and
#                        postgres with auth trust, no server_reset_query,
#                        admin_users postgres (its console, database
#                        pgbouncer).  Waits (up to timeout_default) until it
#                        listens.  Returns a handle: {node} (a never
#                        initialised PostgreSQL::Test::Cluster standing for
#                        pgbouncer: its host, port and background_psql()
#                        connect to pgbouncer), {socket} (its Unix socket:
#                        absent if it did not start), {log} (its log file),
#                        {output} (what it printed at the start), {run}
#                        (the IPC::Run harness).  Any pgbouncer still
#                        running when the test exits is killed.
#   stop_pgbouncer($h)   stop it (SIGINT) and wait for it to exit
#
# Use from a test file (prove_installcheck does not put test/t on @INC):
#
#   use FindBin;
#   use lib $FindBin::RealBin;
#   use IdemTest;
#
# This file is no test: prove runs only test/t/*.pl.

package IdemTest;

use strict;
use warnings;

use Exporter 'import';
use IPC::Run;
use PostgreSQL::Test::Cluster ();
use PostgreSQL::Test::Utils ();

our @EXPORT = qw(send_sql sql_done wait_sql run_sql key_records idem_lock_count idem_wait_event token_max
  $IDEM_RECORDS setup_load start_load stop_load load_progressed check_load check_amcheck);
# Not exported unless asked for: tests that predate them define subs of the
# same names, which an import would make Perl warn about as redefined.
our %EXPORT_TAGS = (
	bench => [qw(try_sql claim token_of start_bench start_sweep finish_bench)],
	pgbouncer => [qw(pgbouncer_binary start_pgbouncer stop_pgbouncer)],
	switch => [qw(create_slow_row complete_keys mode_truth retry_all crash_restart)]);
our @EXPORT_OK = map { @$_ } values %EXPORT_TAGS;

# Start $sql in session $s without waiting for it to finish.
sub send_sql
{
	my ($s, $sql) = @_;
	$s->{stdout} = '';
	$s->{stderr} = '';
	$s->{stdin} .= "$sql\n\\echo __done__ :SQLSTATE\n\\warn __done__\n";
	$s->{run}->pump_nb;
	return;
}

# Has the statement started by send_sql finished?
sub sql_done
{
	my ($s) = @_;
	$s->{run}->pump_nb;
	return $s->{stdout} =~ /__done__/;
}

# Wait for the statement started by send_sql: (output, sqlstate, stderr)
sub wait_sql
{
	my ($s) = @_;
	my $timer = IPC::Run::timer($PostgreSQL::Test::Utils::timeout_default);
	$timer->start;
	until ($s->{stdout} =~ /__done__ \w+\n/ && $s->{stderr} =~ /__done__\n/)
	{
		die "timed out waiting for psql: $s->{stdout} $s->{stderr}"
		  if $timer->is_expired;
		die "psql exited: $s->{stdout} $s->{stderr}"
		  unless $s->{run}->pumpable;
		$s->{run}->pump;
	}
	my ($out, $state) = $s->{stdout} =~ /^(.*?)\n?__done__ (\w+)\n/s;
	(my $err = $s->{stderr}) =~ s/__done__\n//;
	return ($out, $state, $err);
}

# Run $sql in session $s and wait for it: (output, sqlstate, stderr)
sub run_sql
{
	my ($s, $sql) = @_;
	send_sql($s, $sql);
	return wait_sql($s);
}

# ---- the record table and the locks ----

# Every record, from both tables: a new installation (1.3) is in durability
# mode 'completed', where a finish moves the record from idem_record (the
# claims, unlogged) to idem_result (logged).  In modes 'none' and 'all'
# idem_result is empty.
our $IDEM_RECORDS =
  '(SELECT * FROM idem_record UNION ALL SELECT * FROM idem_result)';

# The records of $key: "token|pending/completed|response", one line per
# record, in token order.
sub key_records
{
	my ($node, $key) = @_;
	return $node->safe_psql('postgres', qq{
		SELECT token, CASE WHEN completed_at IS NULL THEN 'pending' ELSE 'completed' END, response
		  FROM $IDEM_RECORDS r WHERE key = '$key' ORDER BY token});
}

# The number of idempotency advisory locks held or awaited.
sub idem_lock_count
{
	my ($node) = @_;
	return $node->safe_psql('postgres', q{
		SELECT count(*) FROM pg_locks
		 WHERE locktype = 'advisory' AND objsubid IN (18763, 18764)});    # 0x494B, 0x494C
}

# The wait_event of the extension's sleep $name on $node's server
sub idem_wait_event
{
	my ($node, $name) = @_;
	return $node->safe_psql('postgres', 'SHOW server_version_num') >= 170000 ? $name : 'Extension';
}

# ---- the durability switch tests (525, 527): exported with :switch ----

# create_slow_row($node): the trigger function slow_row(), which slows a
# move into the table it is on (5 ms a row) without changing a row
sub create_slow_row
{
	my ($node) = @_;
	$node->safe_psql('postgres', q{
		CREATE FUNCTION slow_row() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			PERFORM pg_sleep(0.005);
			RETURN NEW;
		END $$;});
	return;
}

# complete_keys($node, $op, $mode, $nkeys): empty both tables, switch to
# $mode and complete keys k1 .. k$nkeys of $op (the response: the number)
sub complete_keys
{
	my ($node, $op, $mode, $nkeys) = @_;
	$node->safe_psql('postgres', qq{
		TRUNCATE idem_record, idem_result;
		SELECT idem_set_durability('$mode');
		SELECT count(idem_finish('$op', 'k' || g, b.token, to_jsonb(g)))
		  FROM generate_series(1, $nkeys) g,
		       LATERAL idem_begin('$op', 'k' || g, NULL) b;});
	return;
}

# mode_truth($node): is idem_durability() true of the storage?  "mode|true"
# or "mode|false ...": 'completed' needs idem_result logged and no completed
# record left in an unlogged idem_record; 'all' both tables logged
sub mode_truth
{
	my ($node) = @_;
	return $node->safe_psql('postgres', q{
		SELECT m || '|' || CASE
		  WHEN m = 'none' THEN 'true'
		  WHEN m = 'completed' THEN (sp = 'p' AND left_behind = 0)::text || ' ' || sp || ' ' || left_behind
		  ELSE (rp = 'p' AND sp = 'p')::text || ' ' || rp || sp END
		  FROM (SELECT idem_durability() AS m,
		               (SELECT relpersistence::text FROM pg_class WHERE oid = 'idem_record'::regclass) AS rp,
		               (SELECT relpersistence::text FROM pg_class WHERE oid = 'idem_result'::regclass) AS sp,
		               (SELECT count(*) FROM idem_record
		                 WHERE completed_at IS NOT NULL
		                   AND (SELECT relpersistence FROM pg_class WHERE oid = 'idem_record'::regclass) = 'u')
		                 AS left_behind) s});
}

# retry_all($node, $op, $nkeys): a retry of keys k1 .. k$nkeys of $op:
# "replays|news"; a retry that gets 'new' finishes the key again
sub retry_all
{
	my ($node, $op, $nkeys) = @_;
	return $node->safe_psql('postgres', qq{
		SELECT count(*) FILTER (WHERE status = 'replay') || '|' || count(*) FILTER (WHERE status = 'new')
		  FROM (SELECT b.status,
		               CASE WHEN b.status = 'new'
		                    THEN idem_finish('$op', 'k' || g, b.token, '"again"') END
		          FROM generate_series(1, $nkeys) g,
		               LATERAL idem_begin('$op', 'k' || g, NULL) b) r});
}

# crash_restart($node): an immediate shutdown, then a start (crash recovery)
sub crash_restart
{
	my ($node) = @_;
	$node->stop('immediate');
	$node->start;
	return;
}

# The greatest token of a list, compared as integers (Perl's > on two
# integers compares them exactly).
sub token_max
{
	my ($m, @rest) = @_;
	for my $t (@rest)
	{
		$m = $t if $t > $m;
	}
	return $m;
}

# ---- loads and retries of every key (the 4xx tests, and start_load) ----

# Run $sql; returns (sqlstate, stdout, stderr): 00000 on success
sub try_sql
{
	my ($node, $db, $sql) = @_;
	my ($rc, $out, $err) = $node->psql($db, $sql,
		extra_params => [ '-v', 'VERBOSITY=verbose' ],
		on_error_stop => 1);
	return ('00000', $out, $err) if $rc == 0;
	my ($state) = $err =~ /(?:ERROR|FATAL|PANIC):\s+([0-9A-Z]{5}):/;
	return ($state // "rc=$rc", $out, $err);
}

# "status|token|response" of a claim of det's $key, or "ERROR sqlstate"
sub claim
{
	my ($node, $db, $key, $extra) = @_;
	$extra = defined $extra ? ", $extra" : '';
	my ($st, $out, $err) = try_sql($node, $db, qq{
		SELECT status || '|' || coalesce(token::text, '') || '|' || coalesce(response::text, '')
		  FROM idem_begin('det', '$key', idem_fingerprint('$key')$extra) b});
	return $st eq '00000' ? $out : "ERROR $st";
}

sub token_of
{
	my ($c) = @_;
	my ($t) = $c =~ /^new\|(\d+)\|$/ or die "not a new claim: $c";
	return $t;
}

# bench_script(shape => ..., op => ..., keys => N, epoch => E, lease => ...,
# stop_flag => 1, sweep => 1): the text of a pgbench (or psql) script, one
# attempt at a key of op (the shape unless told), "op-k" for a k in 1..N:
#   intx  in-transaction shape: BEGIN; idem_begin; on 'new' INSERT INTO
#         effect and idem_finish with {"effect_id": id}; COMMIT (one time
#         in ten ROLLBACK, so the key is claimed again later).  An effect
#         row of this shape exists <=> its finish committed.
#   ext   external-call shape: autocommit idem_begin (with the lease given,
#         else idem_begin's default); on 'new' an autocommit INSERT INTO
#         effect, an autocommit idem_finish, then an autocommit INSERT INTO
#         finished(op, key, eid): a "finished" row means that the finish
#         committed.
# On 'replay' both check that the response names this key's effect row (a
# division by zero otherwise).  effect is (op, key, k, token), and with
# epoch => E the effect and finished rows carry the epoch too, in a column
# epoch, from the script's variable :epoch (set by the caller).  With
# stop_flag => 1 each attempt first reads "SELECT stop FROM ctl" and, while
# it is set, only sleeps 20 ms.  With sweep => 1 the random parts are left
# out (the caller sets :k; intx always commits).
sub bench_script
{
	my (%o) = @_;
	die "bench_script: unknown shape '$o{shape}'"
	  unless $o{shape} eq 'intx' || $o{shape} eq 'ext';
	my $intx = $o{shape} eq 'intx';
	my $op = $o{op} // $o{shape};
	my $key = "'$op-' || :k";
	my ($ecol, $eval) = defined $o{epoch} ? (', epoch', ', :epoch') : ('', '');
	my $lease = !$intx && defined $o{lease} ? ", lease => '$o{lease}'" : '';

	my $s = '';
	$s .= "\\set k random(1, $o{keys})\n" unless $o{sweep};
	$s .= "\\set r random(1, 10)\n" if $intx && !$o{sweep};
	$s .= "BEGIN;\n" if $intx;
	$s .= qq{SELECT (status = 'new')::int AS is_new, coalesce(token, 0) AS token,
       coalesce(response->>'effect_id', '0') AS eid
  FROM idem_begin('$op', $key, idem_fingerprint(:k)$lease) b \\gset
\\if :is_new
INSERT INTO effect (op, key, k, token$ecol) VALUES ('$op', $key, :k, :token$eval)
  RETURNING id AS new_eid \\gset
SELECT idem_finish('$op', $key, :token, jsonb_build_object('effect_id', :new_eid));
};
	if (!$intx)
	{
		$s .= "INSERT INTO finished (op, key, eid$ecol) VALUES ('$op', $key, :new_eid$eval);\n";
	}
	elsif ($o{sweep})
	{
		$s .= "COMMIT;\n";
	}
	else
	{
		$s .= "\\if :r = 1\nROLLBACK;\n\\else\nCOMMIT;\n\\endif\n";
	}
	$s .= "\\else\nSELECT 1 / count(*) FROM effect WHERE id = :eid AND op = '$op' AND key = $key;\n";
	$s .= "COMMIT;\n" if $intx;
	$s .= "\\endif\n";
	$s = "SELECT stop FROM ctl \\gset\n\\if :stop\n\\sleep 20 ms\n\\else\n$s\\endif\n"
	  if $o{stop_flag};
	return "\n$s";
}

# Files of the loads, one set per start: bench-<n>-<db>-<op> in the node's
# base directory.
my $bench_seq = 0;

sub bench_base
{
	my ($node, $db, %o) = @_;
	return $node->basedir . '/bench-' . ++$bench_seq . "-$db-" . ($o{op} // $o{shape});
}

# Start @cmd in the background, named $name.  Its output goes to files
# $base.out and $base.err: a pipe nobody reads while the test waits
# elsewhere would fill up and stop it.
sub start_background
{
	my ($name, $base, @cmd) = @_;
	my $h = { name => $name, out => "$base.out", err => "$base.err" };
	$h->{run} = IPC::Run::start(\@cmd, '>', $h->{out}, '2>', $h->{err});
	return $h;
}

sub start_bench
{
	my ($node, $db, %o) = @_;
	my $base = bench_base($node, $db, %o);
	PostgreSQL::Test::Utils::append_to_file("$base.sql", bench_script(%o, sweep => 0));
	my $connstr = $node->connstr($db);
	$connstr .= " user=$o{user}" if defined $o{user};
	return start_background(
		$o{name} // join('/', $o{shape}, defined $o{epoch} ? "epoch $o{epoch}" : ()),
		$base,
		'pgbench', '-n', '-c', $o{clients}, '-j', $o{jobs} // 1, '-T', $o{seconds},
		(defined $o{epoch} ? ('-D', "epoch=$o{epoch}") : ()),
		'-f', "$base.sql", $connstr);
}

sub start_sweep
{
	my ($node, $db, %o) = @_;
	my $base = bench_base($node, $db, %o);
	my $body = bench_script(%o, sweep => 1);
	PostgreSQL::Test::Utils::append_to_file("$base.sql",
		join '', map { "\\set k $_\n$body" } 1 .. $o{keys});
	return start_background(
		$o{name} // "$o{shape}/sweep",
		$base,
		'psql', '-X', '-q', '-v', 'ON_ERROR_STOP=1',
		(defined $o{epoch} ? ('-v', "epoch=$o{epoch}") : ()),
		'-f', "$base.sql", '-o', '/dev/null', '-d', $node->connstr($db));
}

sub finish_bench
{
	my ($h, %o) = @_;
	if ($o{stop} && $h->{run}->pumpable)
	{
		$h->{run}->signal('INT');
	}
	eval { $h->{run}->finish; };
	# undef where it could not be waited for
	$h->{rc} = eval { $h->{run}->result(0) };
	$h->{stdout} = PostgreSQL::Test::Utils::slurp_file($h->{out});
	$h->{stderr} = PostgreSQL::Test::Utils::slurp_file($h->{err});
	return $h;
}

# ---- concurrent in-transaction load (the 3xx tests) ----
#
#   setup_load($node, $db)
#       CREATE EXTENSION idempotency (if absent) and the side table
#       effect(id, op, key, k, token, role) that counts effects, open to
#       every role.
#   start_load($node, op => ..., keys => N, clients => C, seconds => S,
#              db => ..., user => ...)
#       pgbench in the background (start_bench, bench_script's intx shape):
#       per transaction a key of op from 1..keys (so retries of a key
#       happen): BEGIN; idem_begin; on 'new' INSERT INTO effect,
#       idem_finish with {"effect_id": id}, COMMIT (one time in ten
#       ROLLBACK, so the key is claimed again later); on 'replay' check
#       that the replayed effect_id is this key's effect (a division by
#       zero otherwise).  Returns a handle.
#   stop_load($h)
#       wait for it (after `seconds`), or with stop => 1 end it at once
#       (SIGINT; the server rolls back what was in flight).  Returns
#       (stdout, stderr).
#   load_progressed($node, $db, $n)
#       wait until $n more transactions have ended in $db (poll).
#   check_load($node, $db, $op, $name, role => ...)
#       (a) every effect of op replays, as its role, its own response;
#       every completed record of op has its effect and no effect lacks
#       its completed record; (b) no key has two effects.
#   check_amcheck($node, $db, $name)
#       (c) bt_index_check(index, heapallindexed => true) on every index
#       of both record tables, idem_record and idem_result: returns the
#       number of indexes checked.

sub setup_load
{
	my ($node, $db) = @_;
	$db //= 'postgres';
	$node->safe_psql($db, q{
		CREATE EXTENSION IF NOT EXISTS idempotency;
		CREATE TABLE IF NOT EXISTS effect (
			id bigserial PRIMARY KEY, op text NOT NULL, key text NOT NULL,
			k int NOT NULL, token bigint NOT NULL,
			role name NOT NULL DEFAULT current_user);
		GRANT SELECT, INSERT ON effect TO PUBLIC;
		GRANT USAGE ON SEQUENCE effect_id_seq TO PUBLIC;
	});
	return;
}

sub start_load
{
	my ($node, %o) = @_;
	my $op = $o{op} // 'load';
	my $clients = $o{clients} // 4;
	return start_bench($node, $o{db} // 'postgres',
		shape => 'intx', op => $op, name => $op, keys => $o{keys} // 2000,
		clients => $clients, jobs => $clients < 2 ? $clients : 2,
		seconds => $o{seconds} // 10, user => $o{user});
}

sub stop_load
{
	my ($h, %o) = @_;
	finish_bench($h, stop => $o{stop});
	return ($h->{stdout}, $h->{stderr});
}

# load_progressed($node, $db, $n): wait until $n more transactions (commits
# and rollbacks, as the cumulative statistics count them) ended in $db --
# effects alone stop growing once every key is completed.
sub load_progressed
{
	my ($node, $db, $n) = @_;
	my $q = qq{SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = '$db'};
	my $base = $node->safe_psql($db, $q);
	return $node->poll_query_until($db, "SELECT ($q) >= $base + $n");
}

sub check_load
{
	my ($node, $db, $op, $name, %o) = @_;
	my $set_role = defined $o{role} ? qq{SET ROLE "$o{role}";} : '';
	my $role_cond = defined $o{role} ? qq{AND e.role = '$o{role}'} : '';

	my $n = $node->safe_psql($db, qq{SELECT count(*) FROM effect e WHERE op = '$op' $role_cond});
	Test::More::cmp_ok($n, '>', 0, "$name: the load produced effects ($n)");

	# (a) every effect replays its own response, as its role
	my ($ret, $out, $err) = $node->psql($db, qq{
		BEGIN;
		$set_role
		SELECT count(*) FILTER (WHERE b.status IS DISTINCT FROM 'replay'
		                           OR b.response IS DISTINCT FROM jsonb_build_object('effect_id', e.id))
		     || '|' || count(*)
		  FROM effect e, LATERAL idem_begin(e.op, e.key, idem_fingerprint(e.k)) b
		 WHERE e.op = '$op' $role_cond;
		ROLLBACK;});
	Test::More::is("$ret|$out", "0|0|$n",
		"$name: (a) every completed key ($n) replays its stored response")
	  or Test::More::diag($err);

	# (a) completed records <=> effects (as superuser)
	my $role_of_record = defined $o{role} ? qq{AND r.role_id::regrole::text = '$o{role}'} : '';
	Test::More::is( $node->safe_psql($db, qq{
			SELECT count(*) FROM $IDEM_RECORDS r
			 WHERE r.operation = '$op' $role_of_record AND r.completed_at IS NOT NULL
			   AND NOT EXISTS (SELECT 1 FROM effect e
			                    WHERE e.op = r.operation AND e.key = r.key AND e.token = r.token
			                      AND r.response = jsonb_build_object('effect_id', e.id))}),
		'0', "$name: (a) every completed record has its effect");
	Test::More::is( $node->safe_psql($db, qq{
			SELECT count(*) FROM effect e
			 WHERE e.op = '$op' $role_cond AND NOT EXISTS (
				SELECT 1 FROM $IDEM_RECORDS r
				 WHERE r.operation = e.op AND r.key = e.key AND r.completed_at IS NOT NULL
				   AND r.response = jsonb_build_object('effect_id', e.id))}),
		'0', "$name: (a) every effect has its completed record");

	# (b) at most one effect per key
	Test::More::is( $node->safe_psql($db, qq{
			SELECT count(*) FROM (SELECT role, key FROM effect e WHERE op = '$op' $role_cond
			                       GROUP BY role, key HAVING count(*) > 1) d}),
		'0', "$name: (b) no key has two effects");
	return;
}

sub check_amcheck
{
	my ($node, $db, $name) = @_;
	$node->safe_psql($db, 'CREATE EXTENSION IF NOT EXISTS amcheck');
	my $tables = q{indrelid IN ('idem_record'::regclass, 'idem_result'::regclass)};
	my $n = $node->safe_psql($db,
		qq{SELECT count(*) FROM pg_index WHERE $tables});
	my ($ret, $out, $err) = $node->psql($db, qq{
		SELECT count(*) FROM (
			SELECT bt_index_check(indexrelid, true) FROM pg_index
			 WHERE $tables) s});
	Test::More::is("$ret|$out", "0|$n",
		"$name: (c) amcheck (heapallindexed) clean on all $n indexes of idem_record and idem_result")
	  or Test::More::diag($err);
	return $n;
}

# ---- pgbouncer (the 120 and 461 tests) ----

sub pgbouncer_binary
{
	my ($bin) = grep { defined $_ && -x $_ } (
		$ENV{PGBOUNCER},
		(map { "$_/pgbouncer" } split(/:/, $ENV{PATH} // '')),
		'/usr/sbin/pgbouncer', '/usr/bin/pgbouncer');
	return $bin;
}

my @pgbouncers;
END
{
	for my $h (@pgbouncers)
	{
		$h->{run}->kill_kill if $h->{run} && $h->{run}->pumpable;
	}
}

sub start_pgbouncer
{
	my ($node, %o) = @_;
	my $bin = pgbouncer_binary() or die 'start_pgbouncer: pgbouncer is not installed';
	# A node that is never initialised stands for pgbouncer: it reserves a
	# free port, and its host (the test's socket directory), port and
	# background_psql() connect to pgbouncer.
	my $bouncer = PostgreSQL::Test::Cluster->new('pgbouncer');
	my $bdir = $bouncer->basedir;
	my $h = {
		node => $bouncer,
		log => "$bdir/pgbouncer.log",
		socket => $bouncer->host . '/.s.PGSQL.' . $bouncer->port,
	};
	PostgreSQL::Test::Utils::append_to_file("$bdir/userlist.txt", qq{"app" ""\n"postgres" ""\n});
	PostgreSQL::Test::Utils::append_to_file("$bdir/pgbouncer.ini", sprintf(<<'EOF',
[databases]
postgres = host=%s port=%d dbname=postgres

[pgbouncer]
listen_port = %d
unix_socket_dir = %s
auth_type = trust
auth_file = %s/userlist.txt
admin_users = postgres
pool_mode = transaction
default_pool_size = %d
min_pool_size = 0
reserve_pool_size = 0
max_client_conn = 100
server_round_robin = 1
server_reset_query =
ignore_startup_parameters = extra_float_digits,options
logfile = %s
log_connections = 0
log_disconnections = 0
EOF
		$node->host, $node->port, $bouncer->port, $bouncer->host, $bdir,
		$o{pool_size} // 2, $h->{log}));
	$h->{run} = IPC::Run::start([ $bin, "$bdir/pgbouncer.ini" ],
		'>', "$bdir/pgbouncer.out", '2>', "$bdir/pgbouncer.err");
	push @pgbouncers, $h;
	my $timer = IPC::Run::timer($PostgreSQL::Test::Utils::timeout_default);
	$timer->start;
	until (-S $h->{socket} || $timer->is_expired || !$h->{run}->pumpable)
	{
		select(undef, undef, undef, 0.05);
	}
	$h->{output} = join '', map { -e $_ ? PostgreSQL::Test::Utils::slurp_file($_) : '' }
	  "$bdir/pgbouncer.out", "$bdir/pgbouncer.err";
	return $h;
}

sub stop_pgbouncer
{
	my ($h) = @_;
	if ($h->{run}->pumpable)
	{
		$h->{run}->signal('INT');
	}
	eval { $h->{run}->finish; };
	return;
}

1;
