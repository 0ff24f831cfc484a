# A backend killed while it holds an in-transaction (uncommitted) claim.
#
# 1. pg_terminate_backend: the owner's transaction rolls back, so its claim
#    is gone at once.  A duplicate that was waiting on it returns promptly
#    with status 'new' -- no lease wait -- and can finish; nothing of the
#    killed attempt (record, effect row, lock) remains.
#
# 2. SIGKILL of the backend: the postmaster treats it as a crash, terminates
#    every backend (the waiting duplicate loses its connection too) and runs
#    crash recovery, which RESETS UNLOGGED RELATIONS.  In durability mode
#    'none' (both tables unlogged; the default before 1.3) every record is
#    forgotten, completed ones of other keys included: the documented price
#    of unlogged tables.  The retry runs again (new) and gets a greater
#    token.
#
# 3. The same SIGKILL with idem_set_logged(true): completed records survive
#    the crash-restart and replay; the killed claim is gone; the retry is
#    'new' at once.
#
# Part 1 runs in the default durability mode of a new installation,
# 'completed' (claims in the unlogged idem_record, completed records moved
# to the logged idem_result); part 2 switches to 'none', part 3 to 'all'.

use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time);

use FindBin;
use lib $FindBin::RealBin;
use IdemTest;

# ---- a psql session driven statement by statement ----

# Wait until the session's psql has exited (its backend is gone); stderr.
sub wait_gone
{
	my ($s) = @_;
	my $timer = IPC::Run::timer($PostgreSQL::Test::Utils::timeout_default);
	$timer->start;
	while ($s->{run}->pumpable)
	{
		die "timed out waiting for psql to exit" if $timer->is_expired;
		$s->{run}->pump;
	}
	$s->{run}->finish;
	return $s->{stderr};
}

# ---- the node ----

my $node = PostgreSQL::Test::Cluster->new('killed');
$node->init;
# TAP clusters default to restart_after_crash = off; we want the
# production behaviour: a crashed backend makes the postmaster restart.
$node->append_conf('postgresql.conf', "restart_after_crash = on\n");
$node->start;

$node->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	CREATE TABLE effect (id bigserial PRIMARY KEY, key text NOT NULL, token bigint NOT NULL);
});

my $fp = q{idem_fingerprint('order-1', 100)};

# wait until $pid waits on a transaction lock (the claim owner's xid)
sub wait_for_xact_waiter
{
	my ($pid, $what) = @_;
	ok( $node->poll_query_until('postgres', qq{
			SELECT wait_event_type = 'Lock' AND wait_event = 'transactionid'
			  FROM pg_stat_activity WHERE pid = $pid}),
		"$what waits on the owner's transaction lock");
}

# begin the claim in an open transaction, with an effect row; returns token
sub claim_in_transaction
{
	my ($s, $key) = @_;
	run_sql($s, 'BEGIN;');
	my ($out) = run_sql($s, qq{
		SELECT status || '|' || token FROM idem_begin('pay', '$key', $fp, lease => '10 min') b;});
	like($out, qr/^new\|\d+$/, "owner claims $key in an open transaction");
	my ($token) = $out =~ /\|(\d+)$/;
	run_sql($s, qq{INSERT INTO effect (key, token) VALUES ('$key', $token);});
	return $token;
}

# the duplicate: status|token|seconds it spent in idem_begin
my $dup_sql = q{
	SELECT b.status || '|' || coalesce(b.token::text, '') || '|' ||
	       extract(epoch FROM clock_timestamp() - statement_timestamp())
	  FROM idem_begin('pay', '%s', %s) b;};

# ========== 1. pg_terminate_backend ==========

my $owner = $node->background_psql('postgres', on_error_stop => 0);
my $dup = $node->background_psql('postgres', on_error_stop => 0);
my ($owner_pid) = run_sql($owner, 'SELECT pg_backend_pid();');
my ($dup_pid) = run_sql($dup, 'SELECT pg_backend_pid();');

my $owner_token = claim_in_transaction($owner, 'k1');

send_sql($dup, sprintf($dup_sql, 'k1', $fp));
wait_for_xact_waiter($dup_pid, 'duplicate of k1');
ok(!sql_done($dup), 'duplicate of k1 is still blocked while the owner lives');

my $killed_at = time;
is($node->safe_psql('postgres', "SELECT pg_terminate_backend($owner_pid)"),
	't', 'owner of k1 terminated');
my ($out, $state) = wait_sql($dup);
my $after_kill = time - $killed_at;
is($state, '00000', 'duplicate of k1 returns without error');
like($out, qr/^new\|\d+\|/, 'duplicate of k1 gets the key: status new');
my ($dup_token, $waited) = $out =~ /^new\|(\d+)\|([\d.]+)$/;
cmp_ok($dup_token, '>', $owner_token, 'its token is greater than the killed owner\'s');
# the owner's lease is 10 min: the duplicate must not have waited for it
# (half of it is more than any step of a loaded machine takes)
cmp_ok($after_kill, '<', 300,
	sprintf('duplicate returned %.3fs after the kill, not after the 10 min lease', $after_kill));
cmp_ok($waited, '<', 300, sprintf('duplicate waited %.3fs in all', $waited));
ok($node->poll_query_until('postgres',
		"SELECT count(*) = 0 FROM pg_stat_activity WHERE pid = $owner_pid"),
	'killed owner backend is gone');
$owner->quit;

# the duplicate is now an ordinary owner: it can do the effect and finish
($out, $state) = run_sql($dup, qq{
	BEGIN;
	INSERT INTO effect (key, token) VALUES ('k1', $dup_token);
	SELECT idem_finish('pay', 'k1', $dup_token, jsonb_build_object('effect_id', currval('effect_id_seq')));
	COMMIT;});
is($state, '00000', 'duplicate finishes k1');
my $effect_id = $node->safe_psql('postgres', q{SELECT id FROM effect WHERE key = 'k1'});
like($effect_id, qr/^\d+$/, 'exactly one effect row for k1: the duplicate\'s');
is(key_records($node, 'k1'), qq{$dup_token|completed|{"effect_id": $effect_id}},
	'the only record of k1 is the duplicate\'s completed one');
is($node->safe_psql('postgres', qq{SELECT count(*) FROM effect WHERE token = $owner_token}),
	'0', 'the killed owner\'s effect row was rolled back');
($out) = run_sql($dup, sprintf($dup_sql, 'k1', $fp));
like($out, qr/^replay\|\|/, 'a later retry of k1 replays');
is(idem_lock_count($node), '0', 'no idempotency lock is left');
$dup->quit;

# ========== 2. SIGKILL, unlogged record table ==========

# This part is about what the unlogged tables forget in a crash-restart:
# switch to durability mode 'none' (idem_record and idem_result both
# unlogged, every record in idem_record), as the default 'completed' would
# keep k-done in the logged idem_result.
$node->safe_psql('postgres', q{SELECT idem_set_durability('none')});
is($node->safe_psql('postgres', 'SELECT idem_durability()'), 'none',
	'durability mode none for the unlogged crash-restart');

# a completed record of another key, which the crash-restart will forget
my $done_token = $node->safe_psql('postgres', qq{
	SELECT token FROM idem_begin('pay', 'k-done', $fp) b;});
$node->safe_psql('postgres',
	qq{SELECT idem_finish('pay', 'k-done', $done_token, '{"ok": 1}')});
is(key_records($node, 'k-done'), qq{$done_token|completed|{"ok": 1}}, 'k-done is completed');

$owner = $node->background_psql('postgres', on_error_stop => 0);
$dup = $node->background_psql('postgres', on_error_stop => 0);
($owner_pid) = run_sql($owner, 'SELECT pg_backend_pid();');
($dup_pid) = run_sql($dup, 'SELECT pg_backend_pid();');
$owner_token = claim_in_transaction($owner, 'k2');
send_sql($dup, sprintf($dup_sql, 'k2', $fp));
wait_for_xact_waiter($dup_pid, 'duplicate of k2');

my $log_offset = -s $node->logfile;
ok(kill('KILL', $owner_pid), 'owner of k2 killed with SIGKILL');
# every other backend is terminated by the postmaster: the duplicate too
my $dup_err = wait_gone($dup);
like($dup_err, qr/terminating connection because of crash of another server process|server closed the connection unexpectedly|connection to server was lost/,
	'the waiting duplicate loses its connection in the crash-restart');
ok($node->poll_query_until('postgres', 'SELECT NOT pg_is_in_recovery()'),
	'server is back after the crash-restart');
my $log = slurp_file($node->logfile, $log_offset);
like($log, qr/(?:server process|client backend) \(PID $owner_pid\) was terminated by signal 9/,
	'postmaster saw the killed backend');
like($log, qr/all server processes terminated; reinitializing/, 'postmaster reinitialized');
$owner->quit;

# crash recovery reset the unlogged table: every record is forgotten
is($node->safe_psql('postgres', 'SELECT count(*) FROM idem_record'), '0',
	'crash-restart emptied the unlogged record table (completed k-done included)');
is($node->safe_psql('postgres',
		q{SELECT relpersistence FROM pg_class WHERE relname = 'idem_record'}),
	'u', 'the record table is still unlogged');

my $t0 = time;
$out = $node->safe_psql('postgres', qq{
	SELECT status || '|' || token FROM idem_begin('pay', 'k2', $fp) b;});
cmp_ok(time - $t0, '<', 300, 'retry of k2 after the crash-restart does not wait for the 10 min lease');
like($out, qr/^new\|\d+$/, 'retry of k2 after the crash-restart: new');
my ($retry_token) = $out =~ /\|(\d+)$/;
cmp_ok($retry_token, '>', $owner_token, 'retry token is greater than the killed owner\'s');
cmp_ok($retry_token, '>', $done_token, 'retry token is greater than every token before the crash');
is($node->safe_psql('postgres', q{SELECT count(*) FROM effect WHERE key = 'k2'}), '0',
	'the killed owner\'s effect row of k2 was rolled back');
$node->safe_psql('postgres',
	qq{SELECT idem_finish('pay', 'k2', $retry_token, '{"ok": 2}')});
is($node->safe_psql('postgres', qq{SELECT status || '|' || response FROM idem_begin('pay', 'k2', $fp) b}),
	'replay|{"ok": 2}', 'k2 replays after the retry finished');
like($node->safe_psql('postgres', qq{SELECT status FROM idem_begin('pay', 'k-done', $fp) b}),
	qr/^new$/, 'k-done, completed before the crash, runs again: new (documented loss)');
is(idem_lock_count($node), '0', 'no idempotency lock is left');

# ========== 3. SIGKILL, logged record table ==========

$node->safe_psql('postgres', 'SELECT idem_set_logged(true)');
is($node->safe_psql('postgres',
		q{SELECT relpersistence FROM pg_class WHERE relname = 'idem_record'}),
	'p', 'idem_set_logged(true) made the record table logged');
$done_token = $node->safe_psql('postgres', qq{
	SELECT token FROM idem_begin('pay', 'k-done-logged', $fp) b;});
$node->safe_psql('postgres',
	qq{SELECT idem_finish('pay', 'k-done-logged', $done_token, '{"ok": 3}')});

$owner = $node->background_psql('postgres', on_error_stop => 0);
$dup = $node->background_psql('postgres', on_error_stop => 0);
($owner_pid) = run_sql($owner, 'SELECT pg_backend_pid();');
($dup_pid) = run_sql($dup, 'SELECT pg_backend_pid();');
$owner_token = claim_in_transaction($owner, 'k3');
send_sql($dup, sprintf($dup_sql, 'k3', $fp));
wait_for_xact_waiter($dup_pid, 'duplicate of k3');

ok(kill('KILL', $owner_pid), 'owner of k3 killed with SIGKILL');
wait_gone($dup);
ok($node->poll_query_until('postgres', 'SELECT NOT pg_is_in_recovery()'),
	'server is back after the second crash-restart');
$owner->quit;

is(key_records($node, 'k-done-logged'), qq{$done_token|completed|{"ok": 3}},
	'logged: the completed record survived the crash-restart');
is($node->safe_psql('postgres', qq{SELECT status || '|' || response FROM idem_begin('pay', 'k-done-logged', $fp) b}),
	'replay|{"ok": 3}', 'logged: it replays the same response');
is(key_records($node, 'k3'), '', 'logged: nothing of the killed owner\'s claim of k3 remains');
$t0 = time;
$out = $node->safe_psql('postgres', qq{
	SELECT status || '|' || token FROM idem_begin('pay', 'k3', $fp) b;});
cmp_ok(time - $t0, '<', 300, 'logged: retry of k3 does not wait for the 10 min lease');
like($out, qr/^new\|\d+$/, 'logged: retry of k3 is new');
($retry_token) = $out =~ /\|(\d+)$/;
cmp_ok($retry_token, '>', $owner_token, 'logged: retry token is greater than the killed owner\'s');
is($node->safe_psql('postgres', q{SELECT count(*) FROM effect WHERE key = 'k3'}), '0',
	'logged: the killed owner\'s effect row of k3 was rolled back');
is(idem_lock_count($node), '0', 'no idempotency lock is left');

$node->stop;
done_testing();
