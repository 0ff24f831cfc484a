# Two things a database owner who is not a superuser meets (the usual case
# on managed services):
#
# 1. pg_dump of the database by that owner works once the extension is
#    installed (it read the extension's configuration tables and sequence,
#    which only superusers could), and the dump holds the application's
#    tables and the records.  Restored by the owner into a database where a
#    superuser created the extension, the application's tables come back and
#    the records' data fails loudly (it needs a superuser, docs/operations.md "Backups");
#    restored by a superuser, everything comes back and replays.
# 2. An object created by the owner under the name of one of the extension's
#    objects is never taken for it: the extension's objects are found by
#    membership, not by name.

use strict;
use warnings;

use IPC::Run;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $node = PostgreSQL::Test::Cluster->new('owner');
$node->init;
$node->start;
$node->safe_psql('postgres', q{
	CREATE ROLE app_owner LOGIN;
	CREATE DATABASE app OWNER app_owner;
	CREATE DATABASE app_restored OWNER app_owner;
	CREATE DATABASE app_restored_su OWNER app_owner;
});
$node->safe_psql('app', 'CREATE EXTENSION idempotency');
$node->safe_psql('app', q{
	SET ROLE app_owner;
	CREATE TABLE orders (id int PRIMARY KEY, amount int);
	INSERT INTO orders VALUES (1, 100), (2, 250);
	SELECT idem_finish('order.create', 'k1', (idem_begin('order.create', 'k1', NULL)).token, '{"order": 1}');
});

# ---- 1. the owner's dump ----

my $dump = $node->basedir . '/app.dump';
my ($out, $err) = ('', '');
my $ok = IPC::Run::run(
	[ 'pg_dump', '-Fc', '-f', $dump, '-d', $node->connstr('app') . ' user=app_owner' ],
	'>', \$out, '2>', \$err);
ok($ok, 'pg_dump by the non-superuser database owner succeeds') or diag($err);

my $toc = '';
IPC::Run::run([ 'pg_restore', '-l', $dump ], '>', \$toc);
like($toc, qr/TABLE DATA public orders /, "the dump holds the application's table");
like($toc, qr/TABLE DATA public idem_record |TABLE DATA public idem_result /,
	'and the records');

# restored by the owner, into a database where a superuser created the extension
$node->safe_psql('app_restored', 'CREATE EXTENSION idempotency');
($out, $err) = ('', '');
$ok = IPC::Run::run(
	[ 'pg_restore', '-d', $node->connstr('app_restored') . ' user=app_owner', $dump ],
	'>', \$out, '2>', \$err);
ok(!$ok, 'the owner\'s restore reports an error ...');
like($err, qr/permission denied for table idem_re(cord|sult)/, '... for the records only');
is($node->safe_psql('app_restored', 'SELECT count(*) FROM orders'), '2',
	"the application's table is restored");

# restored by a superuser: everything, and the record replays for its role
$ok = IPC::Run::run([ 'pg_restore', '-d', $node->connstr('app_restored_su'), $dump ],
	'>', \$out, '2>', \$err);
ok($ok, 'a superuser restores the whole dump') or diag($err);
is($node->safe_psql('app_restored_su', q{
	SET ROLE app_owner;
	SELECT status || ' ' || response FROM idem_begin('order.create', 'k1', NULL)}),
	'replay {"order": 1}', "and the owner's record replays");

# ---- 2. a squatter's object is not the extension's ----

$node->safe_psql('postgres', q{
	CREATE DATABASE squat OWNER app_owner;
});
# a 1.1 installation has no epoch sequence yet: the database owner, who may
# CREATE in public, creates one of that name
$node->safe_psql('squat', q{CREATE EXTENSION idempotency VERSION '1.1'});
$node->safe_psql('squat', q{
	SET ROLE app_owner;
	CREATE SEQUENCE public.idem_token_epoch;
	SELECT setval('public.idem_token_epoch', 2000000000);
});
my ($rc, $stdout, $stderr) = $node->psql('squat', q{
	SET ROLE app_owner;
	SELECT status FROM idem_begin('op', 'k', NULL)});
is($rc, 0, 'idem_begin works with a squatted epoch sequence in the schema') or diag($stderr);
is($stdout, 'new', 'and claims the key');
($rc, $stdout, $stderr) = $node->psql('squat', q{
	SELECT token < (2000000000::int8 << 32) FROM idem_begin('op', 'k2', NULL)});
is($stdout, 't', "the squatter's sequence does not make the tokens");
($rc, $stdout, $stderr) = $node->psql('squat', q{ALTER EXTENSION idempotency UPDATE});
isnt($rc, 0, 'ALTER EXTENSION UPDATE refuses to proceed over the squatted name ...');
like($stderr, qr/relation "idem_token_epoch" already exists/, '... and says why');
$node->safe_psql('squat', 'DROP SEQUENCE public.idem_token_epoch');
$node->safe_psql('squat', 'ALTER EXTENSION idempotency UPDATE');
is($node->safe_psql('squat', q{SELECT extversion FROM pg_extension WHERE extname = 'idempotency'}),
	'1.6', 'once it is dropped, the update runs');

$node->stop;
done_testing();
