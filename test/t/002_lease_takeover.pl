# A claim committed before an external call (the "external effect" shape),
# whose worker is then killed.  The claim outlives its backend: it is
# protected by its lease, and taken over when the lease ends.
#
# 1. During the lease a retry in 'raise' mode gets IK409 at once; a retry
#    in 'wait' mode sleeps (wait event Extension, holding the waiter lock,
#    class 0x494C) until the lease ends -- not less -- then gets 'new' with
#    a greater token.  The lease is 10 min, so that no step of a slow
#    machine outlasts it; once the retry sleeps, the claim's token shortens
#    it to 1 s (idem_renew), and the retry must return after that end and
#    long before the first one: order, not a guess of the machine's speed.
# 2. Fencing: the dead worker's late idem_finish with its old token fails
#    with IK412 and its idem_abort returns false; the new owner's result
#    stands.
# 3. Contrast: a lapsed claim that nobody took over can still be finished
#    by its own token.

use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time);

use FindBin;
use lib $FindBin::RealBin;
use IdemTest;

# ---- the node ----

my $node = PostgreSQL::Test::Cluster->new('lease');
$node->init;
$node->start;
$node->safe_psql('postgres', 'CREATE EXTENSION idempotency');

my $fp = q{idem_fingerprint('mail-1')};

# ========== 1. the worker commits its claim, then dies ==========

my $worker = $node->background_psql('postgres', on_error_stop => 0);
my ($worker_pid) = run_sql($worker, 'SELECT pg_backend_pid();');
my ($out, $state) = run_sql($worker, qq{
	SELECT status || '|' || token FROM idem_begin('mail', 'k1', $fp, lease => '10 min') b;});
like($out, qr/^new\|\d+$/, 'worker claims k1 with a 10 min lease (autocommit)');
my ($worker_token) = $out =~ /\|(\d+)$/;
my $first_lease_end = $node->safe_psql('postgres', q{
	SELECT extract(epoch FROM expires_at) FROM idem_record WHERE key = 'k1'});

is($node->safe_psql('postgres', "SELECT pg_terminate_backend($worker_pid)"),
	't', 'worker terminated during its external call');
ok($node->poll_query_until('postgres',
		"SELECT count(*) = 0 FROM pg_stat_activity WHERE pid = $worker_pid"),
	'worker backend is gone');
$worker->quit;
is(key_records($node, 'k1'), "$worker_token|pending|",
	'its committed claim outlives it: k1 is pending with the worker\'s token');

# raise: in progress, at once
my $retry = $node->background_psql('postgres', on_error_stop => 0);
my ($retry_pid) = run_sql($retry, 'SELECT pg_backend_pid();');
my $t0 = time;
($out, $state) = run_sql($retry, qq{
	SELECT status FROM idem_begin('mail', 'k1', $fp, in_flight => 'raise') b;});
is($state, 'IK409', 'raise-mode retry during the lease: IK409');
# "at once": before the lease it would otherwise wait for has ended (the
# claim's own lease end, not a guess of how long a slow machine takes)
cmp_ok(time, '<', $first_lease_end,
	sprintf('raise-mode retry fails at once: before the lease end (%.3fs)', time - $t0));

# wait: sleeps until the lease ends
send_sql($retry, qq{
	SELECT b.status || '|' || coalesce(b.token::text, '') || '|' ||
	       extract(epoch FROM statement_timestamp()) || '|' || extract(epoch FROM clock_timestamp())
	  FROM idem_begin('mail', 'k1', $fp, lease => '1s') b;});
ok( $node->poll_query_until('postgres', qq{
		SELECT wait_event_type = 'Extension' AND wait_event = '@{[ idem_wait_event($node, 'IdempotencyClaim') ]}'
		  FROM pg_stat_activity WHERE pid = $retry_pid}),
	'wait-mode retry sleeps in wait event ' . idem_wait_event($node, 'IdempotencyClaim'));
is( $node->safe_psql('postgres', qq{
		SELECT mode, granted FROM pg_locks
		 WHERE pid = $retry_pid AND locktype = 'advisory' AND objsubid = 18764}),
	'AccessShareLock|t',
	'while sleeping it holds the waiter lock (class 0x494C) in share mode');
ok(!sql_done($retry), 'wait-mode retry is still blocked during the lease');
my $lease_end = $node->safe_psql('postgres', qq{
	SELECT extract(epoch FROM idem_renew('mail', 'k1', $worker_token, '1 s'))});
ok($lease_end < $first_lease_end, 'the worker\'s token shortens the lease to 1 s');
($out, $state) = wait_sql($retry);
is($state, '00000', 'wait-mode retry returns without error');
like($out, qr/^new\|\d+\|[\d.]+\|[\d.]+$/, 'wait-mode retry takes the key over: new');
my ($retry_token, $started, $returned) = $out =~ /^new\|(\d+)\|([\d.]+)\|([\d.]+)$/;
cmp_ok($lease_end - $started, '>', 0,
	sprintf('the lease had %.3fs left when the retry started', $lease_end - $started));
cmp_ok($returned, '>=', $lease_end,
	sprintf('the retry returned after the lease ended (%.3fs after the start, %.3fs after the lease end)',
		$returned - $started, $returned - $lease_end));
cmp_ok($returned, '<', $first_lease_end,
	'and long before the first lease end (the renew woke it to sleep until the new end)');
cmp_ok($retry_token, '>', $worker_token, 'the takeover token is greater than the worker\'s');
is(key_records($node, 'k1'), "$retry_token|pending|", 'k1 is pending with the retry\'s token');

# ========== 2. fencing: the dead worker's late calls ==========

my $late = $node->background_psql('postgres', on_error_stop => 0);
($out, $state) = run_sql($late,
	qq{SELECT idem_finish('mail', 'k1', $worker_token, '{"sent": "by the dead worker"}');});
is($state, 'IK412', 'the dead worker\'s late idem_finish with its old token: IK412');
($out, $state) = run_sql($late,
	qq{SELECT idem_abort('mail', 'k1', $worker_token);});
is($out, 'f', 'the dead worker\'s late idem_abort with its old token: false');
is(key_records($node, 'k1'), "$retry_token|pending|", 'k1 is untouched by the late calls');

($out, $state) = run_sql($retry,
	qq{SELECT idem_finish('mail', 'k1', $retry_token, '{"sent": "by the retry"}');});
is($state, '00000', 'the new owner finishes k1');
($out, $state) = run_sql($late, qq{
	SELECT status || '|' || response FROM idem_begin('mail', 'k1', $fp) b;});
is($out, 'replay|{"sent": "by the retry"}', 'k1 replays the new owner\'s response');
($out, $state) = run_sql($late,
	qq{SELECT idem_finish('mail', 'k1', $worker_token, '{"sent": "by the dead worker"}');});
is($state, 'IK412', 'the old token still cannot finish the completed k1');
is(key_records($node, 'k1'), qq{$retry_token|completed|{"sent": "by the retry"}},
	'k1 holds the new owner\'s result');

# ========== 3. a lapsed claim nobody took over can still be finished ==========

($out) = run_sql($late, qq{
	SELECT status || '|' || token FROM idem_begin('mail', 'k2', $fp, lease => '1s') b;});
like($out, qr/^new\|\d+$/, 'k2 claimed with a 1s lease');
my ($slow_token) = $out =~ /\|(\d+)$/;
ok( $node->poll_query_until('postgres', q{
		SELECT expires_at < clock_timestamp() FROM idem_record WHERE key = 'k2'}),
	'k2\'s lease lapsed');
($out, $state) = run_sql($late,
	qq{SELECT idem_finish('mail', 'k2', $slow_token, '{"sent": "late but alone"}');});
is($state, '00000', 'the slow worker still finishes k2: nobody took it over');
($out) = run_sql($late, qq{SELECT status || '|' || response FROM idem_begin('mail', 'k2', $fp) b;});
is($out, 'replay|{"sent": "late but alone"}', 'k2 replays it');

is(idem_lock_count($node), '0', 'no idempotency lock is left');
$retry->quit;
$late->quit;
$node->stop;
done_testing();
