
# Copyright (c) 2024, idempotency authors
#
# idem_purge and the durability switches lock the two tables in the same
# order (idem_record first), so a purge during a switch waits for it and
# never deadlocks.  Three clients purge (in modes where there is always
# something expired to delete) while a fourth switches between 'none' and
# 'completed' and back, for 15 s; no statement may fail, the server log
# must show no deadlock, and the switches and purges must both have run.
# (Each purging client expires only its own keys, so that its UPDATEs
# never wait for another's.)

use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $node = PostgreSQL::Test::Cluster->new('purge_switch');
$node->init;
$node->append_conf('postgresql.conf', "deadlock_timeout = 50ms\n");
$node->start;
$node->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	CREATE TABLE runs (what text);
});

my $dir = $node->basedir;
PostgreSQL::Test::Utils::append_to_file("$dir/purge.sql", q{
\set r random(1, 1000000000)
SELECT count(idem_finish('p', 'k' || g || '-' || :r, b.token, '1'))
  FROM generate_series(1, 20) g,
       LATERAL idem_begin('p', 'k' || g || '-' || :r, NULL, ttl => '1 min') b;
UPDATE idem_record SET expires_at = now() - interval '1 s'
 WHERE operation = 'p' AND key LIKE '%-' || :r AND completed_at IS NOT NULL;
UPDATE idem_result SET expires_at = now() - interval '1 s' WHERE operation = 'p' AND key LIKE '%-' || :r;
SELECT idem_purge(1000);
INSERT INTO runs VALUES ('purge');
});
PostgreSQL::Test::Utils::append_to_file("$dir/switch.sql", q{
SELECT idem_set_durability(CASE WHEN idem_durability() = 'none' THEN 'completed' ELSE 'none' END);
INSERT INTO runs VALUES ('switch');
});

my ($stdout, $stderr);
my $ok = IPC::Run::run(
	[ 'pgbench', '-n', '-T', '15', '-c', '4', '-j', '2',
	  '-f', "$dir/purge.sql\@3", '-f', "$dir/switch.sql\@1",
	  '-h', $node->host, '-p', $node->port, 'postgres' ],
	'>', \$stdout, '2>', \$stderr);
ok($ok, 'pgbench ran without a failed statement') or diag($stderr);
my ($purges, $switches) = split /\|/, $node->safe_psql('postgres', q{
	SELECT count(*) FILTER (WHERE what = 'purge') || '|' || count(*) FILTER (WHERE what = 'switch') FROM runs});
cmp_ok($purges, '>', 10, "purges ran ($purges)");
cmp_ok($switches, '>', 10, "switches ran ($switches)");
unlike(slurp_file($node->logfile), qr/deadlock detected/, 'no deadlock in the server log');

$node->stop;
done_testing();
