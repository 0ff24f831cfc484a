
# Copyright (c) 2024, idempotency authors
#
# Fencing tokens across shard moves, on a real Citus cluster with
# distributed records (docs/scaling-out.md, "Tokens"): every claim of a
# key gets a token greater than any earlier token of that key, whichever
# node issued it, also after the key's record was deleted.
#
#  - a key claimed on a worker whose epoch is ahead (it crashed and started
#    the next one), aborted, its shard moved to the other worker: the next
#    claim's token is greater;
#  - the same with a forced idem_forget: the stale attempt's finish gets
#    IK412, the new owner's is served and replayed;
#  - a key aborted on the worker whose epoch is ahead, its shard split and
#    the half holding the key placed on the other worker: the next claim's
#    token is greater;
#  - a worker added later (its first epoch later by the clock), the
#    records prepared with idem_distribute() and a shard moved onto it by
#    the rebalancer; a key claimed there and forgotten, its shard moved
#    back off it: the next token is greater.
# Claims go through the coordinator; Citus delegates them to the node that
# holds the key.

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

my @nodes = citus_cluster('k');
my ($coord, $w1, $w2) = @nodes;

$coord->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	SELECT idem_distribute();
});

# "shardid|port" of the record shard of $key
sub placement_of
{
	my ($key) = @_;
	return $coord->safe_psql('postgres', qq{
		SELECT p.shardid || '|' || n.nodeport FROM pg_dist_placement p JOIN pg_dist_node n USING (groupid)
		 WHERE p.shardid = get_shard_id_for_distribution_column('idem_record', '$key')});
}

# a key named "$prefix-N" whose record shard is on $node
sub key_on
{
	my ($prefix, $node) = @_;
	for my $i (1 .. 1000)
	{
		my (undef, $port) = split /\|/, placement_of("$prefix-$i");
		return "$prefix-$i" if $port == $node->port;
	}
	die "no key of $prefix on " . $node->name;
}

sub move_shard_of
{
	my ($key, $to) = @_;
	my ($shard, $port) = split /\|/, placement_of($key);
	$coord->safe_psql('postgres', sprintf(q{
		SELECT citus_move_shard_placement(%d, '%s', %d, '%s', %d, shard_transfer_mode => 'block_writes')},
		$shard, $coord->host, $port, $to->host, $to->port));
	is((split /\|/, placement_of($key))[1], $to->port, "$key: its shard moved to " . $to->name);
}

sub claim_token
{
	my ($key) = @_;
	my ($status, $token) = split /\|/, $coord->safe_psql('postgres',
		qq{SELECT status || '|' || token FROM idem_begin('charge', '$key', NULL)});
	is($status, 'new', "$key: claimed");
	return $token;
}

# every node has issued tokens (its first epoch); then worker 1 crashes, and
# its next token is in the next epoch, ahead of worker 2's
claim_token(key_on('warm', $_)) for ($w1, $w2);
$w1->stop('immediate');
$w1->start;

# ---- aborted, then moved ----

my $key = key_on('abort', $w1);
my $t1 = claim_token($key);
is($coord->safe_psql('postgres', qq{SELECT idem_abort('charge', '$key', $t1)}), 't', "$key: aborted");
move_shard_of($key, $w2);
my $t2 = claim_token($key);
cmp_ok($t2, '>', $t1, "$key: the claim after the abort and the move has a greater token");

# ---- forgotten by force, then moved ----

$w2->stop('immediate');
$w2->start;
$key = key_on('forget', $w2);
$t1 = claim_token($key);
is($coord->safe_psql('postgres', qq{SELECT idem_forget('charge', '$key', force => true)}), 'pending',
	"$key: forgotten while pending");
move_shard_of($key, $w1);
$t2 = claim_token($key);
cmp_ok($t2, '>', $t1, "$key: the claim after the forget and the move has a greater token");
my ($st) = try_sql($coord, 'postgres', qq{SELECT idem_finish('charge', '$key', $t1, '{"by": "stale"}')});
is($st, 'IK412', "$key: the stale attempt's finish is fenced off");
$coord->safe_psql('postgres', qq{SELECT idem_finish('charge', '$key', $t2, '{"by": "owner"}')});
is($w2->safe_psql('postgres', qq{SELECT status || ' ' || response FROM idem_begin('charge', '$key', NULL)}),
	'replay {"by": "owner"}', "$key: replays the owner's response");

# ---- aborted, then its shard split onto the other worker ----

# worker 2 started its epoch last: a key of its shard, claimed and aborted,
# then the shard split in two at the key, the half holding the key placed
# on worker 1
$key = key_on('split', $w2);
$t1 = claim_token($key);
is($coord->safe_psql('postgres', qq{SELECT idem_abort('charge', '$key', $t1)}), 't', "$key: aborted");
my ($shard) = split /\|/, placement_of($key);
my ($lo, $hi, $h) = split /\|/, $coord->safe_psql('postgres', qq{
	SELECT shardminvalue || '|' || shardmaxvalue || '|' || worker_hash('$key'::text)
	  FROM pg_dist_shard WHERE shardid = $shard});
my ($id1, $id2) = map { $coord->safe_psql('postgres', sprintf(q{SELECT nodeid FROM pg_dist_node WHERE nodeport = %d}, $_->port)) } ($w1, $w2);
# a split point is the last hash value of the lower half
my ($point, $nodes) = $h > $lo ? ($h - 1, "$id2, $id1") : ($h, "$id1, $id2");
$coord->safe_psql('postgres', qq{
	SELECT citus_split_shard_by_split_points($shard, ARRAY['$point'], ARRAY[$nodes],
		shard_transfer_mode => 'block_writes')});
is((split /\|/, placement_of($key))[1], $w1->port, "$key: the half of its shard holding it is on " . $w1->name);
$t2 = claim_token($key);
cmp_ok($t2, '>', $t1, "$key: the claim after the abort and the split has a greater token");

# ---- a worker added later, rebalanced onto, and moved off ----

my $w3 = citus_node('kworker3');
$coord->safe_psql('postgres', sprintf(q{SELECT citus_add_node('%s', %d)}, $w3->host, $w3->port));
is($coord->safe_psql('postgres', q{SELECT idem_distribute()}), 'f', 'the added worker prepared');
$coord->safe_psql('postgres', q{SELECT citus_rebalance_start(shard_transfer_mode => 'block_writes'); SELECT citus_rebalance_wait()});
cmp_ok($coord->safe_psql('postgres', sprintf(q{
	SELECT count(*) FROM pg_dist_placement p JOIN pg_dist_node n USING (groupid)
	 WHERE n.nodeport = %d AND p.shardid IN (SELECT shardid FROM pg_dist_shard WHERE logicalrelid = 'idem_record'::regclass)},
	$w3->port)), '>', 0, 'the rebalancer moved record shards onto the added worker');
$key = key_on('added', $w3);
$t1 = claim_token($key);
is($coord->safe_psql('postgres', qq{SELECT idem_forget('charge', '$key', force => true)}), 'pending',
	"$key: forgotten on the added worker");
move_shard_of($key, $w1);
$t2 = claim_token($key);
cmp_ok($t2, '>', $t1, "$key: the claim after moving off the added worker has a greater token");

$_->stop for (@nodes, $w3);
done_testing();
