# Operations with idempotency in shared_preload_libraries: the background
# purge worker removes expired records (and only those) in every listed
# database, and the shared-memory counters count each kind of event.
# Without preloading, reading the counters says so.
#
# The databases are in the default durability mode of a new installation,
# 'completed': a finish moves the record to idem_result, so the checks read
# both tables, and the worker must purge an expired completed record there.
use strict;
use warnings;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

use FindBin;
use lib $FindBin::RealBin;
use IdemTest;

my $node = PostgreSQL::Test::Cluster->new('preloaded');
$node->init;
$node->append_conf('postgresql.conf', q{
shared_preload_libraries = 'idempotency'
idempotency.databases = 'postgres, other'
idempotency.purge_interval = '1s'
idempotency.purge_batch_size = 100
});
$node->start;
$node->safe_psql('postgres', 'CREATE DATABASE other');
$node->safe_psql($_, 'CREATE EXTENSION idempotency') for ('postgres', 'other');
# a worker whose database does not exist yet retries every 10 s: restart so
# that both start at once
$node->restart;
my $log_offset = -s $node->logfile;

# pg_ctl returns once the server accepts connections; the postmaster starts
# the workers then, and each shows in pg_stat_activity only once it has
# connected to its database -- on a loaded machine, a while later: poll.
# A worker that failed and was restarted would show in the server log.
ok($node->poll_query_until('postgres',
		"SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'idempotency purge worker'",
		'2'),
	'one purge worker per listed database');
ok(!$node->log_contains(qr/background worker "idempotency purge worker" \(PID \d+\) exited/, $log_offset),
	'and none exited since the restart');
# between runs each sleeps in its own wait event (17 and later)
my $purge_event = idem_wait_event($node, 'IdempotencyPurgeMain');
ok($node->poll_query_until('postgres', qq{
		SELECT count(*) FROM pg_stat_activity
		 WHERE backend_type = 'idempotency purge worker'
		   AND wait_event_type = 'Extension' AND wait_event = '$purge_event'},
		'2'),
	"between runs the purge workers sleep in wait event $purge_event");

# --- the purge worker ---------------------------------------------------

# 1,000 claims whose lease lapses at once, in batches of 100 for the worker,
# and a completed record made expired (in idem_result); plus records that
# must stay: live pending and completed within retention.
for my $db ('postgres', 'other')
{
	$node->safe_psql($db, q{
		SELECT count(*) FROM generate_series(1, 1000) g,
			LATERAL idem_begin('lapsing', g::text, NULL, lease => '1 ms');
		SELECT token FROM idem_begin('keep', 'pending', NULL, lease => '1 hour');
		SELECT token FROM idem_begin('keep', 'done', NULL);
		SELECT idem_finish('keep', 'done', currval('idem_token_seq'), '"kept"');
		SELECT token FROM idem_begin('lapsing', 'done', NULL);
		SELECT idem_finish('lapsing', 'done', currval('idem_token_seq'), '"gone"');
		UPDATE idem_record SET expires_at = now() - interval '1 hour' WHERE operation = 'lapsing' AND key = 'done';
		UPDATE idem_result SET expires_at = now() - interval '1 hour' WHERE operation = 'lapsing' AND key = 'done';
	});
}
# every record, in whichever table the durability mode keeps it
my $records = '(SELECT * FROM idem_record UNION ALL SELECT * FROM idem_result)';
for my $db ('postgres', 'other')
{
	ok($node->poll_query_until($db,
			"SELECT count(*) = 0 FROM $records r WHERE operation = 'lapsing'"),
		"worker purged every expired record in database $db (idem_result too)");
	is($node->safe_psql($db,
			"SELECT string_agg(key, ',' ORDER BY key) FROM $records r"),
		'done,pending', "live records survive the purge in database $db");
}
is($node->safe_psql('postgres', "SELECT purged >= 2000 FROM idem_stats_counters"),
	't', 'the purged counter counts what the workers deleted');
ok(!$node->log_contains('terminated by signal'), 'no backend crashed');
is($node->safe_psql('postgres',
		"SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'idempotency purge worker'"),
	'2', 'the workers keep running');

# --- counters: each event counted once --------------------------------------

$node->safe_psql('postgres', 'SELECT idem_stats_reset()');
is($node->safe_psql('postgres', 'SELECT claims + replays + waits + purged FROM idem_stats_counters'),
	'0', 'idem_stats_reset zeroes the counters');

# a claim, a replay, a key reuse, an in-progress refusal, an abort, a stale
# token, a takeover after a lapsed lease (of a claim with a checkpoint: the
# purge worker, which runs every second here, keeps a lapsed claim that has
# one for its ttl, where it could delete a plain one before the takeover)
$node->safe_psql('postgres', q{
	SELECT token FROM idem_begin('c', 'k1', '\x01'::bytea);
	SELECT idem_finish('c', 'k1', currval('idem_token_seq'), '1');
	SELECT status FROM idem_begin('c', 'k1', '\x01'::bytea);
});
$node->psql('postgres', q{SELECT idem_begin('c', 'k1', '\x02'::bytea)});
my $k2 = $node->safe_psql('postgres',
	q{SELECT token FROM idem_begin('c', 'k2', NULL, lease => '1 hour')});
$node->psql('postgres', q{SELECT idem_begin('c', 'k2', NULL, in_flight => 'raise')});
$node->safe_psql('postgres', qq{SELECT idem_abort('c', 'k2', $k2)});
$node->psql('postgres', q{SELECT idem_finish('c', 'k2', 1, '1')});
$node->safe_psql('postgres', q{
	SELECT token FROM idem_begin('c', 'k3', NULL, lease => '1 hour');
	SELECT idem_checkpoint('c', 'k3', currval('idem_token_seq'), '{"step": 1}');
	UPDATE idem_record SET expires_at = now() - interval '1 second' WHERE operation = 'c' AND key = 'k3';
	UPDATE idem_result SET expires_at = now() - interval '1 second' WHERE operation = 'c' AND key = 'k3';
	SELECT status FROM idem_begin('c', 'k3', NULL);
});
is($node->safe_psql('postgres', q{
		SELECT format('claims=%s replays=%s key_reuse=%s in_progress=%s aborts=%s fenced=%s takeovers=%s',
			claims, replays, key_reuse_refusals, in_progress_refusals, aborts,
			fencing_refusals, takeovers)
		  FROM idem_stats_counters}),
	'claims=4 replays=1 key_reuse=1 in_progress=1 aborts=1 fenced=1 takeovers=1',
	'each event is counted once');

# a waiter is counted with its wait time
my $owner_token = $node->safe_psql('postgres',
	"SELECT token FROM idem_begin('c', 'k4', NULL, lease => '1 hour')");
my $waiter = $node->background_psql('postgres');
$waiter->query_until(qr/sent/, q{
	\echo sent
	SELECT status FROM idem_begin('c', 'k4', NULL);
});
ok($node->poll_query_until('postgres',
		"SELECT count(*) = 1 FROM pg_stat_activity WHERE wait_event_type = 'Extension' AND wait_event = '"
		  . idem_wait_event($node, 'IdempotencyClaim') . "' AND backend_type = 'client backend'"),
	'the duplicate sleeps (wait event ' . idem_wait_event($node, 'IdempotencyClaim') . ')');
sleep(1);
$node->safe_psql('postgres', "SELECT idem_finish('c', 'k4', $owner_token, '\"r\"')");
$waiter->quit;
is($node->safe_psql('postgres',
		'SELECT waits = 1 AND wait_time_ms >= 900 AND replays = 2 FROM idem_stats_counters'),
	't', 'the wait and its duration are counted');

# --- the worker purges by the clock, not whenever its latch is set -----------

$node->safe_psql('postgres', q{
	ALTER SYSTEM SET idempotency.purge_interval = '1h';
	SELECT pg_reload_conf();
});
sleep(2);    # let a cycle begun under the old interval finish
$node->safe_psql('postgres', q{
	SELECT count(*) FROM generate_series(1, 5) g,
		LATERAL idem_begin('by-the-clock', g::text, NULL, lease => '1 ms');
	SELECT pg_reload_conf();
	CREATE TABLE churn (i int); DROP TABLE churn;
	SELECT pg_reload_conf();
});
sleep(2);
is($node->safe_psql('postgres',
		"SELECT count(*) FROM $records r WHERE operation = 'by-the-clock'"),
	'5', 'reloads and invalidations do not trigger a purge before the interval');

$node->stop;

# --- without preloading ----------------------------------------------------

my $plain = PostgreSQL::Test::Cluster->new('plain');
$plain->init;
$plain->start;
$plain->safe_psql('postgres', 'CREATE EXTENSION idempotency');
my ($ret, $out, $err) = $plain->psql('postgres', 'SELECT * FROM idem_stats_counters');
like($err, qr/counters are not available.*shared_preload_libraries/s,
	'without preloading the counters say why they are missing');
is($plain->safe_psql('postgres',
		"SELECT token IS NOT NULL FROM idem_begin('p', 'k', NULL); SELECT count(*) FROM idem_stats"),
	"t\n1", 'everything else works without preloading');
$plain->stop;

done_testing();
