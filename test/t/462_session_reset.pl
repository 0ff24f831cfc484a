
# Copyright (c) 2024, idempotency authors
#
# test/run: serial
#
# A live session keeps its takeover => 'session' claims whatever it does to
# its own state: only finishing or aborting a claim, or the session's end,
# gives it up.  Counted by effects: every attempt that gets 'new' (or
# 'recover') inserts an effect row, and each key must have exactly one.
#
#  1. For each of DISCARD ALL, pg_advisory_unlock_all(), RESET ALL,
#     SET ROLE / RESET ROLE, SET SESSION AUTHORIZATION, and
#     pg_advisory_unlock_all() in a transaction that then aborts: the
#     worker claims a key, makes its effect, then does it; a duplicate in
#     raise mode gets IK409, a waiting duplicate is not woken into a
#     takeover (it runs into its lock_timeout, 55P03).  A claim the worker
#     makes afterwards is held the same way.  The worker finishes both and
#     the duplicates replay.
#  2. Under fire: the worker holds a claim while it runs 600 rounds of
#     DISCARD ALL, pg_advisory_unlock_all() and failing transactions, and
#     a duplicate tries the key again and again meanwhile: it never gets
#     'new'.
#  3. The session's end still lapses its claims at once: after all of the
#     above, the worker's last claim is taken over by a waiting duplicate
#     as soon as the worker quits (its lock_timeout of 60 s, below the 120 s
#     lease, is not what ends the wait).

use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

use FindBin;
use lib $FindBin::RealBin;
use IdemTest;

my $node = PostgreSQL::Test::Cluster->new('session_reset');
$node->init;
$node->start;
$node->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	CREATE ROLE other_role;
	GRANT ALL ON SCHEMA public TO other_role;
	CREATE TABLE effect (key text, made_by int DEFAULT pg_backend_pid());
	GRANT ALL ON effect TO PUBLIC;
});

my $worker = $node->background_psql('postgres', on_error_stop => 0);
my $dup = $node->background_psql('postgres', on_error_stop => 0);

# The worker's committed claim of $key, lease 120 s, takeover 'session',
# and its effect (autocommit, as an external call is made); dies unless new.
sub worker_claims
{
	my ($key) = @_;
	my ($out, $state, $err) = run_sql($worker, qq{
		SELECT status || '|' || token
		  FROM idem_begin('reset', '$key', '\\x01', lease => '120 s', takeover => 'session') b;});
	my ($token) = ($out // '') =~ /^new\|(\d+)$/
	  or die "claim of $key: $state $err " . ($out // '');
	run_sql($worker, qq{INSERT INTO effect (key) VALUES ('$key');});
	return $token;
}

# A duplicate attempt of $key in the dup session: its status, or its
# SQLSTATE; on 'new' or 'recover' it makes the effect too (a second effect
# is what the test must never see).
sub dup_attempt
{
	my ($key, $in_flight, $lock_timeout) = @_;
	my ($out, $state) = run_sql($dup, qq{
		SET lock_timeout = '$lock_timeout';
		SELECT status FROM idem_begin('reset', '$key', '\\x01', '$in_flight', lease => '120 s');});
	run_sql($dup, 'RESET lock_timeout;');
	return $state unless $state eq '00000';
	$out =~ s/^SET\n//;
	run_sql($dup, qq{INSERT INTO effect (key) VALUES ('$key');})
	  if $out eq 'new' || $out eq 'recover';
	return $out;
}

sub effects
{
	my ($key) = @_;
	return $node->safe_psql('postgres', qq{SELECT count(*) FROM effect WHERE key = '$key'});
}

# ---- 1. each way a session may reset itself ----

my @resets = (
	[ 'discard_all', 'DISCARD ALL;' ],
	[ 'unlock_all', 'SELECT pg_advisory_unlock_all();' ],
	[ 'reset_all', 'RESET ALL;' ],
	[ 'set_role', 'SET ROLE other_role; RESET ROLE;' ],
	[ 'session_authorization', 'SET SESSION AUTHORIZATION other_role; RESET SESSION AUTHORIZATION;' ],
	[ 'unlock_all_abort', 'BEGIN; SELECT pg_advisory_unlock_all(); SELECT 1/0; ROLLBACK;' ],
	[ 'abort_then_discard', 'BEGIN; SELECT 1/0; ROLLBACK; DISCARD ALL;' ]);

for my $r (@resets)
{
	my ($name, $sql) = @$r;
	my $t1 = worker_claims("$name-before");
	run_sql($worker, $sql);
	is(dup_attempt("$name-before", 'raise', '0'), 'IK409',
		"$name: a duplicate in raise mode gets IK409 for the claim made before");
	is(dup_attempt("$name-before", 'wait', '300ms'), '55P03',
		"$name: a waiting duplicate keeps waiting (lock_timeout), it takes nothing over");
	my $t2 = worker_claims("$name-after");
	is(dup_attempt("$name-after", 'raise', '0'), 'IK409',
		"$name: a claim made afterwards is held as well");

	for my $k ([ "$name-before", $t1 ], [ "$name-after", $t2 ])
	{
		my (undef, $state, $err) = run_sql($worker, qq{
			SELECT idem_finish('reset', '$k->[0]', $k->[1], '"done"');});
		is($state, '00000', "$name: the worker's finish of $k->[0] is accepted") or diag($err);
		is(dup_attempt($k->[0], 'raise', '0'), 'replay', "$name: the duplicate then replays $k->[0]");
		is(effects($k->[0]), '1', "$name: $k->[0] has one effect");
	}
}

# ---- 2. under fire ----

my $tf = worker_claims('fire');
my $script = join('', map {
	"DISCARD ALL;\nSELECT pg_advisory_unlock_all();\n"
	  . "BEGIN;\nSELECT pg_advisory_unlock_all();\nSELECT 1/0;\nROLLBACK;\n"
	  . "BEGIN;\nSELECT pg_advisory_unlock_all();\nCOMMIT;\n"
} 1 .. 600);
send_sql($worker, $script);
# The duplicate tries until the worker's script is through: a try that got
# 'new' is rolled back (so the next try finds the claim again) and counted.
my ($tries, $takeovers) = (0, 0);
until (sql_done($worker))
{
	my ($out, $state, $err) = run_sql($dup, q{
		DO $$
		DECLARE n int := 0;
		BEGIN
			FOR i IN 1 .. 200 LOOP
				BEGIN
					PERFORM idem_begin('reset', 'fire', '\x01', 'raise', lease => '120 s');
					n := n + 1;
					RAISE EXCEPTION 'undo' USING ERRCODE = 'P0001';
				EXCEPTION
					WHEN SQLSTATE 'IK409' THEN NULL;
					WHEN SQLSTATE 'P0001' THEN NULL;
				END;
			END LOOP;
			RAISE NOTICE 'takeovers=%', n;
		END
		$$;});
	my ($n) = ($err // '') =~ /takeovers=(\d+)/;
	die "duplicate's loop failed: $state $err" unless defined $n;
	$tries += 200;
	$takeovers += $n;
}
wait_sql($worker);
cmp_ok($tries, '>=', 200, "under fire: the duplicate tried $tries times");
is($takeovers, 0, 'under fire: no try took the live claim over');
my (undef, $state, $err) = run_sql($worker, qq{SELECT idem_finish('reset', 'fire', $tf, '"done"');});
is($state, '00000', 'under fire: the worker finishes afterwards') or diag($err);
is(effects('fire'), '1', 'under fire: one effect');

# ---- 3. the session's end still lapses its claims ----

my $tl = worker_claims('last');
send_sql($dup, q{
	SET lock_timeout = '60s';
	SELECT status FROM idem_begin('reset', 'last', '\x01', 'wait', lease => '120 s');});
ok( $node->poll_query_until('postgres', q{
		SELECT count(*) = 1 FROM pg_stat_activity
		 WHERE wait_event_type = 'Extension' AND query LIKE '%''last''%'}),
	'the duplicate waits on the last claim');
$worker->quit;
my ($out) = wait_sql($dup);
$out =~ s/^SET\n//;
is($out, 'new', "the worker's exit lets the waiting duplicate take its claim over at once");
$dup->quit;

$node->stop;
done_testing();
