# Copyright (c) 2024, idempotency authors
#
# ALTER EXTENSION UPDATE from 1.3 to 1.4 with records in flight, in each
# durability mode.  (1.3 has no install script of its own any more: each
# database is created at 1.2 and updated to 1.3 first.)
#
# One database per mode (upd_none, upd_completed, upd_all), at 1.3:
#   done-1..3  completed (in idem_result in mode 'completed', in
#              idem_record otherwise)
#   pend       a committed claim with a 1 h lease
#   pend-cp    another one, to be given a checkpoint after the update
#   lapsed     a committed claim whose 10 ms lease is over: the next
#              request takes it over
#   open       claimed and finished in a transaction still open when the
#              update starts: the update (ALTER TABLE ... ADD COLUMN on the
#              record tables) waits for it, and it commits meanwhile
# After the update, version 1.4:
#   - idem_durability() and the tables' persistence are unchanged, and
#     idem_mode holds the mode (a row for 'none' and 'all', none for
#     'completed', where a new installation starts);
#   - every completed key replays (open too);
#   - pend still holds its key (IK409) and finishes with its 1.3 token;
#   - lapsed is taken over: 'new' (no checkpoint), a greater token, one
#     takeover; its 1.3 token gets IK412;
#   - pend-cp takes a checkpoint with its 1.3 token (in mode 'completed'
#     it moves to the logged idem_result); once its lease is over (the
#     superuser moves expires_at into the past: the test does not wait an
#     hour) the next request gets 'recover' with that state;
#   - new tokens are greater than every 1.3 token;
#   - pg_dump of the updated database, restored into a fresh database,
#     comes back in the same mode, and its completed keys replay.

use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

use FindBin;
use lib $FindBin::RealBin;
use IdemTest qw(:DEFAULT :bench);

my @modes = qw(none completed all);
my %persistence = (none => 'u|u', completed => 'u|p', all => 'p|p');   # idem_record|idem_result

my $node = PostgreSQL::Test::Cluster->new('update_1_4_modes');
$node->init;
$node->start;

# ---- helpers ----

sub db_of { return "upd_$_[0]"; }

sub sql
{
	my ($db, $sql) = @_;
	return $node->safe_psql($db, $sql);
}

sub state_of
{
	my ($db, $sql) = @_;
	my ($st, $out, $err) = try_sql($node, $db, $sql);
	return $st;
}

sub persistence
{
	my ($db) = @_;
	return sql($db, q{SELECT string_agg(relpersistence::text, '|' ORDER BY relname)
		FROM pg_class WHERE relname IN ('idem_record', 'idem_result')});
}

sub version
{
	my ($db) = @_;
	return sql($db, q{SELECT extversion FROM pg_extension WHERE extname = 'idempotency'});
}

# "key=response" of the keys in @keys that replay, "key:claim" of the others
sub replays
{
	my ($db, @keys) = @_;
	return join ' ', map {
		my $c = claim($node, $db, $_, q{in_flight => 'raise'});
		$c =~ /^replay\|\|(.*)$/ ? "$_=$1" : "$_:$c"
	} @keys;
}

# where each key's record is: "key:table" by key
sub placement
{
	my ($db) = @_;
	return sql($db, q{
		SELECT string_agg(key || ':' || t, ' ' ORDER BY key COLLATE "C")
		  FROM (SELECT 'idem_record' t, key FROM idem_record
		        UNION ALL SELECT 'idem_result', key FROM idem_result) s});
}

# ---- 1.3, records in flight ----

my (%tok, %want, %maxtok, %open);
for my $mode (@modes)
{
	my $db = db_of($mode);
	$node->safe_psql('postgres', "CREATE DATABASE $db");
	sql($db, qq{CREATE EXTENSION idempotency VERSION '1.2';
		ALTER EXTENSION idempotency UPDATE TO '1.3';
		SELECT idem_set_durability('$mode');});
	is(version($db), '1.3', "$db: version 1.3");
	is(sql($db, 'SELECT idem_durability()'), $mode, "$db: mode '$mode'");

	for my $i (1 .. 3)
	{
		my $t = token_of(claim($node, $db, "done-$i"));
		sql($db, qq{SELECT idem_finish('det', 'done-$i', $t, '{"n": $i}')});
	}
	$want{$mode} = join ' ', map { qq{done-$_={"n": $_}} } 1 .. 3;
	$tok{$mode}{pend} = token_of(claim($node, $db, 'pend', q{lease => '1 h'}));
	$tok{$mode}{'pend-cp'} = token_of(claim($node, $db, 'pend-cp', q{lease => '1 h'}));
	$tok{$mode}{lapsed} = token_of(claim($node, $db, 'lapsed', q{lease => '10 ms'}));

	# open: finished in a transaction that stays open
	my $s = $open{$mode} = $node->background_psql($db, on_error_stop => 0);
	my ($out, $st, $err) = run_sql($s, q{
		BEGIN;
		SELECT token FROM idem_begin('det', 'open', idem_fingerprint('open')) b \gset
		SELECT idem_finish('det', 'open', :token, '{"open": true}');});
	is($st, '00000', "$db: open is claimed and finished in a transaction still open") or diag($err);
	$want{$mode} .= ' open={"open": true}';

	is(placement($db),
		$mode eq 'completed'
		? 'done-1:idem_result done-2:idem_result done-3:idem_result lapsed:idem_record pend:idem_record pend-cp:idem_record'
		: 'done-1:idem_record done-2:idem_record done-3:idem_record lapsed:idem_record pend:idem_record pend-cp:idem_record',
		"$db, 1.3: the records are where mode '$mode' keeps them");
	$maxtok{$mode} = sql($db, "SELECT max(token) FROM $IDEM_RECORDS r");
}

# ---- the update, while "open" is uncommitted ----

for my $mode (@modes)
{
	my $db = db_of($mode);
	my $upd = $node->background_psql($db, on_error_stop => 0);
	my ($pid) = run_sql($upd, 'SELECT pg_backend_pid();');
	send_sql($upd, 'ALTER EXTENSION idempotency UPDATE;');
	ok( $node->poll_query_until($db, qq{
			SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $pid}),
		"$db: the update waits for the open transaction");
	ok(!sql_done($upd), "$db: ... and has not finished");
	my (undef, $st) = run_sql($open{$mode}, 'COMMIT;');
	is($st, '00000', "$db: the open transaction commits while the update waits");
	(undef, $st, my $err) = wait_sql($upd);
	is($st, '00000', "$db: ALTER EXTENSION UPDATE completes") or diag($err);
	$upd->quit;
	$open{$mode}->quit;
}

# ---- 1.4 ----

for my $mode (@modes)
{
	my $db = db_of($mode);
	is(version($db), '1.6', "$db: version 1.6 (the default)");
	is(sql($db, 'SELECT idem_durability()'), $mode, "$db: the mode is still '$mode'");
	is(persistence($db), $persistence{$mode}, "$db: idem_record|idem_result persistence is still $persistence{$mode}");
	is(sql($db, q{SELECT coalesce(string_agg(durability, ','), 'no row') FROM idem_mode}),
		$mode eq 'completed' ? 'no row' : $mode, "$db: idem_mode holds the mode (no row: completed)");

	is(replays($db, (map { "done-$_" } 1 .. 3), 'open'), $want{$mode}, "$db: every completed key replays");

	# pend: held, finished with its 1.3 token
	is(state_of($db, q{SELECT * FROM idem_begin('det', 'pend', idem_fingerprint('pend'), in_flight => 'raise')}),
		'IK409', "$db: pend, claimed at 1.3, still holds its key");
	is(state_of($db, qq{SELECT idem_finish('det', 'pend', $tok{$mode}{pend}, '{"late": true}')}),
		'00000', "$db: pend finishes with its 1.3 token");
	$want{$mode} .= ' pend={"late": true}';

	# lapsed: taken over, no checkpoint
	my $c = claim($node, $db, 'lapsed', q{in_flight => 'wait', lease => '1 h'});
	like($c, qr/^new\|\d+\|$/, "$db: lapsed, its 1.3 lease over, is taken over: new (no checkpoint)");
	my ($t) = $c =~ /^new\|(\d+)/;
	cmp_ok($t // 0, '>', $maxtok{$mode}, "$db: its token is greater than every 1.3 token");
	is(sql($db, q{SELECT state || '|' || takeovers FROM idem_inspect('det', 'lapsed')}), 'pending|1',
		"$db: lapsed: one takeover");
	is(state_of($db, qq{SELECT idem_finish('det', 'lapsed', $tok{$mode}{lapsed}, '{}')}), 'IK412',
		"$db: lapsed: its 1.3 token is refused (IK412)");
	sql($db, qq{SELECT idem_finish('det', 'lapsed', $t, '{"taken": true}')});
	$want{$mode} .= ' lapsed={"taken": true}';

	# pend-cp: a checkpoint with its 1.3 token, then a takeover recovers it
	is(state_of($db, qq{SELECT idem_checkpoint('det', 'pend-cp', $tok{$mode}{'pend-cp'}, '{"step": 1}')}),
		'00000', "$db: pend-cp takes a checkpoint with its 1.3 token");
	is(placement($db) =~ /pend-cp:(\w+)/ && $1, $mode eq 'completed' ? 'idem_result' : 'idem_record',
		"$db: pend-cp with its checkpoint is in the table mode '$mode' keeps it in");
	# Moving time: the superuser ends pend-cp's lease now, as if its hour
	# had passed.
	sql($db, q{
		UPDATE idem_record SET expires_at = now() - interval '1 s' WHERE key = 'pend-cp';
		UPDATE idem_result SET expires_at = now() - interval '1 s' WHERE key = 'pend-cp';});
	$c = claim($node, $db, 'pend-cp', q{in_flight => 'raise'});
	my ($status, $t2, $resp) = split /\|/, $c, 3;
	is("$status|$resp", 'recover|{"step": 1}', "$db: pend-cp, its lease over, recovers with its checkpoint");
	cmp_ok($t2, '>', $tok{$mode}{'pend-cp'}, "$db: pend-cp: with a greater token");
	sql($db, qq{SELECT idem_finish('det', 'pend-cp', $t2, '{"resumed": true}')});
	$want{$mode} .= ' pend-cp={"resumed": true}';

	my $t3 = token_of(claim($node, $db, 'fresh'));
	cmp_ok($t3, '>', $maxtok{$mode}, "$db: a new token is greater than every 1.3 token");
	sql($db, qq{SELECT idem_finish('det', 'fresh', $t3, '{"fresh": 1}')});
	$want{$mode} .= ' fresh={"fresh": 1}';

	my @keys = ((map { "done-$_" } 1 .. 3), qw(open pend lapsed pend-cp fresh));
	is(replays($db, @keys), $want{$mode}, "$db: every completed key replays");
	is(sql($db, "SELECT count(*) FROM $IDEM_RECORDS r WHERE completed_at IS NULL"), '0', "$db: no claim is left");

	# the dump of the updated database restores in its mode
	my $dump = $node->basedir . "/$db.dump";
	$node->command_ok([ 'pg_dump', '-Fc', '-f', $dump, '-d', $node->connstr($db) ], "$db: pg_dump -Fc");
	my $r = "r_$mode";
	$node->safe_psql('postgres', "CREATE DATABASE $r");
	$node->command_ok([ 'pg_restore', '--exit-on-error', '-d', $node->connstr($r), $dump ],
		"$db: pg_restore into a fresh database");
	is(sql($r, 'SELECT idem_durability()'), $mode, "$r: restored in mode '$mode'");
	is(persistence($r), $persistence{$mode}, "$r: persistence $persistence{$mode}");
	is(replays($r, @keys), $want{$mode}, "$r: every completed key replays");
	is(placement($r), join(' ', map { "$_:" . ($mode eq 'completed' ? 'idem_result' : 'idem_record') }
			sort @keys),
		"$r: the completed records are where mode '$mode' keeps them");
}

unlike(slurp_file($node->logfile), qr/terminated by signal|PANIC|TRAP:/, 'no backend crashed');
$node->stop;
done_testing();
