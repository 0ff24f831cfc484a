# Copyright (c) 2024, idempotency authors
#
# A restored database comes back in the durability mode that was dumped
# (version 1.4: the idem_mode row), with its records in the tables that
# mode keeps them in -- and keeps what that mode promises across a crash
# of the server it was restored into.
#
# Cluster A, one database per mode (m_none, m_completed, m_all), each
# with five completed keys (done-1..5, external shape) and two committed
# pending claims with a 1 h lease: pend, and pend-cp with a checkpoint.
# pg_dump -Fc of each ('completed', the mode CREATE EXTENSION starts in,
# is no row in idem_mode, the others one row); pg_restore into a fresh database of cluster B (the
# restore runs CREATE EXTENSION).  On B, before a crash:
#   - idem_durability() is the dumped mode, the tables' persistence and
#     idem_mode match it;
#   - the completed records are where the mode keeps them (idem_result in
#     'completed', idem_record otherwise), so are the pending claims (in
#     'completed' the one with a checkpoint in idem_result);
#   - every completed key replays, both claims hold their keys (IK409);
#   - a new token is greater than every dumped one.
# Then B crashes (immediate stop, start):
#   - completed, all: every completed key replays its response;
#     pend-cp is still held (IK409); pend is held in 'all' and was lost in
#     'completed' (a retry gets 'new');
#   - none: every key is gone -- 'new' -- which is what that mode
#     promises across a crash (nothing): the dumped mode was kept, not
#     raised.
#
# A dump of a 1.3 database (installed at 1.2 and updated: there is no 1.3
# install script) in mode 'all', restored into 1.4: it has no idem_mode,
# so it comes back in 'completed', the new installations' mode, with every
# completed record in the logged idem_result and the pending claim in
# idem_record; after a crash the completed keys replay, the claim is gone.

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
my @done = map { "done-$_" } 1 .. 5;

# ---- helpers ----

sub persistence
{
	my ($node, $db) = @_;
	return $node->safe_psql($db, q{SELECT string_agg(relpersistence::text, '|' ORDER BY relname)
		FROM pg_class WHERE relname IN ('idem_record', 'idem_result')});
}

# "key:table:pending|completed" of every record, by key
sub placement
{
	my ($node, $db) = @_;
	return $node->safe_psql($db, q{
		SELECT string_agg(key || ':' || t || ':' || CASE WHEN completed_at IS NULL THEN 'pending' ELSE 'completed' END,
		                  ' ' ORDER BY key COLLATE "C")
		  FROM (SELECT 'idem_record' t, key, completed_at FROM idem_record
		        UNION ALL SELECT 'idem_result', key, completed_at FROM idem_result) s});
}

# "key=response" of the keys in @keys that replay, "key:claim" of the others
sub replays
{
	my ($node, $db, @keys) = @_;
	return join ' ', map {
		my $c = claim($node, $db, $_, q{in_flight => 'raise'});
		$c =~ /^replay\|\|(.*)$/ ? "$_=$1" : "$_:$c"
	} @keys;
}

sub state_of
{
	my ($node, $db, $sql) = @_;
	my ($st, $out, $err) = try_sql($node, $db, $sql);
	return $st;
}

sub held
{
	my ($node, $db, $key) = @_;
	return state_of($node, $db,
		qq{SELECT * FROM idem_begin('det', '$key', idem_fingerprint('$key'), in_flight => 'raise')});
}

# ---- cluster A: one database per mode, and one at 1.3 ----

my $ca = PostgreSQL::Test::Cluster->new('modes_a');
$ca->init;
$ca->start;

my (%want, %dump, %maxtok);
for my $db ((map { "m_$_" } @modes), 'v13')
{
	$ca->safe_psql('postgres', "CREATE DATABASE $db");
	if ($db eq 'v13')
	{
		$ca->safe_psql($db, q{CREATE EXTENSION idempotency VERSION '1.2';
			ALTER EXTENSION idempotency UPDATE TO '1.3';
			SELECT idem_set_durability('all');});
		is($ca->safe_psql($db, q{SELECT extversion FROM pg_extension WHERE extname = 'idempotency'}),
			'1.3', 'A, v13: version 1.3');
		is($ca->safe_psql($db, q{SELECT to_regclass('idem_mode') IS NULL}), 't', 'A, v13: 1.3 has no idem_mode');
	}
	else
	{
		(my $mode = $db) =~ s/^m_//;
		$ca->safe_psql($db, qq{CREATE EXTENSION idempotency; SELECT idem_set_durability('$mode');});
		# 'completed', where CREATE EXTENSION starts, is no row at all
		is($ca->safe_psql($db, q{SELECT coalesce(string_agg(durability, ','), 'no row') FROM idem_mode}),
			$mode eq 'completed' ? 'no row' : $mode, "A, $db: idem_mode holds the mode");
	}
	for my $key (@done)
	{
		my $t = token_of(claim($ca, $db, $key));
		$ca->safe_psql($db, qq{SELECT idem_finish('det', '$key', $t, '{"key": "$key"}')});
	}
	$want{$db} = join ' ', map { qq{$_={"key": "$_"}} } @done;
	token_of(claim($ca, $db, 'pend', q{lease => '1 h'}));
	unless ($db eq 'v13')
	{
		my $t = token_of(claim($ca, $db, 'pend-cp', q{lease => '1 h'}));
		$ca->safe_psql($db, qq{SELECT idem_checkpoint('det', 'pend-cp', $t, '{"step": 1}')});
	}
	is(replays($ca, $db, @done), $want{$db}, "A, $db: the completed keys replay");
	$maxtok{$db} = $ca->safe_psql($db, "SELECT max(token) FROM $IDEM_RECORDS r");
	$dump{$db} = $ca->basedir . "/$db.dump";
	$ca->command_ok([ 'pg_dump', '-Fc', '-f', $dump{$db}, '-d', $ca->connstr($db) ], "A, $db: pg_dump -Fc");
}
$ca->stop;

# ---- cluster B: the restores ----

my $cb = PostgreSQL::Test::Cluster->new('modes_b');
$cb->init;
$cb->start;

for my $db (keys %dump)
{
	$cb->safe_psql('postgres', "CREATE DATABASE $db");
	$cb->command_ok([ 'pg_restore', '--exit-on-error', '-d', $cb->connstr($db), $dump{$db} ],
		"B, $db: pg_restore into a fresh database");
}

for my $mode (@modes)
{
	my $db = "m_$mode";
	is($cb->safe_psql($db, 'SELECT idem_durability()'), $mode, "B, $db: restored in the dumped mode, '$mode'");
	is(persistence($cb, $db), $persistence{$mode}, "B, $db: idem_record|idem_result persistence is $persistence{$mode}");
	is($cb->safe_psql($db, q{SELECT coalesce(string_agg(durability, ','), 'no row') FROM idem_mode}),
		$mode eq 'completed' ? 'no row' : $mode, "B, $db: idem_mode holds the mode (no row: completed)");
	my $t_done = $mode eq 'completed' ? 'idem_result' : 'idem_record';
	is(placement($cb, $db),
		join(' ', (map { "$_:$t_done:completed" } @done), 'pend:idem_record:pending', "pend-cp:$t_done:pending"),
		$mode eq 'completed'
		? "B, $db: the completed records and the claim with a checkpoint in idem_result, the other claim in idem_record"
		: "B, $db: every record in idem_record");
	is(replays($cb, $db, @done), $want{$db}, "B, $db: every completed key replays");
	is(held($cb, $db, $_), 'IK409', "B, $db: $_ holds its key") for qw(pend pend-cp);
	my $t = token_of(claim($cb, $db, 'fresh'));
	cmp_ok($t, '>', $maxtok{$db}, "B, $db: a new token is greater than every dumped one");
	$cb->safe_psql($db, qq{SELECT idem_finish('det', 'fresh', $t, '{"key": "fresh"}')});
	$want{$db} .= ' fresh={"key": "fresh"}';
}

# the 1.3 dump
is($cb->safe_psql('v13', q{SELECT extversion FROM pg_extension WHERE extname = 'idempotency'}), '1.6',
	'B, v13: the restore installed 1.6 (the default version)');
is($cb->safe_psql('v13', 'SELECT idem_durability()'), 'completed',
	'B, v13: a 1.3 dump in mode all comes back in completed (no idem_mode in the dump)');
is(persistence($cb, 'v13'), 'u|p', 'B, v13: idem_record unlogged, idem_result logged');
is($cb->safe_psql('v13', q{SELECT coalesce(string_agg(durability, ','), 'no row') FROM idem_mode}), 'no row',
	'B, v13: idem_mode has no row (completed)');
is(placement($cb, 'v13'),
	join(' ', (map { "$_:idem_result:completed" } @done), 'pend:idem_record:pending'),
	'B, v13: every completed record is in the logged idem_result, the claim in idem_record');
is(replays($cb, 'v13', @done), $want{v13}, 'B, v13: every completed key replays');
is(held($cb, 'v13', 'pend'), 'IK409', 'B, v13: the claim holds its key');
cmp_ok(token_of(claim($cb, 'v13', 'fresh')), '>', $maxtok{v13}, 'B, v13: a new token is greater than every dumped one');

# ---- a crash of B ----

$cb->stop('immediate');
$cb->start;

for my $mode (@modes)
{
	my $db = "m_$mode";
	is($cb->safe_psql($db, 'SELECT idem_durability()'), $mode, "B, $db, after the crash: still '$mode'");
	if ($mode eq 'none')
	{
		# mode 'none' promises nothing across a crash: the dump kept the
		# mode, so the records are gone, as they would be on A
		my @c = map { claim($cb, $db, $_, q{in_flight => 'raise'}) } @done, 'fresh', 'pend', 'pend-cp';
		is(scalar(grep { /^new\|\d+\|$/ } @c), scalar(@c),
			"B, $db, after the crash: every key, completed or pending, is gone (new), as mode none allows")
		  or diag(join ' ', @c);
	}
	else
	{
		is(replays($cb, $db, @done, 'fresh'), $want{$db},
			"B, $db, after the crash: every completed key replays its response");
		is(held($cb, $db, 'pend-cp'), 'IK409', "B, $db, after the crash: pend-cp (with a checkpoint) still holds its key");
		my $c = claim($cb, $db, 'pend', q{in_flight => 'raise'});
		is($c =~ /^new\|\d+\|$/ ? 'new' : $c, $mode eq 'all' ? 'ERROR IK409' : 'new',
			"B, $db, after the crash: pend " . ($mode eq 'all' ? 'still holds its key' : 'was lost (new)'));
	}
}
is(replays($cb, 'v13', @done), $want{v13}, 'B, v13, after the crash: every completed key replays');
like(claim($cb, 'v13', 'pend', q{in_flight => 'raise'}), qr/^new\|\d+\|$/,
	'B, v13, after the crash: the claim (unlogged in completed) was lost: new');

# idem_mode_restored is a BEFORE INSERT OR UPDATE trigger: a row written
# by anything but idem_set_durability -- a restore, or a DBA -- switches to
# the mode it names.  An UPDATE of the row by a DBA, too.
{
	my ($st, $out, $err) = try_sql($cb, 'm_none', q{UPDATE idem_mode SET durability = 'all'});
	is($st, '00000', 'B, m_none: a DBA\'s UPDATE of the idem_mode row succeeds') or diag($err);
	is($cb->safe_psql('m_none', 'SELECT idem_durability() || \'|\' || (SELECT string_agg(durability, \',\') FROM idem_mode)'),
		'all|all', 'B, m_none: ... and switches to the mode it names');
}

unlike(slurp_file($cb->logfile), qr/terminated by signal|PANIC|TRAP:/, 'B: no backend crashed');
$cb->stop;
done_testing();
