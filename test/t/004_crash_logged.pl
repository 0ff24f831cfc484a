# Crash (immediate shutdown, then start) with the record table made LOGGED
# by idem_set_logged(true): what exactly-once across crashes relies on.
#
# 1. Completed records survive and replay the same response.
# 2. A claim committed before an external call and pending at the crash is
#    still pending afterwards: during its lease a retry gets IK409 (raise)
#    or waits (wait); when the lease lapses the retry takes the key over
#    with a greater token, and the old token is fenced off (IK412).
# 3. A claim, effect and finish that were not committed at the crash are
#    all gone: the retry is 'new' at once.
# 4. Records committed in the same transaction as an effect row agree with
#    that effect after a crash in the middle of a load: effect present <=>
#    record completed, with the effect's id in the response.

use strict;
use warnings;

use IPC::Run;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

use FindBin;
use lib $FindBin::RealBin;
use IdemTest;

# ---- the node ----

my $node = PostgreSQL::Test::Cluster->new('crash_logged');
$node->init;
$node->start;
$node->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	SELECT idem_set_logged(true);
	CREATE TABLE effect (id bigserial PRIMARY KEY, key text NOT NULL, token bigint NOT NULL);
});
is($node->safe_psql('postgres',
		q{SELECT relpersistence FROM pg_class WHERE relname = 'idem_record'}),
	'p', 'idem_set_logged(true) made the record table logged');

my $fp = q{idem_fingerprint('req')};

sub begin_claim
{
	my ($key, $extra) = @_;
	$extra = defined $extra ? ", $extra" : '';
	return $node->safe_psql('postgres', qq{
		SELECT status || '|' || coalesce(token::text, response::text)
		  FROM idem_begin('op', '$key', $fp$extra) b});
}

sub token_of
{
	my ($claim) = @_;
	my ($token) = $claim =~ /^new\|(\d+)$/;
	return $token // -1;
}

sub records
{
	my ($key) = @_;
	return $node->safe_psql('postgres', qq{
		SELECT token, CASE WHEN completed_at IS NULL THEN 'pending' ELSE 'completed' END, response
		  FROM idem_record WHERE key = '$key' ORDER BY token});
}

# ---- before the crash ----

# completed, external shape
my $t_done = token_of(begin_claim('k-done'));
$node->safe_psql('postgres', qq{SELECT idem_finish('op', 'k-done', $t_done, '{"charge": "ch_1"}')});

# completed, in the same transaction as its effect
my $t_fx = $node->safe_psql('postgres', qq{
	BEGIN;
	SELECT token FROM idem_begin('op', 'k-fx', $fp) b \\gset
	INSERT INTO effect (key, token) VALUES ('k-fx', :token);
	SELECT idem_finish('op', 'k-fx', :token, jsonb_build_object('effect_id', currval('effect_id_seq'))) \\gset
	COMMIT;
	SELECT token FROM effect WHERE key = 'k-fx';});
like($t_fx, qr/^\d+$/, 'k-fx completed together with its effect row');

# pending with a lease that outlasts the crash-restart and every check
# after it (it is shortened when the test wants it to lapse)
my $t_pending = token_of(begin_claim('k-pending', q{lease => '10 min'}));
my $first_lease_end = $node->safe_psql('postgres', q{
	SELECT extract(epoch FROM expires_at) FROM idem_record WHERE key = 'k-pending'});

# claim, effect and finish done but not committed at the crash
my $open = $node->background_psql('postgres', on_error_stop => 0);
my ($out, $state) = run_sql($open, qq{
	BEGIN;
	SELECT token FROM idem_begin('op', 'k-open', $fp) b \\gset
	INSERT INTO effect (key, token) VALUES ('k-open', :token);
	SELECT idem_finish('op', 'k-open', :token, '{"uncommitted": true}');});
is($state, '00000', 'k-open claimed, effect written and finished in an open transaction');

# ---- a crash in the middle of a load of in-transaction claims ----

# Each transaction claims a key; if new, it writes the effect and finishes
# with the effect's id, then commits (or, one time in ten, rolls back); if
# a replay, it checks that the replayed id is the key's effect.
my $script = $node->basedir . '/load.sql';
append_to_file($script, q{
\set k random(1, 5000)
\set r random(1, 10)
BEGIN;
SELECT (status = 'new')::int AS is_new, coalesce(token, 0) AS token,
       coalesce(response->>'effect_id', '0') AS eid
  FROM idem_begin('load', 'L' || :k, idem_fingerprint(:k)) b \gset
\if :is_new
INSERT INTO effect (key, token) VALUES ('L' || :k, :token) RETURNING id AS new_eid \gset
SELECT idem_finish('load', 'L' || :k, :token, jsonb_build_object('effect_id', :new_eid));
\if :r = 1
ROLLBACK;
\else
COMMIT;
\endif
\else
SELECT 1 / count(*) FROM effect WHERE id = :eid AND key = 'L' || :k;
COMMIT;
\endif
});
my ($bench_out, $bench_err) = ('', '');
my $bench = IPC::Run::start(
	[ 'pgbench', '-n', '-c', '8', '-j', '2', '-T', '60', '-f', $script,
		$node->connstr('postgres') ],
	'>', \$bench_out, '2>', \$bench_err);
ok( $node->poll_query_until('postgres',
		q{SELECT count(*) >= 1000 FROM idem_record WHERE operation = 'load'}),
	'load is running');
my $effects_before = $node->safe_psql('postgres', 'SELECT count(*) FROM effect');
my $max_token_before = $node->safe_psql('postgres', 'SELECT last_value FROM idem_token_seq');

$node->stop('immediate');
$bench->finish;
note("pgbench output at the crash:\n$bench_out\n$bench_err");
# pgbench words it "client N aborted in command ..." or, for an error
# in a query, "client N script S aborted in command ...": count clients
my %aborted = map { $_ => 1 } $bench_err =~ /client (\d+) (?:script \d+ )?aborted/g;
my @aborted = keys %aborted;
is(scalar @aborted, 8, 'the crash cut all 8 load clients off mid-run');
unlike($bench_err, qr/division by zero/, 'no replay during the load pointed at a wrong effect');
unlike($bench_err, qr/ERROR/, 'the load met no error before the crash');
$open->quit;
$node->start;

# ---- after the crash ----

is($node->safe_psql('postgres',
		q{SELECT relpersistence FROM pg_class WHERE relname = 'idem_record'}),
	'p', 'the record table is still logged');

# 2. the pending claim is still pending and its lease holds: a retry
#    sleeps while the other checks run
is(records('k-pending'), "$t_pending|pending|", 'k-pending is still pending after the crash');
my $retry = $node->background_psql('postgres', on_error_stop => 0);
my ($retry_pid) = run_sql($retry, 'SELECT pg_backend_pid();');
($out, $state) = run_sql($retry, qq{SELECT status FROM idem_begin('op', 'k-pending', $fp, in_flight => 'raise') b;});
is($state, 'IK409', 'k-pending during its lease, raise mode: IK409');
send_sql($retry, qq{
	SELECT b.status || '|' || coalesce(b.token::text, '') || '|' || extract(epoch FROM clock_timestamp())
	  FROM idem_begin('op', 'k-pending', $fp) b;});
ok( $node->poll_query_until('postgres', qq{
		SELECT wait_event_type = 'Extension' FROM pg_stat_activity WHERE pid = $retry_pid}),
	'k-pending during its lease, wait mode: sleeps');
ok(!sql_done($retry), 'and is still blocked');

# 1. completed records survive
is(records('k-done'), qq{$t_done|completed|{"charge": "ch_1"}}, 'k-done survived the crash');
is(begin_claim('k-done'), 'replay|{"charge": "ch_1"}', 'k-done replays the same response');
my $fx_id = $node->safe_psql('postgres', q{SELECT id FROM effect WHERE key = 'k-fx'});
is(begin_claim('k-fx'), qq{replay|{"effect_id": $fx_id}}, 'k-fx replays the id of its effect row');

# 3. nothing of the uncommitted attempt
is(records('k-open'), '', 'k-open: its uncommitted claim and finish are gone');
is($node->safe_psql('postgres', q{SELECT count(*) FROM effect WHERE key = 'k-open'}), '0',
	'k-open: its uncommitted effect is gone');
my $claim = begin_claim('k-open', q{in_flight => 'raise'});
like($claim, qr/^new\|/, 'k-open retry: new (raise mode, no IK409)');
cmp_ok(token_of($claim), '>', $max_token_before,
	'its token is greater than every token issued before the crash');

# 4. effect present <=> record completed, for the load
my $load = $node->safe_psql('postgres', q{
	SELECT count(*) FILTER (WHERE completed_at IS NOT NULL),
	       count(*) FILTER (WHERE completed_at IS NULL)
	  FROM idem_record WHERE operation = 'load'});
my ($load_completed, $load_pending) = split /\|/, $load;
diag("load: $effects_before effects counted while it ran; after the crash $load_completed completed records, $load_pending pending");
cmp_ok($load_completed, '>=', 1000, 'the load completed records before the crash');
is($load_pending, '0', 'no load claim is left pending (all were in-transaction)');
is( $node->safe_psql('postgres', q{
		SELECT count(*) FROM (SELECT key FROM effect GROUP BY key HAVING count(*) > 1) d}),
	'0', 'at most one effect row per key');
is( $node->safe_psql('postgres', q{
		SELECT count(*) FROM effect e
		 WHERE e.key LIKE 'L%' AND NOT EXISTS (
			SELECT 1 FROM idem_record r
			 WHERE r.operation = 'load' AND r.key = e.key AND r.completed_at IS NOT NULL
			   AND r.token = e.token
			   AND r.response = jsonb_build_object('effect_id', e.id))}),
	'0', 'every effect row has its completed record, with its id and token');
is( $node->safe_psql('postgres', q{
		SELECT count(*) FROM idem_record r
		 WHERE r.operation = 'load' AND r.completed_at IS NOT NULL AND NOT EXISTS (
			SELECT 1 FROM effect e
			 WHERE e.key = r.key AND e.token = r.token
			   AND r.response = jsonb_build_object('effect_id', e.id))}),
	'0', 'every completed record has its effect row');

# 2 (continued). when the lease lapses the retry takes the key over: the
# old worker's token shortens it to 1 s (a renew wakes the sleepers, who
# sleep again until the new end)
ok(!sql_done($retry), 'k-pending: the retry still sleeps after the other checks');
my $lease_end = $node->safe_psql('postgres', qq{
	SELECT extract(epoch FROM idem_renew('op', 'k-pending', $t_pending, '1 s'))});
ok($lease_end < $first_lease_end, 'k-pending: its token shortens its lease to 1 s');
($out, $state) = wait_sql($retry);
like($out, qr/^new\|\d+\|[\d.]+$/, 'when the lease lapses the retry takes k-pending over: new');
my ($t_pending2, $returned) = $out =~ /^new\|(\d+)\|([\d.]+)$/;
cmp_ok($returned, '>=', $lease_end, 'not before the lease ended');
cmp_ok($returned, '<', $first_lease_end, '... the shortened one');
cmp_ok($t_pending2, '>', $max_token_before, 'with a token greater than every token before the crash');
($out, $state) = run_sql($retry, qq{SELECT idem_finish('op', 'k-pending', $t_pending, '{"by": "old worker"}');});
is($state, 'IK412', 'the old worker\'s token of k-pending is fenced off: IK412');
($out, $state) = run_sql($retry, qq{SELECT idem_finish('op', 'k-pending', $t_pending2, '{"by": "retry"}');});
is($state, '00000', 'the retry finishes k-pending');
is(begin_claim('k-pending'), 'replay|{"by": "retry"}', 'k-pending replays the retry\'s response');
$retry->quit;

$node->stop;
done_testing();
