
# Copyright (c) 2024, idempotency authors
#
# A server at its lock limit (max_locks_per_transaction = 10, the least
# it takes).  Every claim takes locks of the shared lock table (its key's,
# and a 'session' claim its session's), so when that table is full:
#
#  1. A claim gets core's error for it: 53200 "out of shared memory", with
#     the hint naming max_locks_per_transaction; it leaves no record.
#  2. As the table frees up a lock at a time, each attempt either fails so
#     or claims; the 'session' claim that succeeds holds its session's
#     locks (0x494D and the anchor 0x494F), so it is not taken over: a
#     duplicate in raise mode gets IK409.  A session whose first attempt
#     failed half-way must not go on making 'session' claims that nothing
#     protects.  The attempts that fail leave no record.
#  3. A batch of 300 'session' claims in one statement, and eight sessions
#     holding such claims, fit in that table: each claim's key lock is let
#     go when the claim is made; a session holds two locks for all of its
#     claims.

use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

use FindBin;
use lib $FindBin::RealBin;
use IdemTest;

my $SESSION_LOCK = 18765;    # 0x494D
my $ANCHOR_LOCK = 18767;     # 0x494F

my $node = PostgreSQL::Test::Cluster->new('locks');
$node->init;
$node->append_conf('postgresql.conf', q{
max_connections = 20
max_locks_per_transaction = 10
});
$node->start;
$node->safe_psql('postgres', 'CREATE EXTENSION idempotency');

sub session_locks_of
{
	my ($pid) = @_;
	return $node->safe_psql('postgres', qq{
		SELECT count(*) FILTER (WHERE objsubid = $SESSION_LOCK) || '|' ||
		       count(*) FILTER (WHERE objsubid = $ANCHOR_LOCK)
		  FROM pg_locks
		 WHERE pid = $pid AND locktype = 'advisory' AND granted});
}

# ---- 3 first, while the table is empty: a batch, and many sessions ----

my $batch = $node->background_psql('postgres', on_error_stop => 0);
my ($batch_pid) = run_sql($batch, 'SELECT pg_backend_pid();');
my ($out, $state) = run_sql($batch, q{
	SELECT count(*) FILTER (WHERE b.status = 'new')
	  FROM generate_series(1, 300) g,
	       LATERAL idem_begin('batch', 'b' || g, NULL, takeover => 'session') b;});
is("$state|$out", '00000|300', 'a batch of 300 session claims in one statement: all new');
is(session_locks_of($batch_pid), '1|1', '... and its session holds two locks for all of them');

my @holders;
for my $i (1 .. 8)
{
	my $s = $node->background_psql('postgres', on_error_stop => 0);
	($out, $state) = run_sql($s, qq{
		SELECT count(*) FROM generate_series(1, 20) g,
		       LATERAL idem_begin('many', '$i-' || g, NULL, takeover => 'session') b;});
	is("$state|$out", '00000|20', "session $i holds 20 session claims");
	push @holders, $s;
}
is($node->safe_psql('postgres', q{SELECT count(*) FROM idem_record WHERE operation = 'many'}),
	'160', 'eight sessions hold 160 claims');
($state) = (run_sql($holders[0], q{SELECT status FROM idem_begin('many', '2-1', NULL, 'raise');}))[1];
is($state, 'IK409', 'a duplicate of another session\'s claim: IK409');

# ---- 1. a full lock table ----

# connected before: a new connection (and most queries) needs locks too,
# so the records are counted once the table is free again
my $s = $node->background_psql('postgres', on_error_stop => 0,
	extra_params => [ '-v', 'VERBOSITY=verbose' ]);
my ($s_pid) = run_sql($s, 'SELECT pg_backend_pid();');
my $err;

my $filler = $node->background_psql('postgres', on_error_stop => 0);
($out, $state, $err) = run_sql($filler, q{
	DO $$
	DECLARE
		i int := 0;
	BEGIN
		LOOP
			i := i + 1;
			BEGIN
				PERFORM pg_advisory_lock(1, i);
			EXCEPTION WHEN out_of_memory THEN
				RAISE NOTICE 'filled: % locks', i - 1;
				EXIT;
			END;
		END LOOP;
	END $$;});
my ($filled) = ($err // '') =~ /filled: (\d+) locks/;
ok($state eq '00000' && $filled, "another session fills the lock table (" . ($filled // '?') . ' advisory locks)')
  or diag($err);
($out, $state, $err) = run_sql($s, q{
	SELECT status FROM idem_begin('full', 'k0', NULL, takeover => 'session') b;});
is($state, '53200', 'a session claim with the lock table full: 53200');
like($err, qr/out of shared memory/, '... out of shared memory');
like($err, qr/HINT:.*max_locks_per_transaction/, '... the hint names max_locks_per_transaction');

# ---- 2. freed a lock at a time ----

my ($freed, $claimed) = (0, 0);
while ($freed < 10)
{
	$freed++;
	run_sql($filler, "SELECT pg_advisory_unlock(1, $filled - $freed + 1);");
	($out, $state, $err) = run_sql($s, q{
		SELECT status || '|' || token FROM idem_begin('full', 'k1', NULL, takeover => 'session') b;});
	if ($state eq '00000')
	{
		($claimed) = $out =~ /^new\|(\d+)$/;
		last;
	}
	last unless $state eq '53200';
}
ok($claimed, "with $freed lock(s) freed, the claim is made (every attempt before: 53200)")
  or diag("$state $err");

# the table is free again: the checks need locks of their own
run_sql($filler, 'SELECT pg_advisory_unlock_all();');
is($node->safe_psql('postgres', q{
		SELECT string_agg(key || ':' || token, ' ') FROM idem_record WHERE operation = 'full'}),
	"k1:$claimed", 'the attempts that failed left no record: only the claim made');
is(session_locks_of($s_pid), '1|1', 'the session that claimed holds its two session locks');
my $dup = $node->background_psql('postgres', on_error_stop => 0);
($out, $state) = run_sql($dup, q{SELECT status FROM idem_begin('full', 'k1', NULL, 'raise') b;});
is($state, 'IK409', 'its claim is not taken over: a duplicate in raise mode gets IK409');
($out, $state) = run_sql($s, q{
	SELECT status FROM idem_begin('full', 'k2', NULL, takeover => 'session') b;});
is("$state|$out", '00000|new', 'later session claims work');
($out, $state) = run_sql($dup, q{SELECT status FROM idem_begin('full', 'k2', NULL, 'raise') b;});
is($state, 'IK409', '... and are not taken over either');

# its session ends: a duplicate takes its claims over at once
$s->quit;
ok($node->poll_query_until('postgres', "SELECT count(*) = 0 FROM pg_stat_activity WHERE pid = $s_pid"),
	'the session ends');
($out, $state) = run_sql($dup, q{SELECT status FROM idem_begin('full', 'k1', NULL, 'raise') b;});
is("$state|$out", '00000|new', 'then a duplicate takes its claim over');

$_->quit for ($batch, $filler, $dup, @holders);
unlike(slurp_file($node->logfile), qr/terminated by signal|PANIC|TRAP:/, 'no backend crashed');
$node->stop;
done_testing();
