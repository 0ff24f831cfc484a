
# Copyright (c) 2024, idempotency authors
#
# ALTER EXTENSION idempotency UPDATE on a Citus cluster whose records are
# already distributed (idem_distribute() at 1.5), with claims in flight.
# The update binds idem_begin and idem_inspect to the C entry points of
# their argument and column lists, replacing the functions in place: they
# must stay the functions Citus distributed (the same OIDs, each with its
# distribution argument and colocation), so that calls through every node
# are still delegated to the node of the key.
#
#  - every node reports the new version, and idem_begin and idem_inspect
#    bind their new entry points there;
#  - pg_dist_object still lists both, on every node, as before the update;
#  - through every node: the completed key replays, the pending claim
#    refuses a duplicate (IK409) and its holder finishes it with the token
#    it got before the update, idem_inspect answers with all its columns, and
#    a new key is claimed and finished once.

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

my @nodes = citus_cluster('u');
my ($coord, $w1, $w2) = @nodes;

# a new key claimed and finished through node $n (two statements: Citus
# delegates a call whose arguments are constants)
sub claim_and_finish
{
	my ($n, $key, $response) = @_;
	my $token = $n->safe_psql('postgres', qq{SELECT token FROM idem_begin('charge', '$key', NULL)});
	$n->safe_psql('postgres', qq{SELECT idem_finish('charge', '$key', $token, '$response')});
	return $n->safe_psql('postgres', qq{SELECT status FROM idem_begin('charge', '$key', NULL)});
}

$coord->safe_psql('postgres', q{
	CREATE EXTENSION idempotency VERSION '1.5';
	SELECT idem_distribute();
});
claim_and_finish($coord, 'done', '{"charged": "at 1.5"}');
my $pending_token = $coord->safe_psql('postgres',
	q{SELECT token FROM idem_begin('charge', 'pending', NULL, lease => '1 hour')});
like($pending_token, qr/^\d+$/, 'a claim made at 1.5 through the coordinator is pending');

# what Citus knows of the two functions, on a node
sub distribution_of
{
	my ($n) = @_;
	return $n->safe_psql('postgres', q{
		SELECT string_agg(format('%s=%s:%s:%s:%s', p.proname, p.oid, d.distribution_argument_index,
								 d.colocationid, d.force_delegation), ' ' ORDER BY p.proname)
		  FROM pg_proc p
		  JOIN pg_dist_object d ON d.classid = 'pg_proc'::regclass AND d.objid = p.oid
		 WHERE p.oid IN ('idem_begin(text, text, bytea, text, interval, interval, text, interval)'::regprocedure,
						 'idem_inspect(text, text)'::regprocedure)});
}
my %before = map { $_->name => distribution_of($_) } @nodes;
like($before{ $coord->name }, qr/^idem_begin=\d+:1:\d+:t idem_inspect=\d+:1:\d+:t$/,
	'at 1.5, Citus distributes idem_begin and idem_inspect by their key');

$coord->safe_psql('postgres', 'ALTER EXTENSION idempotency UPDATE');
my $current = $coord->safe_psql('postgres',
	q{SELECT default_version FROM pg_available_extensions WHERE name = 'idempotency'});

for my $n (@nodes)
{
	my $name = $n->name;
	is($n->safe_psql('postgres', q{SELECT extversion FROM pg_extension WHERE extname = 'idempotency'}),
		$current, "$name: updated to $current");
	is($n->safe_psql('postgres', q{
		SELECT string_agg(proname || '=' || prosrc, ' ' ORDER BY proname) FROM pg_proc
		 WHERE oid IN ('idem_begin(text, text, bytea, text, interval, interval, text, interval)'::regprocedure,
					   'idem_inspect(text, text)'::regprocedure)}),
		'idem_begin=idem_begin_1_4 idem_inspect=idem_inspect_1_4',
		"$name: idem_begin and idem_inspect bind the entry points of their argument and column lists");
	is(distribution_of($n), $before{$name},
		"$name: they are the functions Citus distributed (the same OIDs, distribution and colocation)");
}

my $finished;
for my $n (@nodes)
{
	my $name = $n->name;
	is($n->safe_psql('postgres', q{SELECT status || ' ' || response FROM idem_begin('charge', 'done', NULL)}),
		'replay {"charged": "at 1.5"}', "$name: the key completed at 1.5 replays");
	is($n->safe_psql('postgres', q{
		SELECT state || ' ' || takeovers || ' ' || (remembered_until IS NULL)
		  FROM idem_inspect('charge', 'done')}),
		'completed 0 true', "$name: idem_inspect answers with all its columns");
	my ($st) = try_sql($n, 'postgres', q{SELECT idem_begin('charge', 'pending', NULL, in_flight => 'raise')});
	if (!$finished)
	{
		is($st, 'IK409', "$name: the claim pending since 1.5 refuses a duplicate (IK409)");
		$n->safe_psql('postgres', qq{SELECT idem_finish('charge', 'pending', $pending_token, '"finished"')});
		$finished = 1;
	}
	else
	{
		is($st, '00000', "$name: the claim pending since 1.5, finished with its token, replays");
	}
	is(claim_and_finish($n, "new-$name", '"new"'), 'replay', "$name: a new key is claimed, finished and replays");
}
is(join(' ', map {
			my $key = $_;
			$coord->safe_psql('postgres', qq{SELECT state FROM idem_inspect('charge', '$key')})
		} 'done', 'pending', map { 'new-' . $_->name } @nodes),
	'completed completed completed completed completed', 'every key is completed once');

done_testing();
