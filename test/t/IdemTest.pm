
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
#
# Each statement is followed by "\echo __done__ :SQLSTATE" and
# "\warn __done__", so its end, its SQLSTATE (00000 on success) and all of
# its stderr are known without ON_ERROR_STOP.
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
use PostgreSQL::Test::Utils ();

our @EXPORT = qw(send_sql sql_done wait_sql run_sql key_records idem_lock_count
  $IDEM_RECORDS setup_load start_load stop_load load_progressed check_load check_amcheck);

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

# ---- concurrent in-transaction load (the 3xx tests) ----
#
#   setup_load($node, $db)
#       CREATE EXTENSION idempotency (if absent) and the side table
#       effect(id, op, key, k, token, role) that counts effects, open to
#       every role.
#   start_load($node, op => ..., keys => N, clients => C, seconds => S,
#              db => ..., user => ...)
#       pgbench in the background: per transaction a key of op from
#       1..keys (so retries of a key happen): BEGIN; idem_begin; on 'new'
#       INSERT INTO effect, idem_finish with {"effect_id": id}, COMMIT (one
#       time in ten ROLLBACK, so the key is claimed again later); on
#       'replay' check that the replayed effect_id is this key's effect
#       (a division by zero otherwise).  Returns a handle.
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
	my $keys = $o{keys} // 2000;
	my $clients = $o{clients} // 4;
	my $seconds = $o{seconds} // 10;
	my $db = $o{db} // 'postgres';
	my $jobs = $clients < 2 ? $clients : 2;
	my $script = $node->basedir . "/load-$op-" . int(rand(1e9)) . '.sql';
	PostgreSQL::Test::Utils::append_to_file($script, qq{
\\set k random(1, $keys)
\\set r random(1, 10)
BEGIN;
SELECT (status = 'new')::int AS is_new, coalesce(token, 0) AS token,
       coalesce(response->>'effect_id', '0') AS eid
  FROM idem_begin('$op', '$op-' || :k, idem_fingerprint(:k)) b \\gset
\\if :is_new
INSERT INTO effect (op, key, k, token) VALUES ('$op', '$op-' || :k, :k, :token)
  RETURNING id AS new_eid \\gset
SELECT idem_finish('$op', '$op-' || :k, :token, jsonb_build_object('effect_id', :new_eid));
\\if :r = 1
ROLLBACK;
\\else
COMMIT;
\\endif
\\else
SELECT 1 / count(*) FROM effect WHERE id = :eid AND op = '$op' AND key = '$op-' || :k;
COMMIT;
\\endif
});
	my $connstr = $node->connstr($db);
	$connstr .= " user=$o{user}" if defined $o{user};
	# output goes to files: a pipe nobody reads while the test waits
	# elsewhere would fill up and stop pgbench
	my $h = { op => $op, outfile => "$script.out", errfile => "$script.err" };
	$h->{run} = IPC::Run::start(
		[ 'pgbench', '-n', '-c', $clients, '-j', $jobs, '-T', $seconds,
			'-f', $script, $connstr ],
		'>', $h->{outfile}, '2>', $h->{errfile});
	return $h;
}

sub stop_load
{
	my ($h, %o) = @_;
	if ($o{stop} && $h->{run}->pumpable)
	{
		$h->{run}->signal('INT');
	}
	eval { $h->{run}->finish; };
	return (PostgreSQL::Test::Utils::slurp_file($h->{outfile}),
		PostgreSQL::Test::Utils::slurp_file($h->{errfile}));
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

1;
