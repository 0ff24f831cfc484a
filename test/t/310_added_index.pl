# Copyright (c) 2024, idempotency authors
#
# A DBA adds indexes to the record table: CREATE INDEX ON idem_record
# (expires_at) before the load, CREATE INDEX CONCURRENTLY ON idem_record
# (token) while an in-transaction load runs.  Every write must reach every
# index (as the executor does it): amcheck with heapallindexed is clean on
# all of them, and queries forced onto each index find every record a
# sequential scan finds.
#
# In the default durability mode of a new installation, 'completed', a
# claim is written to idem_record and its finish moves it to idem_result
# (both go through the executor): the DBA adds the same indexes to both
# tables, and both are checked.  2000 claims left pending keep records in
# idem_record too (enough that, with enable_indexscan off, the planner's
# index-only scan still beats a disabled sequential scan).
use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

use FindBin;
use lib $FindBin::RealBin;
use IdemTest;

my $node = PostgreSQL::Test::Cluster->new('added_index');
$node->init;
$node->append_conf('postgresql.conf', "autovacuum = off\n");
$node->start;
setup_load($node);

# some records before any index is added, then the first index
my $warm = start_load($node, op => 'ai', keys => 2000, clients => 2, seconds => 30);
ok($node->poll_query_until('postgres', q{SELECT count(*) >= 100 FROM effect}), 'first load ran');
stop_load($warm, stop => 1);
$node->safe_psql('postgres', q{
	SELECT count(*) FROM generate_series(1, 2000) g,
		LATERAL idem_begin('ai-pending', g::text, NULL, lease => '1 hour')});
my @tables = qw(idem_record idem_result);
$node->safe_psql('postgres', "CREATE INDEX ${_}_expires ON $_ (expires_at)") for @tables;

my $load = start_load($node, op => 'ai', keys => 2000, clients => 4, seconds => 40);
ok($node->poll_query_until('postgres', q{SELECT count(*) >= 600 FROM effect}),
	'load is running with the added index');
for my $table (@tables)
{
	my ($ret, $out, $err) = $node->psql('postgres',
		"CREATE INDEX CONCURRENTLY ${table}_token ON $table (token)");
	is($ret, 0, "CREATE INDEX CONCURRENTLY on $table under load succeeded") or diag($err);
}
ok( load_progressed($node, 'postgres', 1200),
	'the load carries on with both indexes');
my ($bout, $berr) = stop_load($load, stop => 1);
unlike($berr, qr/ERROR|WARNING|aborted/, 'the load met no error') or diag($berr);

for my $table (@tables)
{
	is( $node->safe_psql('postgres', qq{
			SELECT count(*) FROM pg_index WHERE indrelid = '$table'::regclass AND indisvalid}),
		'3', "three valid indexes on $table");
}
check_load($node, 'postgres', 'ai', 'with added indexes');
is(check_amcheck($node, 'postgres', 'with added indexes'), 6, 'amcheck checked the 6 indexes');

# forced onto each added index of each table: every record found
for my $table (@tables)
{
	my $all = $node->safe_psql('postgres', qq{
		SET enable_indexscan = off; SET enable_bitmapscan = off; SET enable_indexonlyscan = off;
		SELECT count(*) FROM $table WHERE expires_at > '-infinity' AND token > 0});
	cmp_ok($all, '>', 1000, "a sequential scan finds $all records in $table");
	for my $t ([ "${table}_expires", q{expires_at > '-infinity'} ],
		[ "${table}_token", q{token > 0} ])
	{
		my ($index, $cond) = @$t;
		for my $scan ('Index Scan', 'Index Only Scan', 'Bitmap Heap Scan')
		{
			# Each plan wins by being the only one not disabled.  An
			# index-only scan is disabled by enable_indexscan = off too, so
			# it is left to win over a plain index scan on its own: with the
			# pages all-visible (VACUUM just before) it is the cheaper.
			my $set = 'SET enable_seqscan = off; '
			  . ($scan eq 'Index Scan' ? 'SET enable_indexonlyscan = off; SET enable_bitmapscan = off;'
				: $scan eq 'Index Only Scan' ? 'SET enable_bitmapscan = off;'
				: 'SET enable_indexscan = off; SET enable_indexonlyscan = off;');
			my $col = $index =~ /_token$/ ? 'token' : 'expires_at';
			my $sel = "SELECT count($col) FROM $table WHERE $cond";
			like($node->safe_psql('postgres', "VACUUM $table; $set EXPLAIN $sel"),
				qr/\Q$index\E/, "$index: the $scan plan uses it");
			is($node->safe_psql('postgres', "VACUUM $table; $set $sel"), $all,
				"$index, $scan: finds every record");
		}
	}
}
# and each key through the expires_at indexes, one by one (the record is in
# either table)
is( $node->safe_psql('postgres', qq{
		SET enable_seqscan = off; SET enable_bitmapscan = off;
		SET enable_indexonlyscan = off; SET enable_hashjoin = off; SET enable_mergejoin = off;
		SELECT count(*) FROM effect e
		 WHERE e.op = 'ai' AND NOT EXISTS (
			SELECT 1 FROM $IDEM_RECORDS r
			 WHERE r.expires_at = (SELECT expires_at FROM $IDEM_RECORDS x
			                        WHERE x.operation = e.op AND x.key = e.key)
			   AND r.key = e.key)}),
	'0', 'every effect\'s record is found through the expires_at indexes');

$node->stop;
done_testing();
