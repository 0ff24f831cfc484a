
# Copyright (c) 2024, idempotency authors
#
# Fencing tokens and records across a dump and restore of a Citus cluster
# with distributed records (docs/scaling-out.md, "Tokens"): pg_dump -Fc of
# the coordinator's database, pg_restore into a fresh coordinator, the
# workers added, idem_distribute() again; every call through the
# coordinator.
#
# Cluster A: a worker fails over once (here: its WAL moved to timeline 2
# with pg_resetwal, as a promoted standby's is), so its tokens are a band
# ahead of the clock, and of every epoch the restored cluster starts from
# the clock.  On that worker: a key finished, a key claimed and aborted
# (its record deleted), a claim held (1 h lease), a claim whose lease
# lapses before the dump.  After the restore:
#  - the finished key replays its response;
#  - the aborted key's next claim gets a token greater than its aborted
#    one: no record carries that token, the coordinator's epoch sequence
#    does (a worker records each epoch it starts there, citus_tokens.c);
#  - the held claim is still held (IK409); its owner's finish with the
#    dumped token is accepted once (a second gets IK412), and replayed;
#  - the lapsed claim is taken over with a token greater than the dumped
#    one, the stale attempt's finish gets IK412, the new owner's is
#    replayed.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::RealBin/../../t";
use lib $FindBin::RealBin;
use CitusCluster;
use IdemTest qw(:DEFAULT try_sql);
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $db = 'app';

# a token: epoch << 25 | count, epoch = band << 22 | serial
sub describe
{
	my ($t) = @_;
	return sprintf('%d (band %d, serial %d, count %d)', $t, $t >> 47, ($t >> 25) & 4194303, $t & 33554431);
}

sub placement_port
{
	my ($coord, $key) = @_;
	return $coord->safe_psql($db, qq{
		SELECT n.nodeport FROM pg_dist_placement p JOIN pg_dist_node n USING (groupid)
		 WHERE p.shardid = get_shard_id_for_distribution_column('idem_record', '$key')});
}

sub key_on
{
	my ($coord, $prefix, $node) = @_;
	for my $i (1 .. 1000)
	{
		return "$prefix-$i" if placement_port($coord, "$prefix-$i") == $node->port;
	}
	die "no key of $prefix on " . $node->name;
}

# "status|token|response" of a claim through $node
sub claim
{
	my ($node, $key) = @_;
	my ($st, $out, $err) = try_sql($node, $db, qq{
		SELECT status || '|' || coalesce(token::text, '') || '|' || coalesce(response::text, '')
		  FROM idem_begin('charge', '$key', NULL, lease => '1 hour')});
	return $st eq '00000' ? $out : "ERROR $st $err";
}

# the output of $sql on $node, or "SQLSTATE message"
sub do_sql
{
	my ($node, $sql) = @_;
	my ($st, $out, $err) = try_sql($node, $db, $sql);
	return $st eq '00000' ? $out : "$st $err";
}

sub new_token
{
	my ($node, $key) = @_;
	my $c = claim($node, $key);
	my ($t) = $c =~ /^new\|(\d+)\|$/ or die "not a new claim of $key: $c";
	return $t;
}

# a Citus cluster in database $db on every node
sub app_cluster
{
	my ($prefix) = @_;
	my @nodes = map { citus_node("$prefix$_") } qw(coordinator worker1 worker2);
	for my $n (@nodes)
	{
		$n->safe_psql('postgres', "CREATE DATABASE $db");
	}
	return @nodes;
}

sub join_cluster
{
	my ($coord, @workers) = @_;
	$coord->safe_psql($db,
		sprintf(q{SELECT citus_set_coordinator_host('%s', %d)}, $coord->host, $coord->port));
	for my $w (@workers)
	{
		$coord->safe_psql($db, sprintf(q{SELECT citus_add_node('%s', %d)}, $w->host, $w->port));
	}
}

# ========== cluster A: distributed records ==========

my ($ac, $aw1, $aw2) = app_cluster('a');
$_->safe_psql($db, 'CREATE EXTENSION citus') for ($ac, $aw1, $aw2);
join_cluster($ac, $aw1, $aw2);
$ac->safe_psql($db, q{CREATE EXTENSION idempotency; SELECT idem_distribute();});

# worker 1 fails over once (timeline 2): its epochs are a band ahead
new_token($ac, key_on($ac, 'warm', $_)) for ($aw1, $aw2);
$aw1->stop;
my $out = `pg_controldata -D ${\$aw1->data_dir}`;
my ($walfile) = $out =~ /Latest checkpoint's REDO WAL file:\s+(\S+)/;
my $next = sprintf('%08X%s', 2, substr($walfile, 8, 8) . sprintf('%08X', hex(substr($walfile, 16, 8)) + 1));
system('pg_resetwal', '-l', $next, $aw1->data_dir) == 0 or die "pg_resetwal";
$aw1->start;
is($aw1->safe_psql($db, 'SELECT timeline_id FROM pg_control_checkpoint()'), '2', 'A: worker 1 is on timeline 2');

# on worker 1: a key finished, a claim held (1 h lease) and a claim whose
# lease lapses before the restore
my %key = map { $_ => key_on($ac, $_, $aw1) } qw(done aborted held lapsed);
my %t;
$t{done} = new_token($ac, $key{done});
$t{aborted} = new_token($ac, $key{aborted});
is($ac->safe_psql($db, qq{SELECT idem_abort('charge', '$key{aborted}', $t{aborted})}), 't',
	"A: $key{aborted} aborted, its record deleted");
$ac->safe_psql($db, qq{SELECT idem_finish('charge', '$key{done}', $t{done}, '{"charge": "done"}')});
$t{held} = new_token($ac, $key{held});
my ($lt) = split /\|/, $ac->safe_psql($db, qq{
	SELECT token || '|' || status FROM idem_begin('charge', '$key{lapsed}', NULL, lease => '1 second')});
$t{lapsed} = $lt;
note("$_: " . describe($t{$_})) for sort keys %t;

my $dump = $ac->basedir . '/a.dump';
my ($ret, $dout, $derr) = ('', '', '');
$ret = IPC::Run::run([ 'pg_dump', '-Fc', '-f', $dump, '-d', $ac->connstr($db) ], '>', \$dout, '2>', \$derr);
ok($ret && $derr eq '', 'A: pg_dump -Fc of the coordinator, without a warning') or diag($derr);
$_->stop for ($ac, $aw1, $aw2);

# ========== cluster B ==========

my ($bc, $bw1, $bw2) = app_cluster('b');
$_->safe_psql($db, 'CREATE EXTENSION citus') for ($bw1, $bw2);
$ret = IPC::Run::run([ 'pg_restore', '-d', $bc->connstr($db), $dump ], '>', \$dout, '2>', \$derr);
ok($ret && $derr eq '', 'B: pg_restore into a fresh coordinator, without an error') or diag($derr);
is($bc->safe_psql($db, 'SELECT count(*) FROM idem_record'), '5', 'the records restored');

join_cluster($bc, $bw1, $bw2);
is($bc->safe_psql($db, 'SELECT idem_distribute()'), 't', 'the restored records distributed again');

is(claim($bc, $key{done}), 'replay||{"charge": "done"}', "$key{done}: replays its response");

my $ta = new_token($bc, $key{aborted});
note("$key{aborted} after the restore: " . describe($ta));
cmp_ok($ta, '>', $t{aborted}, "$key{aborted}: its next claim's token is greater than its aborted one");

# the held claim: still held; its owner's finish with its token is
# accepted, once
like(do_sql($bc, qq{SELECT status FROM idem_begin('charge', '$key{held}', NULL, in_flight => 'raise')}),
	qr/^IK409/, "$key{held}: still held");
is(do_sql($bc, qq{SELECT idem_finish('charge', '$key{held}', $t{held}, '{"by": "owner"}')}), '',
	"$key{held}: its owner's finish with its token is accepted");
like(do_sql($bc, qq{SELECT idem_finish('charge', '$key{held}', $t{held}, '{"by": "again"}')}), qr/^IK412/,
	"$key{held}: a second finish with that token gets IK412");
is(claim($bc, $key{held}), 'replay||{"by": "owner"}', "$key{held}: replays its owner's response");

# the lapsed claim: taken over with a greater token, the stale attempt
# fenced off
my $c = claim($bc, $key{lapsed});
my ($t2) = $c =~ /^new\|(\d+)\|$/;
ok(defined $t2, "$key{lapsed}: taken over ($c)");
note("$key{lapsed} taken over: " . describe($t2 // 0));
cmp_ok($t2 // 0, '>', $t{lapsed}, "$key{lapsed}: the takeover's token is greater than the dumped claim's");
like(do_sql($bc, qq{SELECT idem_finish('charge', '$key{lapsed}', $t{lapsed}, '{"by": "stale"}')}), qr/^IK412/,
	"$key{lapsed}: the stale attempt's finish gets IK412");
is(do_sql($bc, qq{SELECT idem_finish('charge', '$key{lapsed}', $t2, '{"by": "new owner"}')}), '',
	"$key{lapsed}: the new owner's finish is accepted");
is(claim($bc, $key{lapsed}), 'replay||{"by": "new owner"}', "$key{lapsed}: replays the new owner's response");

$_->stop for ($bc, $bw1, $bw2);
done_testing();
