# Copyright (c) 2024, idempotency authors
#
# ALTER TABLE idem_record SET TABLESPACE (and back, and its index) while an
# in-transaction load runs, and between a committed claim (external-call
# shape) and its finish / renew / abort in the same session.  The same for
# idem_result, where the default durability mode of a new installation,
# 'completed', moves a record when it is finished.
use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

use FindBin;
use lib $FindBin::RealBin;
use IdemTest;

my $node = PostgreSQL::Test::Cluster->new('tablespace');
$node->init;
$node->append_conf('postgresql.conf', "autovacuum = off\n");
$node->start;
setup_load($node);
my $dir = $node->basedir . '/ts_dir';
mkdir $dir or die "mkdir $dir: $!";
$node->safe_psql('postgres', "CREATE TABLESPACE ts LOCATION '$dir'");

my $worker = $node->background_psql('postgres', on_error_stop => 0);
my $fp = q{'\x01'::bytea};
sub wsql
{
	my ($sql, $name) = @_;
	my ($out, $state, $err) = run_sql($worker, $sql);
	is($state, '00000', "$name: succeeds") or diag($err);
	return $out;
}

my $load = start_load($node, op => 'ts', keys => 2000, clients => 4, seconds => 60);
ok($node->poll_query_until('postgres', q{SELECT count(*) >= 300 FROM effect}), 'load is running');

my $i = 0;
for my $ddl ('ALTER TABLE idem_record SET TABLESPACE ts',
	'ALTER INDEX idem_record_pkey SET TABLESPACE ts',
	'ALTER TABLE idem_record SET TABLESPACE pg_default',
	'ALTER INDEX idem_record_pkey SET TABLESPACE pg_default',
	'ALTER TABLE idem_result SET TABLESPACE ts',
	'ALTER INDEX idem_result_pkey SET TABLESPACE ts',
	'ALTER TABLE idem_result SET TABLESPACE pg_default',
	'ALTER INDEX idem_result_pkey SET TABLESPACE pg_default')
{
	$i++;
	my @t;
	for my $k ("f$i", "a$i")
	{
		my ($tok) = wsql(qq{SELECT token FROM idem_begin('ext', '$k', $fp, lease => '1 hour');},
			"claim $k") =~ /^(\d+)$/;
		push @t, $tok // -1;
	}
	my ($ret, $o, $e) = $node->psql('postgres', $ddl);
	is($ret, 0, "$ddl under load") or diag($e);
	is(wsql(qq{SELECT idem_renew('ext', 'f$i', $t[0], '2 hours') > now();}, "renew f$i after $ddl"),
		't', "renew f$i after $ddl: returns the new lease end");
	wsql(qq{SELECT idem_finish('ext', 'f$i', $t[0], '{"n": $i}');}, "finish f$i after $ddl");
	is(wsql(qq{SELECT idem_abort('ext', 'a$i', $t[1]);}, "abort a$i after $ddl"), 't',
		"abort a$i after $ddl: true");
	is($node->safe_psql('postgres', qq{SELECT status || '|' || response::text FROM idem_begin('ext', 'f$i', $fp)}),
		qq{replay|{"n": $i}}, "f$i replays");
	is($node->safe_psql('postgres', qq{SELECT status FROM idem_begin('ext', 'a$i', $fp)}),
		'new', "a$i is free again");
	ok(load_progressed($node, 'postgres', 200),
		"the load carries on after $ddl");
}
my ($bout, $berr) = stop_load($load, stop => 1);
unlike($berr, qr/ERROR|WARNING|aborted/, 'the load met no error') or diag($berr);
$worker->quit;

check_load($node, 'postgres', 'ts', 'after SET TABLESPACE');
check_amcheck($node, 'postgres', 'after SET TABLESPACE');

$node->stop;
done_testing();
