
# Copyright (c) 2024, idempotency authors
#
# A shard move behind a waiting duplicate, on a real Citus cluster with
# distributed records (docs/scaling-out.md, "Operations"): A claims a key
# through the coordinator; B waits for it (in_flight => 'wait') through
# the worker that does not hold it, so B's call sleeps on the worker that
# does; citus_move_shard_placement of the key's shard starts
# (block_writes, then the default transfer mode); A finishes.
#
# The move must not queue behind B's sleep, nor A's finish behind the
# move: A's finish is served (or answered 40001, "moved during the call",
# and served when retried) long before A's lease ends, the move completes,
# B never gets `new` -- it replays A's response, or is told to retry
# (40001) and its retry replays -- and the key keeps A's token and
# response.

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

my @nodes = citus_cluster('m');
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

# run $sql on $n until it is not answered 40001 (a call that raced the
# move), at most 5 times: (sqlstate, output, stderr, tries)
sub until_served
{
	my ($n, $sql) = @_;
	my ($st, $out, $err, $tries);
	for $tries (1 .. 5)
	{
		($st, $out, $err) = try_sql($n, 'postgres', $sql);
		return ($st, $out, $err, $tries) unless $st eq '40001';
	}
	return ($st, $out, $err, 5);
}

for my $mode (qw(block_writes auto))
{
	my $key = "mw-$mode";
	my ($shard, $port) = split /\|/, placement_of($key);
	my ($holder, $other) = $port == $w1->port ? ($w1, $w2) : ($w2, $w1);

	my $tok = $coord->safe_psql('postgres',
		qq{SELECT token FROM idem_begin('charge', '$key', NULL, lease => '10 minutes')});

	my $b = $other->background_psql('postgres', on_error_stop => 0);
	send_sql($b, qq{SELECT status || '|' || coalesce(response::text, '') FROM idem_begin('charge', '$key', NULL, in_flight => 'wait');});
	$holder->poll_query_until('postgres', qq{
		SELECT count(*) > 0 FROM pg_stat_activity
		 WHERE wait_event_type = 'Extension' AND query LIKE '%idem_begin(%$key%'})
	  or die "$key: the duplicate does not sleep on the holder";

	my $mover = $coord->background_psql('postgres', on_error_stop => 0);
	send_sql($mover, sprintf(q{SELECT citus_move_shard_placement(%d, '%s', %d, '%s', %d, shard_transfer_mode => '%s');},
		$shard, $coord->host, $holder->port, $coord->host, $other->port, $mode));
	# the move is done, or waits for a shard metadata lock on the holder
	my $queued = 0;
	for (1 .. 600)
	{
		last if sql_done($mover);
		$queued = $holder->safe_psql('postgres', q{
			SELECT count(*) FROM pg_locks WHERE NOT granted AND locktype = 'advisory' AND objsubid IN (4, 8)});
		last if $queued > 0;
		select(undef, undef, undef, 0.1);
	}
	note("$key: the move " . ($queued ? 'queued for a shard lock on the holder' : 'was done first'));

	my ($st, $out, $err, $tries) = until_served($coord,
		qq{SET statement_timeout = '90s'; SELECT idem_finish('charge', '$key', $tok, '{"n": "$mode"}')});
	is($st, '00000', "$key ($mode): the owner's finish is served, not held up behind the move and the waiter")
	  or diag($err);
	note("$key: the finish took $tries tries");

	my (undef, $mst, $merr) = wait_sql($mover);
	is($mst, '00000', "$key ($mode): the move completed") or diag($merr);
	is((split /\|/, placement_of($key))[1], $other->port, "$key ($mode): the shard is on the other worker");

	my ($bout, $bst) = wait_sql($b);
	$b->quit;
	if ($bst eq '40001')
	{
		($bst, $bout) = until_served($other,
			qq{SELECT status || '|' || coalesce(response::text, '') FROM idem_begin('charge', '$key', NULL, in_flight => 'wait')});
		note("$key: the waiter was told to retry");
	}
	is("$bst $bout", qq{00000 replay|{"n": "$mode"}}, "$key ($mode): the waiting duplicate replays, never new");
	is($w1->safe_psql('postgres', qq{SELECT state || ' ' || token || ' ' || response FROM idem_inspect('charge', '$key')}),
		qq{completed $tok {"n": "$mode"}}, "$key ($mode): the key keeps the owner's token and response");
}

# ---- a call Citus routed by the placements before a move ----
# Citus sends a call to the node its placements name.  A move that commits
# between the routing and the call leaves that node without the key's
# shard, only the move's source copy, until Citus's deferred cleanup drops
# it: the call must be told to retry (40001), which Citus routes anew, not
# refused as a call Citus never delegated (0A000) -- the owner's finish
# above, refused so, left its key pending, and the waiter then took it
# over.  The race lasts microseconds; the state it leaves is made here: a
# call the node serves itself (its key is not a constant, so Citus does
# not delegate it), on the node a move has just left.
$coord->safe_psql('postgres', q{ALTER SYSTEM SET citus.defer_shard_delete_interval = -1});
$coord->reload;
{
	my $key = 'mw-left';
	my ($shard, $port) = split /\|/, placement_of($key);
	my ($holder, $other) = $port == $w1->port ? ($w1, $w2) : ($w2, $w1);
	$coord->safe_psql('postgres', sprintf(
		q{SELECT citus_move_shard_placement(%d, '%s', %d, '%s', %d, shard_transfer_mode => 'block_writes')},
		$shard, $coord->host, $holder->port, $coord->host, $other->port));
	my $local_call = qq{SELECT count(*) FROM idem_inspect('charge', (SELECT '$key'))};
	my ($st, undef, $err) = try_sql($holder, 'postgres', $local_call);
	is($st, '40001', "$key: a call on the node a move has just left, routed there before the move, is told to retry")
	  or diag($err);
	like($err, qr/moved to another node during the call/, "$key: and says why");
	$coord->safe_psql('postgres', q{CALL citus_cleanup_orphaned_resources()});
	($st, undef, $err) = try_sql($holder, 'postgres', $local_call);
	is($st, '0A000', "$key: once Citus has dropped the move's source, such a call is one Citus did not delegate")
	  or diag($err);
}

$_->stop for @nodes;
done_testing();
