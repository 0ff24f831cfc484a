
# Copyright (c) 2024, idempotency authors
#
# Fencing tokens are epoch << 25 | count (src/tokens.c): the count comes
# from the unlogged idem_token_seq, which crash recovery resets; the epoch
# is recorded in the logged idem_token_epoch (timeline << 38 | epoch),
# flushed (and sent to synchronous standbys) before the epoch's first token
# is used.  An epoch is band << 22 | serial: the next epoch is the serial
# plus one, in the same band on the same timeline.  The first one of an
# installation starts from the clock: band = days since 2020-01-01 UTC
# plus the timeline, serial = seconds of the day plus one.
# 450_timeline_fencing tests the bands across timelines.
#
# 1. Crash: the first claim after it starts a greater epoch, so every token
#    after the crash is greater than every token before -- including the
#    token of a claim still uncommitted at the crash.  The new epoch is
#    durable the moment its first token is seen: a claim that took it and
#    then rolled back, then a second crash (with the WAL writers frozen),
#    and the next epoch is greater still.
# 2. The count reaching the end of its epoch while eight sessions claim at
#    once: distinct tokens, each session's increasing, none past the limit,
#    and the next epoch the old one plus one.
# 2b. No serial left: 2200H, no token, no record.
# 3. A database still on 1.1 (logged token sequence, no epochs) on this
#    library: its tokens too stay greater across a crash, and a pre-crash
#    worker's late finish is fenced off.  Then, with tokens past 2^32, the
#    update to 1.2 and on to 1.3: tokens stay greater across it and across
#    the next crash.
# 3b. A database on 1.2 with a large epoch number: 1.2's tokens from this
#    library, then the update: the first 1.3 epoch is above them, its band
#    from the epoch number where that is above the clock's.
# 4. A synchronous standby: with it down, the first claim after a crash
#    waits for it (polling: wait event type Extension, not SyncRep) before
#    it returns a token -- also in a session with synchronous_commit =
#    local -- and returns once the standby is back; a wait cut short by
#    statement_timeout or a cancel is the usual error (57014) that hands out
#    no token, without the WARNING that the transaction "has already
#    committed locally" (issue "A misleading warning"); after a fail-over to
#    that standby, new tokens are greater than every token of the old
#    primary: in the next band, the new timeline's.

use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

use FindBin;
use lib $FindBin::RealBin;
use IdemTest;

my ($ret, $stdout, $stderr);
my $COUNT_LIMIT = 33554431 - 1048576;    # FIELD_MAX(COUNT_BITS) - COUNT_SPARE in tokens.c

my $node = PostgreSQL::Test::Cluster->new('epochs');
$node->init;
$node->append_conf('postgresql.conf', "autovacuum = off\n");
$node->start;
$node->safe_psql('postgres', 'CREATE EXTENSION idempotency');

sub claim_token
{
	my ($db, $op, $key, $extra) = @_;
	$extra = defined $extra ? ", $extra" : '';
	return $node->safe_psql($db, qq{
		SELECT token FROM idem_begin('$op', '$key', NULL$extra)});
}

sub epoch_of { return $_[0] >> 25; }
sub band_of  { return $_[0] >> 22; }     # of an epoch
sub serial_of { return $_[0] & 4194303; }    # of an epoch

# The clock as the first epoch of an installation reads it: days and
# seconds of the day since 2020-01-01 UTC.
sub clock_now
{
	my ($n) = @_;
	return split /\|/, $n->safe_psql('postgres', q{
		SELECT s / 86400 || '|' || s % 86400
		  FROM (SELECT floor(extract(epoch FROM now() - '2020-01-01 UTC'))::int8 AS s) c});
}

# The first epoch of an installation, started between the clock_now() call
# that returned ($day, $second) and now, on timeline 1.
sub check_first_epoch
{
	my ($n, $epoch, $day, $second, $name) = @_;
	my ($day_after, $second_after) = clock_now($n);
	$second_after += 86400 * ($day_after - $day);
	cmp_ok(band_of($epoch) - 1, '>=', $day, "$name: band from the day ($day) and timeline 1");
	cmp_ok(band_of($epoch) - 1, '<=', $day_after, "$name: ... not later than today");
	cmp_ok(serial_of($epoch) - 1, '>=', $second, "$name: serial from the seconds of the day ($second)");
	cmp_ok(serial_of($epoch) - 1, '<=', $second_after, "$name: ... not later than now");
	return;
}

# An epoch started after the epoch $prev, on the same timeline: the next
# serial in the same band -- exactly: nothing is logged ahead, and a crash
# resumes from the epoch recorded last.
sub check_epoch
{
	my ($epoch, $prev, $name) = @_;
	is(band_of($epoch), band_of($prev), "$name: in the same band");
	is(serial_of($epoch), serial_of($prev) + 1, "$name: the next serial");
	return;
}

# idem_token_epoch: the timeline and the epoch recorded last
sub recorded_epoch
{
	my ($n) = @_;
	return $n->safe_psql('postgres', q{
		SELECT (last_value >> 38) || '|' || (last_value & 274877906943) FROM idem_token_epoch});
}

# Freeze the WAL writer and the background writer (SIGSTOP), so that WAL
# still in memory stays there until the next crash; the immediate shutdown
# then kills them (SIGKILL) with the rest.  What is then on disk after the
# crash is what a backend itself wrote and flushed.
sub hold_wal_writers
{
	for my $pid (split /\n/, $node->safe_psql('postgres', q{
			SELECT pid FROM pg_stat_activity
			 WHERE backend_type IN ('walwriter', 'background writer')}))
	{
		kill 'STOP', $pid or die "could not stop process $pid: $!";
	}
	return;
}

# ========== 1. crashes ==========

my ($day, $second) = clock_now($node);
cmp_ok($day, '>', 2000, "days since 2020: $day");
my $t1 = claim_token('postgres', 'c', 'before', q{lease => '1h'});
check_first_epoch($node, epoch_of($t1), $day, $second,
	'the first token starts an epoch from the clock, ' . epoch_of($t1));
is($t1 & 33554431, 1, 'with count 1');
is(recorded_epoch($node), '1|' . epoch_of($t1), 'idem_token_epoch holds that epoch, on timeline 1');

# a claim left uncommitted at the crash: its client has seen the token
my $open = $node->background_psql('postgres', on_error_stop => 0);
my ($t_open) = run_sql($open, q{BEGIN; SELECT token FROM idem_begin('c', 'open', NULL);});
cmp_ok($t_open, '>', $t1, "an open transaction claimed with token $t_open");

$node->stop('immediate');
$open->quit;
$node->start;

my $t2 = claim_token('postgres', 'c', 'open', q{in_flight => 'raise'});
check_epoch(epoch_of($t2), epoch_of($t_open), 'after the crash, a new epoch ' . epoch_of($t2));
cmp_ok($t2, '>', $t_open, 'the key open at the crash gets a greater token');
cmp_ok(claim_token('postgres', 'c', 'before', q{in_flight => 'raise'}), '>', $t2,
	'and the next claim a greater one still');

# The first claim of a new epoch rolls back, the WAL writers are frozen:
# only the epoch's own flush can have put it on disk before the next crash.
$node->stop('immediate');
$node->start;
hold_wal_writers();
my $t_rolled_back = $node->safe_psql('postgres', q{
	BEGIN;
	SELECT token FROM idem_begin('c', 'rolled-back', NULL);
	ROLLBACK;});
check_epoch(epoch_of($t_rolled_back), epoch_of($t2),
	"the first claim after the second crash started epoch " . epoch_of($t_rolled_back) . ' and rolled back');
$node->stop('immediate');
$node->start;
my $t3 = claim_token('postgres', 'c', 'rolled-back');
check_epoch(epoch_of($t3), epoch_of($t_rolled_back),
	'after a third crash the epoch is greater still: ' . epoch_of($t3));
cmp_ok($t3, '>', $t_rolled_back, 'as is the token of the key that rolled back');

# ========== 2. the end of an epoch, under concurrency ==========

my $epoch = epoch_of($t3);
$node->safe_psql('postgres', q{SELECT setval('idem_token_seq', } .
	(($epoch << 25) + $COUNT_LIMIT - 40) . ')');
my $script = $node->basedir . '/roll.sql';
PostgreSQL::Test::Utils::append_to_file($script, q{
\set n :n + 1
SELECT idem_begin('roll', :client_id || '-' || :n, NULL);
});
$node->command_ok(
	[ 'pgbench', '-n', '-c', '8', '-j', '2', '-t', '25', '-D', 'n=0', '-f', $script,
		$node->connstr('postgres') ],
	'8 sessions claim 25 keys each across the end of the epoch');
is( $node->safe_psql('postgres', q{
		SELECT count(*) || '|' || count(DISTINCT token) FROM idem_record WHERE operation = 'roll'}),
	'200|200', '200 claims, 200 distinct tokens');
my @roll_epochs = split /,/, $node->safe_psql('postgres', qq{
		SELECT string_agg(DISTINCT (token >> 25)::text, ',' ORDER BY (token >> 25)::text)
		  FROM idem_record WHERE operation = 'roll'});
is(scalar @roll_epochs, 2, 'in two epochs: ' . join(', ', @roll_epochs));
is($roll_epochs[0], $epoch, 'the old epoch');
my $next_epoch = $roll_epochs[1] // 0;
check_epoch($next_epoch, $epoch, "and the next one, $next_epoch");
is( $node->safe_psql('postgres', qq{
		SELECT count(*) FROM idem_record
		 WHERE operation = 'roll' AND token & 33554431 >= $COUNT_LIMIT}),
	'0', 'no token counted past the limit');
is( $node->safe_psql('postgres', q{
		SELECT count(*) FROM (
		  SELECT token < lag(token) OVER (PARTITION BY split_part(key, '-', 1)
		                                  ORDER BY split_part(key, '-', 2)::int) AS back
		    FROM idem_record WHERE operation = 'roll') s
		 WHERE back}),
	'0', "each session's tokens increase");
is(recorded_epoch($node), "1|$next_epoch", 'idem_token_epoch holds the new epoch: one epoch started, not more');

# ========== 2b. no epoch left ==========

# idem_token_epoch at the last serial: the next epoch cannot start.  Claims
# fail with 2200H, hand out no token, leave no record, and the epoch
# recorded stays as it is.
my $saved_epoch = $node->safe_psql('postgres', 'SELECT last_value FROM idem_token_epoch');
my $full = (1 << 38) | (band_of($next_epoch) << 22) | 4194303;
$node->safe_psql('postgres', qq{
	SELECT setval('idem_token_epoch', $full);
	SELECT setval('idem_token_seq', 1, false);});
($ret, $stdout, $stderr) = $node->psql('postgres',
	q{SELECT token FROM idem_begin('x', 'exhausted', NULL)},
	extra_params => [ '-v', 'VERBOSITY=verbose' ]);
like($stderr, qr/ERROR:  2200H: idempotency token epochs are exhausted/,
	'the serial at its limit: 2200H');
like($stderr, qr/DETAIL:  The number of epochs has reached its limit\./, '... saying which limit');
is($node->safe_psql('postgres', qq{
		SELECT (SELECT count(*) FROM $IDEM_RECORDS r WHERE key = 'exhausted') || '|' ||
		       (SELECT last_value FROM idem_token_epoch)}),
	"0|$full", 'no record, and the epoch recorded unchanged');
$node->safe_psql('postgres', "SELECT setval('idem_token_epoch', $saved_epoch)");
my $t_after = claim_token('postgres', 'x', 'exhausted');
check_epoch(epoch_of($t_after), $next_epoch, 'room again: the next claim starts the epoch after ' . $next_epoch);

# ========== 3. a database still on 1.1 ==========

$node->safe_psql('postgres', 'CREATE DATABASE legacy');
$node->safe_psql('legacy', q{CREATE EXTENSION idempotency VERSION '1.1'});
$node->safe_psql('legacy', 'CHECKPOINT');
hold_wal_writers();
# The first nextval after the checkpoint WAL-logs the sequence's advance
# (by 32 values), in a transaction that rolls back: not flushed.  The
# worker's claim below uses a value that record covers, and commits having
# written only the unlogged table.
my $t_old = $node->safe_psql('legacy', q{
	BEGIN;
	SELECT token FROM idem_begin('l', 'first', NULL);
	ROLLBACK;});
my $t_worker = claim_token('legacy', 'l', 'worker', q{lease => '1h'});
cmp_ok($t_worker, '>', $t_old, "1.1: a worker committed its claim with token $t_worker");
$node->stop('immediate');
$node->start;
my $t_new = claim_token('legacy', 'l', 'worker', q{in_flight => 'raise'});
cmp_ok($t_new, '>', $t_worker, '1.1: after a crash the key gets a greater token');
($ret, $stdout, $stderr) = $node->psql('legacy',
	qq{\\set VERBOSITY verbose\nSELECT idem_finish('l', 'worker', $t_worker, '"late"')});
like($stderr, qr/ERROR:  IK412/, "1.1: the pre-crash worker's finish is fenced off");
# tokens past 2^32 under 1.1, then the update to epochs, then a crash
$node->safe_psql('legacy', q{SELECT setval('idem_token_seq', 5000000000)});
my $t_big = claim_token('legacy', 'l', 'big');
$node->safe_psql('legacy', q{ALTER EXTENSION idempotency UPDATE});
is($node->safe_psql('legacy', q{SELECT extversion FROM pg_extension WHERE extname = 'idempotency'}),
	'1.6', 'updated to 1.6 (the default version)');
my $t_updated = claim_token('legacy', 'l', 'after-update');
cmp_ok($t_updated, '>', $t_big, "tokens keep increasing across the update to epochs: $t_updated");
$node->stop('immediate');
$node->start;
cmp_ok(claim_token('legacy', 'l', 'after-update-crash'), '>', $t_updated,
	'and across the first crash after it');

# ========== 3b. a database on 1.2 with a large epoch number ==========

# Version 1.2 served by this library: tokens epoch << 32 | count, the epoch
# from nextval().  Its tokens are below (epoch + 1) << 32; here that is
# above the clock's band << 47, so the first epoch after the update to 1.3
# takes its band from the 1.2 epoch number instead: ((last + 1) >> 15) + 1,
# plus the timeline.
$node->safe_psql('postgres', 'CREATE DATABASE v12');
$node->safe_psql('v12', q{CREATE EXTENSION idempotency VERSION '1.2'});
my $e12 = 100_000_000;
$node->safe_psql('v12', "SELECT setval('idem_token_epoch', $e12)");
$node->safe_psql('v12', "SELECT setval('idem_token_seq', 1, false)");
my $t12 = claim_token('v12', 'v', 'k1');
is($t12, (($e12 + 1) << 32) + 1, "1.2: the next epoch from nextval, epoch << 32 | count: $t12");
$node->safe_psql('v12', 'ALTER EXTENSION idempotency UPDATE');
my $t13 = claim_token('v12', 'v', 'k2');
cmp_ok($t13, '>', (($e12 + 2) << 32), "1.3: above every token 1.2 could have handed out: $t13");
is(band_of(epoch_of($t13)), ((($e12 + 2) >> 15) + 1) + 1,
	'... in the band above the 1.2 epoch number, plus timeline 1 (the day is lower)');
is($t13 & 33554431, 1, '... the first token of its epoch');
$node->stop;

# ========== 4. a synchronous standby ==========

my $primary = PostgreSQL::Test::Cluster->new('sync_primary');
$primary->init(allows_streaming => 1);
$primary->append_conf('postgresql.conf', "synchronous_standby_names = '*'\n");
$primary->start;
$primary->backup('b');
my $standby = PostgreSQL::Test::Cluster->new('sync_standby');
$standby->init_from_backup($primary, 'b', has_streaming => 1);
# once promoted, it has no synchronous standby of its own to wait for
$standby->append_conf('postgresql.conf', "synchronous_standby_names = ''\n");
$standby->start;
$primary->safe_psql('postgres', 'CREATE EXTENSION idempotency');
($day, $second) = clock_now($primary);
my $s1 = $primary->safe_psql('postgres', q{SELECT token FROM idem_begin('s', 'k1', NULL)});
check_first_epoch($primary, epoch_of($s1), $day, $second, 'primary: the first epoch ' . epoch_of($s1));

$standby->stop;
$primary->stop('immediate');
$primary->start;

# a wait cut short is an error, and hands out no token
($ret, $stdout, $stderr) = $primary->psql('postgres', q{
	SET statement_timeout = '500ms';
	SELECT token FROM idem_begin('s', 'k2', NULL);},
	extra_params => [ '-v', 'VERBOSITY=verbose' ]);
like($stderr, qr/ERROR:  57014: canceling statement due to statement timeout/,
	'with the standby down, a claim that starts an epoch waits; statement_timeout: 57014');
unlike($stderr, qr/WARNING|already committed locally/,
	'and no WARNING that the transaction "has already committed locally"');
is($primary->safe_psql('postgres', q{SELECT count(*) FROM idem_record WHERE key = 'k2'}),
	'0', 'and no claim is left behind');

# a cancel: the same
my $sync_event = idem_wait_event($primary, 'IdempotencyTokenSyncRep');
my $canceled = $primary->background_psql('postgres', on_error_stop => 0,
	extra_params => [ '-v', 'VERBOSITY=verbose' ]);
send_sql($canceled, q{SELECT token FROM idem_begin('s', 'k2', NULL);});
ok( $primary->poll_query_until('postgres', qq{
		SELECT count(*) = 1 FROM pg_stat_activity
		 WHERE wait_event_type = 'Extension' AND wait_event = '$sync_event'
		   AND query LIKE '%idem_begin%'}),
	"a claim starting an epoch waits for the standby (wait event $sync_event)");
ok($primary->safe_psql('postgres', q{
		SELECT pg_cancel_backend(pid) FROM pg_stat_activity
		 WHERE wait_event_type = 'Extension' AND query LIKE '%idem_begin%'}) eq 't',
	'and is canceled');
my (undef, $cstate, $cerr) = wait_sql($canceled);
is($cstate, '57014', 'a cancel during the wait: 57014');
like($cerr, qr/ERROR:  57014: canceling statement due to user request/,
	'with the usual message');
unlike($cerr, qr/WARNING|already committed locally/,
	'and no WARNING that the transaction "has already committed locally"');
$canceled->quit;
is($primary->safe_psql('postgres', q{SELECT count(*) FROM idem_record WHERE key = 'k2'}),
	'0', 'no claim is left behind by the canceled one either');

# synchronous_commit = local in the session does not skip the wait
my $session = $primary->background_psql('postgres', on_error_stop => 0);
run_sql($session, 'SET synchronous_commit = local; BEGIN;');
send_sql($session, q{SELECT token FROM idem_begin('s', 'k2', NULL);});
ok( $primary->poll_query_until('postgres', qq{
		SELECT count(*) = 1 FROM pg_stat_activity
		 WHERE wait_event_type = 'Extension' AND wait_event = '$sync_event'
		   AND query LIKE '%idem_begin%'}),
	"a claim in a synchronous_commit = local session waits for the standby too (wait event $sync_event)");
is($primary->safe_psql('postgres', q{
		SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'}),
	'0', 'not in SyncRepWaitForLSN');
ok(!sql_done($session), 'and has not returned a token');
cmp_ok($primary->safe_psql('postgres', 'SELECT last_value FROM idem_token_seq'), '<', 0,
	'meanwhile the count is parked far below zero: what others draw from it is unusable');
$standby->start;
my ($s2, $state, $s2err) = wait_sql($session);
is($state, '00000', 'the standby back, the claim returns');
# each wait cut short above had recorded its epoch before waiting: unused,
# never handed out, but skipped
is(band_of(epoch_of($s2)), band_of(epoch_of($s1)), "with a greater epoch, $s2: in the same band");
is(serial_of(epoch_of($s2)), serial_of(epoch_of($s1)) + 3,
	'... the third serial after it: the two waits cut short took one each');
unlike($s2err, qr/WARNING/, 'and no WARNING');
run_sql($session, 'COMMIT;');
$session->quit;
my $s_max = $primary->safe_psql('postgres', q{SELECT token FROM idem_begin('s', 'k3', NULL)});

$primary->stop('immediate');
$standby->promote;
my $s4 = $standby->safe_psql('postgres', q{SELECT token FROM idem_begin('s', 'k4', NULL)});
cmp_ok($s4, '>', $s_max, 'after a fail-over, new tokens are greater than the old primary\'s');
is(band_of(epoch_of($s4)), band_of(epoch_of($s_max)) + 1, '... in the next band');
is(serial_of(epoch_of($s4)), serial_of(epoch_of($s_max)) + 1, '... with the next serial');
like(recorded_epoch($standby), qr/^2\|/, 'recorded on timeline 2');
$standby->stop;

done_testing();
