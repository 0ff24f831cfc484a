# Copyright (c) 2024, idempotency authors
#
# The external-call shape (idem_begin committed in autocommit, idem_finish
# later in the SAME backend session) with the record table rewritten or
# shrunk in between: VACUUM FULL, CLUSTER, idem_set_logged(true) and
# (false), and a plain VACUUM that truncates the file after many rows were
# deleted.  Each time the claim sits near the end of a large table, so the
# rewrite moves it (its block no longer exists).  idem_renew / idem_finish /
# idem_abort must find the record where it is now -- no "could not read
# block" (XX001) from a position remembered since the claim -- and the key
# then replays.  The same again while an in-transaction load runs.
#
# The test starts in the default durability mode of a new installation,
# 'completed' (pending claims in idem_record, completed records moved to
# idem_result); idem_set_logged switches it to 'all' / 'none'.  The load
# part switches back to 'completed' first, and also rewrites idem_result
# (VACUUM FULL, CLUSTER) and switches modes under the load.
use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

use FindBin;
use lib $FindBin::RealBin;
use IdemTest;

my $node = PostgreSQL::Test::Cluster->new('rewrite_claim');
$node->init;
$node->append_conf('postgresql.conf', "autovacuum = off\n");
$node->start;
setup_load($node);
$node->safe_psql('postgres', 'CREATE EXTENSION pgcrypto');

my $worker = $node->background_psql('postgres', on_error_stop => 0);
my $fp = q{'\x01'::bytea};

sub blk
{
	my ($key) = @_;
	return $node->safe_psql('postgres', qq{
		SELECT (ctid::text::point)[0]::int FROM idem_record WHERE operation = 'ext' AND key = '$key'});
}

sub fill
{
	my ($tag, $n, $fpsize) = @_;
	$fpsize //= 0;
	my $half = int($fpsize / 2);
	my $f = $fpsize ? "gen_random_bytes($half) || gen_random_bytes($half)" : 'NULL';
	# pending claims (batch: one transaction claims them all)
	$node->safe_psql('postgres', qq{
		SELECT count(*) FROM generate_series(1, $n) g,
		       LATERAL idem_begin('fill', '$tag-' || g, $f, lease => '1 hour') b});
	return;
}

sub claim_ext
{
	my ($key, $fpx) = @_;
	$fpx //= $fp;
	my ($out, $state, $err) = run_sql($worker, qq{
		SELECT status || '|' || token FROM idem_begin('ext', '$key', $fpx, lease => '1 hour');});
	is($state, '00000', "$key: claimed in autocommit") or diag($err);
	my ($token) = $out =~ /^new\|(\d+)$/;
	return $token // -1;
}

sub worker_sql
{
	my ($sql, $name, $want) = @_;
	my ($out, $state, $err) = run_sql($worker, $sql);
	is($state, '00000', "$name: succeeds") or diag($err);
	unlike($err, qr/could not read block/, "$name: no \"could not read block\"");
	is($out, $want, "$name: returns $want") if defined $want;
	return $out;
}

sub replays
{
	my ($key, $response, $name) = @_;
	is( $node->safe_psql('postgres', qq{
			SELECT status || '|' || response::text FROM idem_begin('ext', '$key', $fp)}),
		"replay|$response", "$name: replays");
	return;
}

# ---- one rewrite at a time, no load ----

my @rewrites = (
	[ 'vacuum-full', 'VACUUM FULL idem_record', 'renew+finish' ],
	[ 'cluster', 'CLUSTER idem_record USING idem_record_pkey', 'abort' ],
	[ 'set-logged', 'SELECT idem_set_logged(true)', 'finish' ],
	[ 'set-unlogged', 'SELECT idem_set_logged(false)', 'renew+finish' ]);
for my $r (@rewrites)
{
	my ($key, $ddl, $how) = @$r;
	fill("a-$key", 3000);
	my $token = claim_ext($key);
	my $before = blk($key);
	cmp_ok($before, '>', 5, "$key: the claim sits at block $before");
	$node->safe_psql('postgres', q{DELETE FROM idem_record WHERE operation = 'fill'});
	$node->safe_psql('postgres', $ddl);
	cmp_ok(blk($key), '<', $before, "$key: after $ddl it moved to block " . blk($key));
	if ($how =~ /renew/)
	{
		worker_sql(qq{SELECT idem_renew('ext', '$key', $token, '2 hours') > now() + interval '90 min';},
			"$key: idem_renew after $ddl", 't');
	}
	if ($how =~ /finish/)
	{
		worker_sql(qq{SELECT idem_finish('ext', '$key', $token, '{"by": "$key"}');},
			"$key: idem_finish after $ddl");
		replays($key, qq{{"by": "$key"}}, $key);
	}
	else
	{
		worker_sql(qq{SELECT idem_abort('ext', '$key', $token);},
			"$key: idem_abort after $ddl", 't');
		like($node->safe_psql('postgres', qq{
				SELECT status || '|' || (token > $token) FROM idem_begin('ext', '$key', $fp)}),
			qr/^new\|true$/, "$key: free again after the abort, with a greater token");
	}
}
is($node->safe_psql('postgres', q{SELECT relpersistence FROM pg_class WHERE relname = 'idem_record'}),
	'u', 'the record table is unlogged again');

# ---- a plain VACUUM that truncates the file ----
# Big rows (a 1000-byte fingerprint: seven to a page): low fillers, the
# claim, high fillers after it (its page full).  The fillers on pages
# before the claim's go and a VACUUM frees those pages; idem_renew then writes the claim's new version
# into one of them.  The high fillers go and a VACUUM truncates every
# block from the claim's first position on.
my $bigfp = q{decode(repeat('ab', 1000), 'hex')};
fill('lo', 40, 1000);
my $token = claim_ext('truncate', $bigfp);
my $first = blk('truncate');
fill('hi', 60, 1000);
# only the pages before the claim's: its own stays full
$node->safe_psql('postgres', qq{
	DELETE FROM idem_record WHERE operation = 'fill' AND (ctid::text::point)[0] < $first;
	VACUUM idem_record});
worker_sql(qq{SELECT idem_renew('ext', 'truncate', $token, '2 hours') > now() + interval '90 min';},
	'truncate: idem_renew after the VACUUM', 't');
my $moved = blk('truncate');
cmp_ok($moved, '<', $first, "truncate: the renewed version moved from block $first to block $moved");
my $size0 = $node->safe_psql('postgres', q{SELECT pg_relation_size('idem_record') / 8192});
$node->safe_psql('postgres', q{DELETE FROM idem_record WHERE operation = 'fill'; VACUUM idem_record});
my $size1 = $node->safe_psql('postgres', q{SELECT pg_relation_size('idem_record') / 8192});
cmp_ok($size1, '<=', $first, "truncate: the VACUUM truncated the file from $size0 to $size1 blocks (the claim was at block $first)");
worker_sql(qq{SELECT idem_finish('ext', 'truncate', $token, '{"by": "truncate"}');},
	'truncate: idem_finish after the truncation');
my $fpcheck = $node->safe_psql('postgres', qq{
	SELECT status || '|' || response::text FROM idem_begin('ext', 'truncate', $bigfp)});
is($fpcheck, 'replay|{"by": "truncate"}', 'truncate: replays');

# ---- the same under an in-transaction load ----

# back to the default mode of a new installation (idem_set_logged(false)
# above left 'none')
$node->safe_psql('postgres', q{SELECT idem_set_durability('completed')});
my $load = start_load($node, op => 'rw', keys => 2000, clients => 3, seconds => 60);
ok($node->poll_query_until('postgres', q{SELECT count(*) >= 200 FROM effect}), 'load is running');
my $i = 0;
for my $ddl ('VACUUM FULL idem_record', 'CLUSTER idem_record USING idem_record_pkey',
	'VACUUM FULL idem_result', 'CLUSTER idem_result USING idem_result_pkey',
	'SELECT idem_set_logged(true)', 'SELECT idem_set_logged(false)',
	q{SELECT idem_set_durability('completed')},
	q{DELETE FROM idem_record WHERE operation = 'fill'; VACUUM idem_record})
{
	$i++;
	my $key = "load-$i";
	fill("l$i", 1000);
	my $t = claim_ext($key);
	$node->safe_psql('postgres', q{DELETE FROM idem_record WHERE operation = 'fill'}) if $ddl !~ /DELETE/;
	$node->safe_psql('postgres', $ddl);
	worker_sql(qq{SELECT idem_renew('ext', '$key', $t, '2 hours') > now();},
		"$key: idem_renew after $ddl under load", 't');
	worker_sql(qq{SELECT idem_finish('ext', '$key', $t, '{"by": "$key"}');},
		"$key: idem_finish after $ddl under load");
	replays($key, qq{{"by": "$key"}}, "$key under load");
}
ok(load_progressed($node, 'postgres', 200),
	'the load carried on');
my ($bout, $berr) = stop_load($load, stop => 1);
unlike($berr, qr/ERROR|WARNING|aborted/, 'the load met no error') or diag($berr);
$worker->quit;

check_load($node, 'postgres', 'rw', 'rewrites under load');
check_amcheck($node, 'postgres', 'rewrites under load');

$node->stop;
done_testing();
