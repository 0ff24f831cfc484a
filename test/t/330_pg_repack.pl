# Copyright (c) 2024, idempotency authors
#
# pg_repack of the record table (made logged first) while an
# in-transaction load runs.  pg_repack copies the table and replays the
# changes made meanwhile from a log its trigger fills, then swaps the files:
# a write that bypasses row triggers is lost by the swap.  Every completed
# key must replay afterwards, no key may have two effects, and amcheck is
# clean.  Needs the Debian package postgresql-15-repack (test/lib.sh).
#
# pg_repack refuses unlogged tables.  First, in the default durability mode
# of a new installation, 'completed', it repacks idem_result (logged there:
# the completed records, moved there by every finish of the load); then
# idem_set_logged(true) (mode 'all') makes idem_record logged and it
# repacks idem_record, under the same load.
use strict;
use warnings;

use IPC::Run;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

use FindBin;
use lib $FindBin::RealBin;
use IdemTest;

my $node = PostgreSQL::Test::Cluster->new('repack');
$node->init;
$node->append_conf('postgresql.conf', "autovacuum = off\n");
$node->start;
setup_load($node);
$node->safe_psql('postgres', q{CREATE EXTENSION pg_repack});
is($node->safe_psql('postgres', q{
		SELECT idem_durability() || '|' || relpersistence::text FROM pg_class WHERE relname = 'idem_result'}),
	'completed|p', 'mode completed: idem_result is logged');

my $load = start_load($node, op => 'rp', keys => 2000, clients => 4, seconds => 60);
ok($node->poll_query_until('postgres', q{SELECT count(*) >= 500 FROM effect}), 'load is running');

sub repack
{
	my ($table) = @_;
	my $relfilenode = $node->safe_psql('postgres', qq{SELECT relfilenode FROM pg_class WHERE relname = '$table'});
	my ($out, $err) = ('', '');
	my $ok = IPC::Run::run(
		[ 'pg_repack', "--table=public.$table", '--no-kill-backend', '--wait-timeout=30',
			'-d', 'postgres', '-h', $node->host, '-p', $node->port ],
		'>', \$out, '2>', \$err);
	ok($ok, "pg_repack of $table under load succeeded") or diag("$out\n$err");
	isnt($node->safe_psql('postgres', qq{SELECT relfilenode FROM pg_class WHERE relname = '$table'}),
		$relfilenode, "$table was rewritten");
	ok(load_progressed($node, 'postgres', 400),
		"the load carries on after the swap of $table");
	return;
}

repack('idem_result');
# pg_repack refuses unlogged tables: idem_record is logged in mode 'all'
$node->safe_psql('postgres', q{SELECT idem_set_logged(true)});
ok(load_progressed($node, 'postgres', 200), 'the load carries on in mode all');
repack('idem_record');
my ($bout, $berr) = stop_load($load, stop => 1);
unlike($berr, qr/ERROR|WARNING|aborted/, 'the load met no error') or diag($berr);

is($node->safe_psql('postgres', q{SELECT relpersistence FROM pg_class WHERE relname = 'idem_record'}),
	'p', 'the record table is still logged');
check_load($node, 'postgres', 'rp', 'after pg_repack');
check_amcheck($node, 'postgres', 'after pg_repack');

$node->stop;
done_testing();
