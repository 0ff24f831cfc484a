# Upgrades and dumps: a database created at 1.0 with records in flight is
# updated to 1.1 in place, and a database using the extension survives
# pg_dump / pg_restore with its records and its fencing tokens.
use strict;
use warnings;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $node = PostgreSQL::Test::Cluster->new('upgrade');
$node->init;
$node->start;

my $db = 'postgres';
$node->safe_psql($db, "CREATE EXTENSION idempotency VERSION '1.0'");
is($node->safe_psql($db, "SELECT extversion FROM pg_extension WHERE extname = 'idempotency'"),
	'1.0', 'created at 1.0');

# Records in flight at 1.0: a completed one, a committed pending one (an
# external call under way), and an uncommitted in-transaction claim.
$node->safe_psql($db, q{
	SELECT token FROM idem_begin('pay', 'done', '\x01'::bytea);
	SELECT idem_finish('pay', 'done', currval('idem_token_seq'), '{"charge": "ch_1"}');
});
my $pending_token = $node->safe_psql($db,
	"SELECT token FROM idem_begin('pay', 'pending', '\\x02'::bytea, lease => '1 hour')");
my $owner = $node->background_psql($db);
$owner->query_safe('BEGIN');
my $intx_token = $owner->query_safe(
	"SELECT token FROM idem_begin('pay', 'in-tx', '\\x03'::bytea)");

$node->safe_psql($db, 'ALTER EXTENSION idempotency UPDATE');
is($node->safe_psql($db, "SELECT extversion FROM pg_extension WHERE extname = 'idempotency'"),
	'1.1', 'updated to 1.1 while a claim was uncommitted');

# Behaviour intact after the update
is($node->safe_psql($db,
		"SELECT status || ' ' || response::text FROM idem_begin('pay', 'done', '\\x01'::bytea)"),
	'replay {"charge": "ch_1"}', 'completed record replays after the update');

my ($ret, $out, $err) = $node->psql($db,
	"SELECT * FROM idem_begin('pay', 'pending', '\\x02'::bytea, in_flight => 'raise')");
like($err, qr/already in progress/, 'committed pending claim still holds its key');

is($node->safe_psql($db,
		"SELECT state FROM idem_inspect('pay', 'pending')"),
	'pending', 'the 1.1 function idem_inspect sees a 1.0 record');
ok($node->safe_psql($db,
		"SELECT idem_renew('pay', 'pending', $pending_token, '2 hours') > now() + interval '90 min'"),
	'a claim made at 1.0 can be renewed with 1.1');
$node->safe_psql($db,
	"SELECT idem_finish('pay', 'pending', $pending_token, '{\"charge\": \"ch_2\"}')");

$owner->query_safe("SELECT idem_finish('pay', 'in-tx', $intx_token, '{\"charge\": \"ch_3\"}')");
$owner->query_safe('COMMIT');
$owner->quit;
is($node->safe_psql($db,
		"SELECT response->>'charge' FROM idem_begin('pay', 'in-tx', '\\x03'::bytea)"),
	'ch_3', 'claim that was uncommitted during the update finished and replays');

is($node->safe_psql($db,
		"SELECT string_agg(operation || ':' || completed, ',') FROM idem_stats"),
	'pay:3', 'idem_stats counts the records');

# pg_dump / pg_restore into a new database
my $last_token = $node->safe_psql($db, "SELECT max(token) FROM idem_record");
my $dump = $node->basedir . '/idem.dump';
$node->command_ok(
	[ 'pg_dump', '-Fc', '-f', $dump, '-d', $node->connstr($db) ],
	'pg_dump of a database using the extension');
$node->safe_psql($db, 'CREATE DATABASE restored');
$node->command_ok(
	[ 'pg_restore', '--exit-on-error', '-d', $node->connstr('restored'), $dump ],
	'pg_restore into a new database');

is($node->safe_psql('restored',
		"SELECT status || ' ' || response::text FROM idem_begin('pay', 'done', '\\x01'::bytea)"),
	'replay {"charge": "ch_1"}', 'records come back with the restore');
($ret, $out, $err) = $node->psql('restored',
	"SELECT * FROM idem_begin('pay', 'done', '\\x09'::bytea)");
like($err, qr/different request/, 'restored records keep their fingerprints');
ok($node->safe_psql('restored',
		"SELECT token > $last_token FROM idem_begin('pay', 'fresh', NULL)") eq 't',
	'tokens after the restore are greater than every token before it');
is($node->safe_psql('restored',
		"SELECT count(*) FROM information_schema.role_table_grants WHERE table_name = 'idem_record' AND grantee = 'PUBLIC'"),
	'0', 'the restored record table is still closed to PUBLIC');

$node->stop;
done_testing();
