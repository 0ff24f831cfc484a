# Upgrades and dumps: a database created at 1.0 with records in flight is
# updated in place, and a database using the extension survives pg_dump /
# pg_restore with its records and its fencing tokens.
#
# 1.0 -> 1.1 adds functions only: it goes through while a claim is
# uncommitted.  1.1 -> 1.2 makes the token sequence unlogged, which takes an
# exclusive lock on it: the update waits for transactions that drew a token
# to end (or fails at lock_timeout, changing nothing), and everything in
# flight carries on across it.  ALTER EXTENSION UPDATE goes on to the
# default version, 1.3, in the same command: 1.2 -> 1.3 makes role_id a
# regrole (the same OID on disk), so a dump names each record's role
# instead of writing its OID.
use strict;
use warnings;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

use FindBin;
use lib $FindBin::RealBin;
use IdemTest;

my $node = PostgreSQL::Test::Cluster->new('upgrade');
$node->init;
$node->start;

my $db = 'postgres';
sub version
{
	return $node->safe_psql($db,
		"SELECT extversion FROM pg_extension WHERE extname = 'idempotency'");
}

$node->safe_psql($db, "CREATE EXTENSION idempotency VERSION '1.0'");
is(version(), '1.0', 'created at 1.0');

# Records in flight at 1.0: a completed one, a committed pending one (an
# external call under way), and an uncommitted in-transaction claim.
$node->safe_psql($db, q{
	SELECT token FROM idem_begin('pay', 'done', '\x01'::bytea);
	SELECT idem_finish('pay', 'done', currval('idem_token_seq'), '{"charge": "ch_1"}');
});
my $pending_token = $node->safe_psql($db,
	"SELECT token FROM idem_begin('pay', 'pending', '\\x02'::bytea, lease => '1 hour')");
my $owner = $node->background_psql($db, on_error_stop => 0);
run_sql($owner, 'BEGIN;');
my ($intx_token) = run_sql($owner,
	"SELECT token FROM idem_begin('pay', 'in-tx', '\\x03'::bytea);");

$node->safe_psql($db, "ALTER EXTENSION idempotency UPDATE TO '1.1'");
is(version(), '1.1', 'updated to 1.1 while a claim was uncommitted');

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

# 1.1 -> 1.2 while the claim is still uncommitted: with a lock_timeout the
# update gives up and changes nothing ...
($ret, $out, $err) = $node->psql($db,
	"SET lock_timeout = '200ms'; ALTER EXTENSION idempotency UPDATE",
	extra_params => [ '-v', 'VERBOSITY=verbose' ]);
like($err, qr/ERROR:  55P03/, 'update to 1.3 (through 1.2) under lock_timeout: 55P03 while a claim is uncommitted');
is(version(), '1.1', 'and changes nothing');
is($node->safe_psql($db,
		"SELECT relpersistence FROM pg_class WHERE relname = 'idem_token_seq'"),
	'p', 'the token sequence is still logged');

# ... without one it waits for the claim's transaction, which carries on
my $dba = $node->background_psql($db, on_error_stop => 0);
send_sql($dba, 'ALTER EXTENSION idempotency UPDATE;');
ok( $node->poll_query_until($db, q{
		SELECT count(*) = 1 FROM pg_locks
		 WHERE relation = 'idem_token_seq'::regclass AND mode = 'AccessExclusiveLock'
		   AND NOT granted}),
	'update to 1.3 (through 1.2): waits for the exclusive lock on the token sequence');
my (undef, $state) = run_sql($owner,
	"SELECT idem_finish('pay', 'in-tx', $intx_token, '{\"charge\": \"ch_3\"}');");
is($state, '00000', 'the uncommitted claim finishes meanwhile');
run_sql($owner, 'COMMIT;');
$owner->quit;
(undef, $state) = wait_sql($dba);
is($state, '00000', 'its transaction over, the update completes');
$dba->quit;
is(version(), '1.6', 'updated to the default version, 1.6');
is($node->safe_psql($db, q{
		SELECT format_type(atttypid, atttypmod) FROM pg_attribute
		 WHERE attrelid = 'idem_record'::regclass AND attname = 'role_id'}),
	'regrole', 'role_id is a regrole at 1.3');
is($node->safe_psql($db,
		"SELECT string_agg(DISTINCT role_id::text, ',') FROM idem_record"),
	$node->safe_psql($db, 'SELECT current_user'),
	'the records made at 1.0 and 1.1 keep their role across the type change');

is($node->safe_psql($db,
		"SELECT response->>'charge' FROM idem_begin('pay', 'in-tx', '\\x03'::bytea)"),
	'ch_3', 'claim that was uncommitted during the update finished and replays');
ok($node->safe_psql($db,
		"SELECT token > $intx_token FROM idem_begin('pay', 'after', NULL)") eq 't',
	'tokens after the update are greater than before it');
$node->safe_psql($db,
	"SELECT idem_finish('pay', 'pending', $pending_token, '{\"charge\": \"ch_2\"}')");
is($node->safe_psql($db,
		"SELECT response->>'charge' FROM idem_begin('pay', 'pending', '\\x02'::bytea)"),
	'ch_2', 'the claim committed at 1.0 finishes at 1.3 with its token');
$node->safe_psql($db, "SELECT idem_abort('pay', 'after', (SELECT token FROM idem_record WHERE key = 'after'))");

is($node->safe_psql($db,
		"SELECT string_agg(operation || ':' || completed, ',') FROM idem_stats"),
	'pay:3', 'idem_stats counts the records');

# a record of a role that is not the superuser: the dump must name it
$node->safe_psql($db, q{
	CREATE ROLE payer;
	SET ROLE payer;
	SELECT token AS payer_token FROM idem_begin('pay', 'payer-done', '\x04'::bytea) \\gset
	SELECT idem_finish('pay', 'payer-done', :payer_token, '{"charge": "ch_4"}');
	RESET ROLE;
});

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

# role_id is dumped as the role's name, not as its OID
my $dump_sql = $node->basedir . '/idem-data.sql';
$node->command_ok(
	[ 'pg_restore', '--data-only', '-t', 'idem_record', '-f', $dump_sql, $dump ],
	'the dump of the record table as SQL');
my $payer_oid = $node->safe_psql($db, "SELECT oid FROM pg_roles WHERE rolname = 'payer'");
my @rows = grep { /\tpay\t/ } split /\n/, slurp_file($dump_sql);
is(scalar @rows, 4, 'the dump holds the 4 records');
is(scalar(grep { /^payer\tpay\tpayer-done\t/ } @rows), 1,
	"payer's record is dumped with the role's name");
is(scalar(grep { /^\d+\t/ } @rows), 0, 'no record is dumped with a role OID')
  or diag(join("\n", @rows));

is($node->safe_psql('restored',
		"SELECT status || ' ' || response::text FROM idem_begin('pay', 'done', '\\x01'::bytea)"),
	'replay {"charge": "ch_1"}', 'records come back with the restore');
($ret, $out, $err) = $node->psql('restored',
	"SELECT * FROM idem_begin('pay', 'done', '\\x09'::bytea)");
like($err, qr/different request/, 'restored records keep their fingerprints');
is($node->safe_psql('restored', q{
		SELECT format_type(atttypid, atttypmod) FROM pg_attribute
		 WHERE attrelid = 'idem_record'::regclass AND attname = 'role_id'}),
	'regrole', 'the restored role_id is a regrole');
is($node->safe_psql('restored', q{
		SELECT string_agg(role_id::text || ':' || key, ',' ORDER BY key) FROM idem_record}),
	$node->safe_psql($db, q{
		SELECT string_agg(role_id::text || ':' || key, ',' ORDER BY key) FROM idem_record}),
	'each restored record belongs to the role of the same name');
is($node->safe_psql('restored', q{
		SET ROLE payer;
		SELECT status || ' ' || response::text FROM idem_begin('pay', 'payer-done', '\x04'::bytea)}),
	'replay {"charge": "ch_4"}', "payer replays payer's restored record");
ok($node->safe_psql('restored',
		"SELECT token > $last_token FROM idem_begin('pay', 'fresh', NULL)") eq 't',
	'tokens after the restore are greater than every token before it');
is($node->safe_psql('restored',
		"SELECT count(*) FROM information_schema.role_table_grants WHERE table_name = 'idem_record' AND grantee = 'PUBLIC'"),
	'0', 'the restored record table is still closed to PUBLIC');

$node->stop;
done_testing();
