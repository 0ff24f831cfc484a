
# Copyright (c) 2024, idempotency authors
#
# A streaming standby, then a fail-over to it.
#
# Two databases on the primary: "postgres" with the record table made
# logged (idem_set_logged(true), durability mode 'all'), "unlogdb" with
# both tables unlogged (durability mode 'none', the default before 1.3).
#
# On the standby (read-only, in recovery):
#   - idem_begin (even for a key that would replay), idem_finish,
#     idem_abort, idem_renew fail with 25006, never a crash; so do the
#     admin functions idem_purge and idem_set_logged;
#   - idem_fingerprint works; idem_inspect and idem_stats read the
#     replicated records of the logged table; on the unlogged table (absent
#     on a standby) they fail with the server's own "cannot access
#     temporary or unlogged relations during recovery" (0A000), and do not
#     crash either.
#
# After the primary dies (immediate stop) and the standby is promoted:
#   - logged: completed keys replay the same response; a claim that was
#     committed and pending at the fail-over still holds its key until its
#     lease ends (raise: IK409; wait: sleeps until the lease end, then takes
#     the key over with a greater token, and the old token is fenced off:
#     IK412 / false); a duplicate waiting on a pending claim is woken
#     promptly by the old worker's idem_finish on the new primary and
#     replays; a claim uncommitted at the fail-over is gone, its key is free
#     at once;
#   - unlogged: every key is forgotten (the documented price): a retry runs
#     again, with a token greater than any issued on the old primary;
#   - no backend crashed on either server.

use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time sleep);

use FindBin;
use lib $FindBin::RealBin;
use IdemTest qw(:DEFAULT try_sql);

# ---- helpers ----

my $fp = q{'\x0102'::bytea};

# ---- the primary ----

my $primary = PostgreSQL::Test::Cluster->new('primary');
$primary->init(allows_streaming => 1);
$primary->append_conf('postgresql.conf', q{
shared_preload_libraries = 'idempotency'
idempotency.databases = 'postgres'
});
$primary->start;
$primary->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	SELECT idem_set_logged(true);
	CREATE TABLE effect (key text PRIMARY KEY, token bigint NOT NULL);
});
$primary->safe_psql('postgres', 'CREATE DATABASE unlogdb');
$primary->safe_psql('unlogdb', 'CREATE EXTENSION idempotency');
# unlogdb is about unlogged records (absent on the standby, forgotten on the
# promoted one): mode 'none'.  A new installation starts in 'completed',
# which would replicate the completed records in the logged idem_result.
$primary->safe_psql('unlogdb', q{SELECT idem_set_durability('none')});

sub claim
{
	my ($node, $db, $key, $extra) = @_;
	$extra = $extra ? ", $extra" : '';
	return $node->safe_psql($db, qq{
		SELECT status || '|' || coalesce(token::text, '') || '|' || coalesce(response::text, '')
		  FROM idem_begin('pay', '$key', $fp$extra)});
}

sub token_of
{
	my ($claim) = @_;
	my ($t) = $claim =~ /^new\|(\d+)\|/ or die "not a new claim: $claim";
	return $t;
}

# completed, external shape, in both databases
my $t_done = token_of(claim($primary, 'postgres', 'done'));
$primary->safe_psql('postgres', qq{SELECT idem_finish('pay', 'done', $t_done, '{"charge": "ch_1"}')});
my $t_udone = token_of(claim($primary, 'unlogdb', 'u-done'));
$primary->safe_psql('unlogdb', qq{SELECT idem_finish('pay', 'u-done', $t_udone, '{"charge": "ch_u"}')});

# completed in the same transaction as its effect
my $t_fx = $primary->safe_psql('postgres', qq{
	BEGIN;
	SELECT token FROM idem_begin('pay', 'fx', $fp) \\gset
	INSERT INTO effect VALUES ('fx', :token);
	SELECT idem_finish('pay', 'fx', :token, jsonb_build_object('effect', :token));
	COMMIT;
	SELECT token FROM effect WHERE key = 'fx';});
($t_fx) = $t_fx =~ /(\d+)\s*$/;

# ---- the standby ----

$primary->backup('b1');
my $standby = PostgreSQL::Test::Cluster->new('standby');
$standby->init_from_backup($primary, 'b1', has_streaming => 1);
$standby->start;
$primary->wait_for_catchup($standby);

# a claim committed before the fail-over and pending at it, which its
# worker will finish after the fail-over
my $t_fin = token_of(claim($primary, 'postgres', 'pend-fin', q{lease => '10 min'}));
my $fin_end = $primary->safe_psql('postgres', q{
	SELECT extract(epoch FROM lease_until) FROM idem_inspect('pay', 'pend-fin')});

# claimed, effect written and finished, not committed at the fail-over
my $open = $primary->background_psql('postgres', on_error_stop => 0);
my ($out, $state) = run_sql($open, qq{
	BEGIN;
	SELECT token FROM idem_begin('pay', 'open', $fp) \\gset
	INSERT INTO effect VALUES ('open', :token);
	SELECT idem_finish('pay', 'open', :token, '{"uncommitted": true}');});
is($state, '00000', 'primary: "open" claimed, effect written and finished in an open transaction');
$primary->wait_for_catchup($standby);

is($standby->safe_psql('postgres', 'SELECT pg_is_in_recovery()'), 't', 'the standby is in recovery');

# ---- 1. on the standby: writes fail with 25006 ----

my @read_only = (
	[ 'idem_begin, a new key', qq{SELECT * FROM idem_begin('pay', 'fresh', $fp)} ],
	[ 'idem_begin, a completed key (would replay)', qq{SELECT * FROM idem_begin('pay', 'done', $fp)} ],
	[ 'idem_begin, a pending key, raise', qq{SELECT * FROM idem_begin('pay', 'pend-fin', $fp, 'raise')} ],
	[ 'idem_begin, a pending key, wait', qq{SELECT * FROM idem_begin('pay', 'pend-fin', $fp, 'wait')} ],
	[ 'idem_finish of a pending claim', qq{SELECT idem_finish('pay', 'pend-fin', $t_fin, '{"x": 1}')} ],
	[ 'idem_finish with a stale token', qq{SELECT idem_finish('pay', 'done', $t_done, '{"x": 1}')} ],
	[ 'idem_abort of a pending claim', qq{SELECT idem_abort('pay', 'pend-fin', $t_fin)} ],
	[ 'idem_abort with a token never issued', q{SELECT idem_abort('pay', 'nothing', 42)} ],
	[ 'idem_renew of a pending claim', qq{SELECT idem_renew('pay', 'pend-fin', $t_fin, '1 h')} ],
	[ 'idem_purge', q{SELECT idem_purge()} ],
	[ 'idem_set_logged(false)', q{SELECT idem_set_logged(false)} ],
	[ 'idem_set_logged(true)', q{SELECT idem_set_logged(true)} ],
	[ 'idem_begin in an explicit transaction',
		qq{BEGIN; SELECT * FROM idem_begin('pay', 'fresh2', $fp); COMMIT;} ],
);
for my $case (@read_only)
{
	my ($name, $sql) = @$case;
	my ($st, $o, $e) = try_sql($standby, 'postgres', $sql);
	is($st, '25006', "standby, logged: $name fails with 25006") or diag($e);
}
# the same on the unlogged table
for my $case (@read_only[ 0, 4, 6, 8, 11 ])
{
	my ($name, $sql) = @$case;
	my ($st, $o, $e) = try_sql($standby, 'unlogdb', $sql);
	is($st, '25006', "standby, unlogged: $name fails with 25006") or diag($e);
}
{
	# idem_purge plans a DELETE on the unlogged table: the planner refuses
	# it before the executor's read-only check does
	my ($st, $o, $e) = try_sql($standby, 'unlogdb', 'SELECT idem_purge()');
	like($st, qr/^(25006|0A000)$/, "standby, unlogged: idem_purge fails with 25006 or 0A000 ($st)")
	  or diag($e);
}

# ---- 2. on the standby: reads ----

is($standby->safe_psql('postgres', q{SELECT idem_fingerprint('a', 'bc') = idem_fingerprint('a', 'bc')
	AND idem_fingerprint('a', 'bc') <> idem_fingerprint('ab', 'c')}),
	't', 'standby: idem_fingerprint works');
is($standby->safe_psql('postgres', q{SELECT idem_fingerprint('a', 1, NULL)}),
	$primary->safe_psql('postgres', q{SELECT idem_fingerprint('a', 1, NULL)}),
	'standby: idem_fingerprint gives the primary\'s value');
is($standby->safe_psql('postgres',
		q{SELECT state || '|' || token || '|' || response FROM idem_inspect('pay', 'done')}),
	qq{completed|$t_done|{"charge": "ch_1"}}, 'standby, logged: idem_inspect sees the replicated completed record');
is($standby->safe_psql('postgres',
		q{SELECT state || '|' || token FROM idem_inspect('pay', 'pend-fin')}),
	"pending|$t_fin", 'standby, logged: idem_inspect sees the replicated pending claim');
is($standby->safe_psql('postgres',
		q{SELECT pending || '|' || completed FROM idem_stats WHERE operation = 'pay'}),
	'1|2', 'standby, logged: idem_stats counts the replicated records (open one not committed)');
{
	# The server refuses to read an unlogged relation in recovery with
	# 0A000 ("cannot access temporary or unlogged relations during
	# recovery").  Since 1.4 a look on a standby reads what the standby has
	# -- here, mode 'none', nothing -- and says in a NOTICE that it cannot
	# see the unlogged tables, rather than fail (or report a missing file).
	for my $case ([ 'idem_inspect', q{SELECT count(*) FROM idem_inspect('pay', 'u-done')} ],
		[ 'idem_stats', q{SELECT count(*) FROM idem_stats} ])
	{
		my ($name, $sql) = @$case;
		my ($st, $o, $e) = try_sql($standby, 'unlogdb', $sql);
		is("$st|$o", '00000|0', "standby, unlogged: $name returns nothing") or diag($e);
		like($e, qr/NOTICE:\s+(?:00000: )?pending idempotency claims cannot be seen during recovery/,
			"standby, unlogged: $name says that it cannot see the unlogged tables");
		unlike($e, qr/could not open file/, "standby, unlogged: $name does not report a missing file");
	}
}
is($standby->safe_psql('postgres', 'SELECT claims >= 0 FROM idem_counters()'), 't',
	'standby: idem_counters works');
is($standby->safe_psql('postgres', 'SELECT 1'), '1', 'standby is still up');

# ---- 3. fail-over ----

# a claim committed just before the fail-over, never finished: its lease
# (10 min) covers the fail-over and the checks after it, whatever the
# machine's speed; its token then shortens it to 1 s, and it lapses
my $t_lapse = token_of(claim($primary, 'postgres', 'pend-lapse', q{lease => '10 min'}));
my $first_lapse_end = $primary->safe_psql('postgres', q{
	SELECT extract(epoch FROM lease_until) FROM idem_inspect('pay', 'pend-lapse')});
my $max_token_primary = $primary->safe_psql('postgres',
	'SELECT greatest(max(token), 0) FROM idem_record');
$primary->wait_for_catchup($standby);
$primary->stop('immediate');
eval { $open->quit };
$standby->promote;
ok($standby->poll_query_until('postgres', 'SELECT NOT pg_is_in_recovery()'),
	'the standby was promoted');
my $new = $standby;

# a duplicate of pend-fin starts waiting at once (its lease is 10 min)
my $dup = $new->background_psql('postgres', on_error_stop => 0);
my ($dup_pid) = run_sql($dup, 'SELECT pg_backend_pid();');
send_sql($dup, qq{
	SELECT status || '|' || coalesce(token::text, '') || '|' || coalesce(response::text, '')
	  FROM idem_begin('pay', 'pend-fin', $fp);});

# completed keys replay the same response
is(claim($new, 'postgres', 'done'), 'replay||{"charge": "ch_1"}',
	'new primary, logged: a completed key replays the same response');
is(claim($new, 'postgres', 'fx'), qq{replay||{"effect": $t_fx}},
	'new primary, logged: a key completed with its effect replays');
is($new->safe_psql('postgres', q{SELECT count(*) FROM effect WHERE key = 'fx'}), '1',
	'new primary: its effect row is there, once');

# the uncommitted attempt is gone, its key free at once
my $c = claim($new, 'postgres', 'open', q{in_flight => 'raise'});
like($c, qr/^new\|\d+\|$/, 'new primary: a claim uncommitted at the fail-over is gone: new at once (raise)');
is($new->safe_psql('postgres', q{SELECT count(*) FROM effect WHERE key = 'open'}), '0',
	'new primary: its uncommitted effect row is gone too');
cmp_ok(token_of($c), '>', $max_token_primary,
	'new primary: new tokens are greater than every token of the old primary');

# pend-lapse: held until its lease ends
($state, $out, my $err) = try_sql($new, 'postgres',
	qq{SELECT * FROM idem_begin('pay', 'pend-lapse', $fp, 'raise')});
is($state, 'IK409', 'new primary: a claim pending at the fail-over is in progress during its lease (raise: IK409)')
  or diag($err);
my $lapse = $new->background_psql('postgres', on_error_stop => 0);
my ($lapse_pid) = run_sql($lapse, 'SELECT pg_backend_pid();');
send_sql($lapse, qq{
	SELECT status || '|' || coalesce(token::text, '') || '|' || extract(epoch FROM clock_timestamp())
	  FROM idem_begin('pay', 'pend-lapse', $fp, 'wait');});

# the dead worker of pend-fin is back and finishes on the new primary
ok($new->poll_query_until('postgres', qq{
	SELECT wait_event_type = 'Extension' FROM pg_stat_activity WHERE pid = $dup_pid}),
	'new primary: a duplicate of the pending claim pend-fin sleeps');
ok(!sql_done($dup), '... and is still waiting');
$new->safe_psql('postgres', qq{SELECT idem_finish('pay', 'pend-fin', $t_fin, '{"charge": "ch_fin"}')});
($out, $state) = wait_sql($dup);
is($out, 'replay||{"charge": "ch_fin"}',
	'new primary: the old worker\'s finish with its token wakes the duplicate: replay');
cmp_ok(time, '<', $fin_end, '... during the lease (woken by the finish, not by the lease end)');

# pend-lapse: the waiting duplicate takes over when the lease ends
ok($new->poll_query_until('postgres', qq{
	SELECT wait_event_type = 'Extension' FROM pg_stat_activity WHERE pid = $lapse_pid}),
	'new primary: a duplicate of pend-lapse (wait) sleeps');
ok(!sql_done($lapse), '... and is still waiting');
my $lapse_end = $new->safe_psql('postgres', qq{
	SELECT extract(epoch FROM idem_renew('pay', 'pend-lapse', $t_lapse, '1 s'))});
ok($lapse_end < $first_lapse_end, 'new primary: the token of pend-lapse shortens its lease to 1 s');
($out, $state, $err) = wait_sql($lapse);
like($out, qr/^new\|\d+\|[\d.]+$/, 'new primary: when the lease lapses the waiting duplicate takes the key over')
  or diag("$state $err");
my ($t_lapse2, $at) = $out =~ /^new\|(\d+)\|([\d.]+)$/;
cmp_ok($at // 0, '>=', $lapse_end, '... not before the lease ended');
cmp_ok($at // 0, '<', $first_lapse_end, '... the shortened one, not the first');
cmp_ok($t_lapse2 // 0, '>', $t_lapse, '... with a greater token');
($state, $out, $err) = try_sql($new, 'postgres',
	qq{SELECT idem_finish('pay', 'pend-lapse', $t_lapse, '{"by": "old worker"}')});
is($state, 'IK412', 'new primary: the old worker\'s token of pend-lapse is fenced off: IK412');
is($new->safe_psql('postgres', qq{SELECT idem_abort('pay', 'pend-lapse', $t_lapse)}), 'f',
	'new primary: ... and idem_abort with it changes nothing: false');
$new->safe_psql('postgres', qq{SELECT idem_finish('pay', 'pend-lapse', $t_lapse2, '{"by": "retry"}')});
is(claim($new, 'postgres', 'pend-lapse'), 'replay||{"by": "retry"}',
	'new primary: pend-lapse replays the new owner\'s response');
$dup->quit;
$lapse->quit;

# the unlogged database forgot everything, and works
is($new->safe_psql('unlogdb', 'SELECT count(*) FROM idem_record'), '0',
	'new primary, unlogged: the record table is empty (not replicated)');
$c = claim($new, 'unlogdb', 'u-done');
like($c, qr/^new\|\d+\|$/, 'new primary, unlogged: a completed key is forgotten and runs again (documented)');
cmp_ok(token_of($c), '>', $t_udone, 'new primary, unlogged: with a greater token');
$new->safe_psql('unlogdb', sprintf(q{SELECT idem_finish('pay', 'u-done', %d, '{"charge": "ch_u2"}')}, token_of($c)));
is(claim($new, 'unlogdb', 'u-done'), 'replay||{"charge": "ch_u2"}', 'new primary, unlogged: and replays afterwards');

# the admin functions work again
is($new->safe_psql('postgres', q{SELECT idem_purge() >= 0}), 't', 'new primary: idem_purge works');
$new->safe_psql('postgres', 'SELECT idem_set_logged(false); SELECT idem_set_logged(true)');
is(claim($new, 'postgres', 'done'), 'replay||{"charge": "ch_1"}',
	'new primary: records survive idem_set_logged(false) + (true)');

for my $n ($primary, $new)
{
	my $log = slurp_file($n->logfile);
	unlike($log, qr/terminated by signal|PANIC|TRAP:/, $n->name . ': no backend crashed');
}
$new->stop;
done_testing();
