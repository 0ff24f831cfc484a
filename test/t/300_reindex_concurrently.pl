# Copyright (c) 2024, idempotency authors
#
# REINDEX INDEX CONCURRENTLY idem_record_pkey while an in-transaction load
# claims, finishes and retries a few thousand keys.  A REPEATABLE READ
# transaction holding an old snapshot keeps the reindex waiting (so the
# window in which the new index must receive every insertion is wide); when
# it ends the reindex completes.  Writes to the record table that reach only
# the index the backend knows (not every index of the table, as the
# executor does) leave the rebuilt index missing entries: then replays fail
# and amcheck (heapallindexed) reports it.
#
# In the default durability mode of a new installation, 'completed', a
# finish moves the record to idem_result: its primary key,
# idem_result_pkey, is then reindexed concurrently under the load too, and
# the checks read and amcheck both tables.
use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

use FindBin;
use lib $FindBin::RealBin;
use IdemTest;

my $node = PostgreSQL::Test::Cluster->new('reindex_cc');
$node->init;
$node->append_conf('postgresql.conf', "autovacuum = off\n");
$node->start;
setup_load($node);

my $load = start_load($node, op => 'rx', keys => 2000, clients => 4, seconds => 40);
ok($node->poll_query_until('postgres', q{SELECT count(*) >= 200 FROM effect}),
	'load is running');

# an old snapshot, held open
my $old = $node->background_psql('postgres', on_error_stop => 0);
my (undef, $state) = run_sql($old,
	'BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM effect;');
is($state, '00000', 'a REPEATABLE READ transaction holds an old snapshot');

my $dba = $node->background_psql('postgres', on_error_stop => 0);
my ($dba_pid) = run_sql($dba, 'SELECT pg_backend_pid();');
my $before_oid = $node->safe_psql('postgres', q{SELECT 'idem_record_pkey'::regclass::oid});
send_sql($dba, 'REINDEX INDEX CONCURRENTLY idem_record_pkey;');
ok( $node->poll_query_until('postgres', qq{
		SELECT phase LIKE 'waiting for%' FROM pg_stat_progress_create_index WHERE pid = $dba_pid}),
	'REINDEX CONCURRENTLY waits (for the old snapshot)');
ok( load_progressed($node, 'postgres', 600),
	'the load carries on while the reindex waits');
ok(!sql_done($dba), 'the reindex is still waiting');
run_sql($old, 'COMMIT;');
$old->quit;

my ($out, $err);
($out, $state, $err) = wait_sql($dba);
is($state, '00000', 'REINDEX INDEX CONCURRENTLY succeeded') or diag($err);
$dba->quit;
isnt($node->safe_psql('postgres', q{SELECT 'idem_record_pkey'::regclass::oid}), $before_oid,
	'idem_record_pkey is a new index');
ok( load_progressed($node, 'postgres', 400),
	'the load carries on with the new index');

# the completed records' table, under the same load
my $result_oid = $node->safe_psql('postgres', q{SELECT 'idem_result_pkey'::regclass::oid});
my $ret;
($ret, $out, $err) = $node->psql('postgres', 'REINDEX INDEX CONCURRENTLY idem_result_pkey');
is($ret, 0, 'REINDEX INDEX CONCURRENTLY idem_result_pkey under load succeeded') or diag($err);
isnt($node->safe_psql('postgres', q{SELECT 'idem_result_pkey'::regclass::oid}), $result_oid,
	'idem_result_pkey is a new index');
is( $node->safe_psql('postgres', q{
		SELECT count(*) FROM pg_index
		 WHERE indrelid IN ('idem_record'::regclass, 'idem_result'::regclass) AND NOT indisvalid}),
	'0', 'no invalid index left behind');
ok( load_progressed($node, 'postgres', 400),
	'the load carries on with both new indexes');

my ($bout, $berr) = stop_load($load, stop => 1);
unlike($berr, qr/ERROR|WARNING|aborted/, 'the load met no error') or diag($berr);

check_load($node, 'postgres', 'rx', 'after REINDEX CONCURRENTLY');
check_amcheck($node, 'postgres', 'after REINDEX CONCURRENTLY');

$node->stop;
done_testing();
