
# Copyright (c) 2024, idempotency authors
#
# A Citus cluster for the scale-out tests: a coordinator and two workers,
# each its own server with citus and idempotency preloaded.

package CitusCluster;

use strict;
use warnings;

use Exporter 'import';
use IPC::Run;
use PostgreSQL::Test::Cluster;
use Test::More;

our @EXPORT = qw(citus_cluster citus_node citus_can_2pc is_tx_refusal hold_slow_commits);

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
# the purge worker's first run an hour away: a test's own idem_purge calls
# count every expired record (030_distributed.pl)
idempotency.purge_interval = '1h'
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

# Can the extension on $node ask its Citus to commit the other nodes of a
# transaction in two phases?  It does so by Citus's C function
# Use2PCForCoordinatedTransaction(), which Citus does not mark as exported:
# from PostgreSQL 16 on, modules are compiled with -fvisibility=hidden, and
# Citus's builds for them lack it.  Where it is missing, a record write in a
# transaction block that would need the two phases -- on a coordinator whose
# records are not distributed, or on the node holding a distributed key's
# shard, not delegated there by Citus -- is refused (0A000, writing
# nothing; see is_tx_refusal); autocommit calls, and calls Citus delegates
# (its own connections), are served.
#
# Decided from the dynamic symbols of the citus.so this server loads (its
# pg_config's pkglibdir), which are what dlsym, and so the extension's
# look-up, can find: a fact about the Citus build, known before and apart
# from the behaviour under test.  Without nm (binutils), by the rule above:
# PostgreSQL 16 and later.
my %can_2pc;
sub citus_can_2pc
{
	my ($node) = @_;
	my $so = $node->config_data('--pkglibdir') . '/citus.so';
	return $can_2pc{$so} if exists $can_2pc{$so};
	my ($out, $err) = ('', '');
	my $ran = eval { IPC::Run::run([ 'nm', '-D', '--defined-only', $so ], '>', \$out, '2>', \$err) };
	if (!defined $ran)
	{
		my $v = $node->safe_psql('postgres', 'SHOW server_version_num');
		note("nm could not be run ($@): Citus's Use2PCForCoordinatedTransaction taken to be "
			  . ($v >= 160000 ? 'missing' : 'exported') . " on PostgreSQL $v");
		return $can_2pc{$so} = $v < 160000 ? 1 : 0;
	}
	die "nm -D --defined-only $so failed: $err" unless $ran;
	# "0000000000123abc T Use2PCForCoordinatedTransaction"
	$can_2pc{$so} = $out =~ /^\S+\s+\S+\s+Use2PCForCoordinatedTransaction(?:\@\S*)?$/m ? 1 : 0;
	note("$so " . ($can_2pc{$so} ? 'exports' : 'does not export') . ' Use2PCForCoordinatedTransaction');
	return $can_2pc{$so};
}

# (sqlstate, stderr) of a call are the refusal of a record write in a
# transaction block where Citus cannot commit in two phases (citus_can_2pc)
sub is_tx_refusal
{
	my ($st, $err, $name) = @_;
	is($st, '0A000', "$name (0A000)");
	like($err, qr/idempotency records cannot be written in a transaction block on this Citus node/,
		"$name: the error says so");
}

# On worker $w, a deferred trigger on its shards of table charges (columns
# merchant_id, key, amount) that sleeps 4 s at commit for a key "slow-*":
# the time to kill a node while the worker's PREPARE or COMMIT is held up
sub hold_slow_commits
{
	my ($w) = @_;
	$w->safe_psql('postgres', sprintf(q{
		SET citus.enable_ddl_propagation = off;
		SET citus.enable_manual_changes_to_shards = on;
		CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF NEW.key LIKE 'slow-%%' THEN
				PERFORM pg_sleep(4);
			END IF;
			RETURN NULL;
		END $$;
		DO $$
		DECLARE s regclass;
		BEGIN
			FOR s IN SELECT shard_name FROM citus_shards
					  WHERE table_name = 'charges'::regclass AND nodeport = %d LOOP
				EXECUTE format('CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON %%s
					DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_commit()', s);
			END LOOP;
		END $$;}, $w->port));
}

1;
