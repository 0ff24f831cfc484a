
# Copyright (c) 2024, idempotency authors
#
# The idem_* functions under parallel query.
#
#  1. Labels: every function that writes, waits or takes locks (idem_begin,
#     idem_finish, ...) is PARALLEL UNSAFE; only the pure or shared-memory
#     ones (idem_fingerprint, the counters) are PARALLEL SAFE.
#  2. A query that calls idem_begin per row of a table, with parallel query
#     forced (force_parallel_mode / debug_parallel_query, no setup cost):
#     the planner keeps it out of the workers, every row claims its key
#     once ('new'), and a second run replays every one.
#  3. A wrapper the application labels PARALLEL SAFE by mistake, run by
#     parallel workers: every idem_* call that writes fails with core's
#     error for it (25000, "cannot execute idem_begin() during a parallel
#     operation"), naming the function, and leaves nothing: no record, no
#     lock; later calls work, and a pending claim stays pending.

use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

use FindBin;
use lib $FindBin::RealBin;
use IdemTest qw(:DEFAULT :bench);

my $node = PostgreSQL::Test::Cluster->new('parallel');
$node->init;
$node->append_conf('postgresql.conf', q{
shared_preload_libraries = 'idempotency'
max_worker_processes = 8
max_parallel_workers = 8
});
$node->start;
$node->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	CREATE TABLE req AS SELECT g AS id, 'k' || g AS key FROM generate_series(1, 2000) g;
	ANALYZE req;
	CREATE FUNCTION claim_mislabelled(k text) RETURNS text
	LANGUAGE sql PARALLEL SAFE AS $$ SELECT status FROM idem_begin('wrong', k, NULL) $$;
	CREATE FUNCTION finish_mislabelled(k text, t bigint) RETURNS void
	LANGUAGE plpgsql PARALLEL SAFE AS $$ BEGIN PERFORM idem_finish('held', k, t, '{}'); END $$;
});

# ---- 1. labels ----

is( $node->safe_psql('postgres', q{
		SELECT string_agg(p.proname || ':' || p.proparallel::text, ' ' ORDER BY p.proname)
		  FROM pg_proc p
		  JOIN pg_depend d ON d.classid = 'pg_proc'::regclass AND d.objid = p.oid AND d.deptype = 'e'
		  JOIN pg_extension e ON e.oid = d.refobjid AND e.extname = 'idempotency'
		 WHERE p.proparallel <> 'u'}),
	'idem_counters:s idem_fingerprint:s idem_monitor_counters:s idem_stats_reset:s',
	'only idem_fingerprint and the shared-memory counters are parallel safe; the rest is unsafe');

# ---- 2. idem_begin per row of a parallel-forced query ----

my $force = $node->safe_psql('postgres', 'SHOW server_version_num') >= 160000
  ? 'debug_parallel_query' : 'force_parallel_mode';
my $parallel = qq{
	SET $force = on;
	SET parallel_setup_cost = 0;
	SET parallel_tuple_cost = 0;
	SET min_parallel_table_scan_size = 0;
	SET max_parallel_workers_per_gather = 2;
};

like($node->safe_psql('postgres', $parallel . q{
		EXPLAIN (COSTS OFF) SELECT count(*) FROM req}),
	qr/Gather/, "with $force, a scan of the table runs in parallel workers");
my $plan = $node->safe_psql('postgres', $parallel . q{
	EXPLAIN (COSTS OFF) SELECT b.status FROM req r, LATERAL idem_begin('rows', r.key, NULL) b});
unlike($plan, qr/Gather/, '... but not a query calling idem_begin per row') or diag($plan);
is( $node->safe_psql('postgres', $parallel . q{
		SELECT string_agg(status || ':' || n, ' ') FROM (
			SELECT b.status, count(*) AS n FROM req r, LATERAL idem_begin('rows', r.key, NULL) b
			 GROUP BY 1) s}),
	'new:2000', 'idem_begin per row: each of the 2000 keys is claimed, once');
is( $node->safe_psql('postgres', q{
		SELECT count(*) || '|' || count(DISTINCT key) || '|' || count(DISTINCT token)
		  FROM idem_record WHERE operation = 'rows'}),
	'2000|2000|2000', 'one record per key, each with a token of its own');
is( $node->safe_psql('postgres', $parallel . q{
		SELECT count(*) FROM req r, LATERAL idem_finish('rows', r.key,
			(SELECT token FROM idem_record i WHERE i.operation = 'rows' AND i.key = r.key), '{"ok": 1}') f}),
	'2000', 'idem_finish per row finishes them');
is( $node->safe_psql('postgres', $parallel . q{
		SELECT string_agg(status || ':' || n, ' ') FROM (
			SELECT b.status, count(*) AS n FROM req r, LATERAL idem_begin('rows', r.key, NULL) b
			 GROUP BY 1) s}),
	'replay:2000', 'a second run replays every key');

# ---- 3. a wrapper labelled PARALLEL SAFE by mistake ----

$plan = $node->safe_psql('postgres', $parallel . q{
	EXPLAIN (COSTS OFF) SELECT claim_mislabelled(key) FROM req});
like($plan, qr/Gather/, 'the mislabelled wrapper runs in parallel workers') or diag($plan);
my ($state, $out, $err) = try_sql($node, 'postgres', $parallel . q{
	SELECT claim_mislabelled(key), count(*) FROM req GROUP BY 1});
is($state, '25000', 'idem_begin in a parallel operation: 25000 (invalid transaction state)');
like($err, qr/cannot execute idem_begin\(\) during a parallel operation/, '... saying so, naming idem_begin')
  or diag($err);
is($node->safe_psql('postgres', q{SELECT count(*) FROM idem_record WHERE operation = 'wrong'}),
	'0', '... and claims nothing');
is(idem_lock_count($node), '0', '... and holds no idempotency lock');
is($node->safe_psql('postgres', q{SELECT status FROM idem_begin('wrong', 'k1', NULL)}),
	'new', 'a later call outside parallel mode claims the key');

my $token = $node->safe_psql('postgres', q{SELECT token FROM idem_begin('held', 'h1', NULL)});
($state, $out, $err) = try_sql($node, 'postgres', $parallel . q{
	SELECT finish_mislabelled('h1', } . $token . q{) FROM req WHERE id = 1});
is($state, '25000', 'idem_finish in a parallel operation: 25000');
like($err, qr/cannot execute idem_finish\(\) during a parallel operation/, '... naming idem_finish')
  or diag($err);
is($node->safe_psql('postgres', q{SELECT state FROM idem_inspect('held', 'h1')}),
	'pending', '... the claim stays pending');
is($node->safe_psql('postgres', qq{SELECT idem_finish('held', 'h1', $token, '{"done": true}')}),
	'', 'and its owner finishes it outside parallel mode');
is($node->safe_psql('postgres', q{SELECT status || '|' || response FROM idem_begin('held', 'h1', NULL)}),
	'replay|{"done": true}', 'it replays');

unlike(slurp_file($node->logfile), qr/terminated by signal|PANIC|TRAP:/, 'no backend crashed');
$node->stop;
done_testing();
