
# Copyright (c) 2024, idempotency authors
#
# A NULL tenant or key on a real Citus cluster (docs/scaling-out.md,
# "Tenant types"): Citus 13.2's delegation of a distributed function
# hashes the constant of its distribution argument without looking at
# whether it is NULL, and for a type passed by reference (numeric, text,
# uuid) that took the node down.  One database per layout, each its own
# Citus cluster on the same three servers:
#
#  - records colocated with tables distributed by a numeric, a text and a
#    uuid tenant; records distributed by key (a text);
#  - idem_begin, idem_inspect, idem_finish (and the rest) with a NULL
#    tenant or key, as a literal and as a prepared statement's parameter,
#    through the coordinator and through each worker, get 22004 as a
#    bigint tenant does; every node stays up (a session opened before on
#    each node still answers), and a call with a tenant still works.

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

my @nodes = citus_cluster('n');
my ($coord, $w1, $w2) = @nodes;

# database $db on every node, a Citus cluster of its own, with the extension
sub citus_database
{
	my ($db) = @_;
	for my $n (@nodes)
	{
		$n->safe_psql('postgres', "CREATE DATABASE $db");
		$n->safe_psql($db, 'CREATE EXTENSION citus');
	}
	$coord->safe_psql($db,
		sprintf(q{SELECT citus_set_coordinator_host('%s', %d)}, $coord->host, $coord->port));
	$coord->safe_psql($db, sprintf(q{SELECT citus_add_node('%s', %d)}, $_->host, $_->port))
	  for ($w1, $w2);
	$coord->safe_psql($db, 'CREATE EXTENSION idempotency');
}

# db => [tenant type, a tenant of it]; 'bykey' is distributed by key
my %layouts = (
	tnumeric => [ 'numeric', '42.5' ],
	ttext    => [ 'text',    q{'acme'::text} ],
	tuuid    => [ 'uuid',    q{'9f1c2d1e-0000-4000-8000-000000000001'::uuid} ],
	bykey    => [ undef,     undef ],
);

for my $db (sort keys %layouts)
{
	my ($type) = @{ $layouts{$db} };
	citus_database($db);
	if (defined $type)
	{
		$coord->safe_psql($db, qq{
			CREATE TABLE charges (merchant_id $type NOT NULL, key text NOT NULL);
			SELECT create_distributed_table('charges', 'merchant_id');
			SELECT idem_distribute('charges');});
	}
	else
	{
		$coord->safe_psql($db, q{SELECT idem_distribute()});
	}
}

# a session on every node, opened before the calls: a crash would end it
my %watch = map { $_->name => $_->background_psql('postgres') } @nodes;

for my $db (sort keys %layouts)
{
	my ($type, $tenant) = @{ $layouts{$db} };
	my $t = defined $type ? "NULL::$type, " : '';
	my $k = defined $type ? q{'k-1'} : 'NULL';
	my %calls = (
		begin   => qq{SELECT idem_begin(${t}'charge', $k, NULL::bytea)},
		inspect => qq{SELECT * FROM idem_inspect(${t}'charge', $k)},
		finish  => qq{SELECT idem_finish(${t}'charge', $k, 1, '{}')},
		abort   => qq{SELECT idem_abort(${t}'charge', $k, 1)},
		renew   => qq{SELECT idem_renew(${t}'charge', $k, 1, '1 minute')},
		forget  => qq{SELECT idem_forget(${t}'charge', $k)},
	);
	my $what = defined $type ? "a NULL $type tenant" : 'a NULL key';
	for my $n (@nodes)
	{
		for my $c (sort keys %calls)
		{
			my ($st, $out, $err) = try_sql($n, $db, $calls{$c});
			is($st, '22004', "$db: idem_$c with $what through " . $n->name . ' gets 22004');
		}
		# a parameter: the first five executions are planned with its value
		my $p = defined $type ? "\$1::$type, 'charge', 'k-1'" : q{'charge', $1::text};
		my ($st, $out, $err) = try_sql($n, $db, qq{
			PREPARE b AS SELECT status FROM idem_begin($p, NULL::bytea);
			EXECUTE b(NULL); });
		is($st, '22004', "$db: a prepared idem_begin with $what through " . $n->name . ' gets 22004');
	}
	for my $n (@nodes)
	{
		is(eval { $watch{ $n->name }->query_safe('SELECT 1') } // 'gone', '1',
			"$db: " . $n->name . ' is still up, its sessions too');
	}
	my $call = defined $type ? "$tenant, 'charge', 'k-ok'" : q{'charge', 'k-ok'};
	is($w2->safe_psql($db, qq{SELECT status FROM idem_begin($call, NULL::bytea)}), 'new',
		"$db: a call naming the tenant or key is served");
	is($coord->safe_psql($db, qq{SELECT state FROM idem_inspect($call)}), 'pending',
		"$db: and found through the coordinator");
}

eval { $_->quit } for values %watch;
$_->stop for @nodes;
done_testing();
