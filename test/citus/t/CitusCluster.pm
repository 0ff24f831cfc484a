
# Copyright (c) 2024, idempotency authors
#
# A Citus cluster for the scale-out tests: a coordinator and two workers,
# each its own server with citus and idempotency preloaded.

package CitusCluster;

use strict;
use warnings;

use Exporter 'import';
use PostgreSQL::Test::Cluster;

our @EXPORT = qw(citus_cluster citus_node);

# A server with citus and idempotency preloaded, and CREATE EXTENSION citus
sub citus_node
{
	my ($name) = @_;
	my $n = PostgreSQL::Test::Cluster->new($name);
	# max_wal_senders > 0: a synchronous standby can be waited for
	$n->init(allows_streaming => 'logical');
	$n->append_conf('postgresql.conf', q{
shared_preload_libraries = 'citus,idempotency'
# Citus opens a connection, and prepares a transaction, per shard of a DDL
# statement
max_connections = 100
max_prepared_transactions = 100
# 2PC recovery when the test asks for it (recover_prepared_transactions)
citus.recover_2pc_interval = -1
citus.enable_statistics_collection = off
});
	# how the node's background jobs (the rebalancer) reach it: its socket
	$n->append_conf('postgresql.conf', "citus.local_hostname = '" . $n->host . "'");
	$n->start;
	$n->safe_psql('postgres', 'CREATE EXTENSION citus');
	return $n;
}

# (coordinator, worker1, worker2), started and joined
sub citus_cluster
{
	my ($prefix) = @_;
	$prefix //= '';
	my ($coord, @workers) = map { citus_node("$prefix$_") } qw(coordinator worker1 worker2);
	$coord->safe_psql('postgres',
		sprintf(q{SELECT citus_set_coordinator_host('%s', %d)}, $coord->host, $coord->port));
	for my $w (@workers)
	{
		$coord->safe_psql('postgres', sprintf(q{SELECT citus_add_node('%s', %d)}, $w->host, $w->port));
	}
	return ($coord, @workers);
}

1;
