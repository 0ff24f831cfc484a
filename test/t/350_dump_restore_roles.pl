# Copyright (c) 2024, idempotency authors
#
# Records are namespaced by role.  A dump restored into another cluster,
# whose roles have other OIDs, must attach each record to the role of the
# same name (role_id is regrole in 1.3: dumped as a name), never to
# whichever role now holds the old OID.
#
# Cluster A: alice and bob complete requests under a concurrent
# in-transaction load (pgbench connected as each).  Cluster B: throw-away
# roles x1..xN take A's OIDs of alice, bob and carol, then bob and alice
# are created (other OIDs, another order), and the dump is restored.
# alice replays alice's responses, bob his own, and the role holding
# alice's old OID sees nothing of hers.  A second dump holds records of
# carol, who does not exist in B: its restore must fail loudly, and no
# role may get carol's records.
#
# Both clusters are in the default durability mode of a new installation,
# 'completed': the completed records are in idem_result (dumped like
# idem_record), so the checks read both tables, and the failed restore of
# carol's (completed) records is that of idem_result's data.
use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

use FindBin;
use lib $FindBin::RealBin;
use IdemTest;

my $ca = PostgreSQL::Test::Cluster->new('roles_a');
$ca->init;
$ca->start;
$ca->safe_psql('postgres', 'CREATE ROLE alice LOGIN; CREATE ROLE bob LOGIN; CREATE ROLE carol LOGIN;');
setup_load($ca);
my %oid_a = map { $_ => $ca->safe_psql('postgres', "SELECT oid FROM pg_roles WHERE rolname = '$_'") }
  qw(alice bob carol);
note('A: ' . join(', ', map { "$_=$oid_a{$_}" } sort keys %oid_a));

# alice and bob at once, each under its own load of the same operation
my $la = start_load($ca, op => 'pay', keys => 800, clients => 2, seconds => 4, user => 'alice');
my $lb = start_load($ca, op => 'pay', keys => 800, clients => 2, seconds => 4, user => 'bob');
for my $l ([ 'alice', $la ], [ 'bob', $lb ])
{
	my ($o, $e) = stop_load($l->[1]);
	unlike($e, qr/ERROR|WARNING|aborted/, "A: the load of $l->[0] met no error") or diag($e);
}
for my $r (qw(alice bob))
{
	check_load($ca, 'postgres', 'pay', "A, $r", role => $r);
}
# one key each, with a response that names the role
for my $r (qw(alice bob))
{
	$ca->safe_psql('postgres', qq{
		SET ROLE $r;
		SELECT idem_finish('mine', 'k', (SELECT token FROM idem_begin('mine', 'k', '\\x01'::bytea)),
		                   '{"owner": "$r"}');});
}
my $dump1 = $ca->basedir . '/ab.dump';
$ca->command_ok([ 'pg_dump', '-Fc', '-f', $dump1, '-d', $ca->connstr('postgres') ], 'A: pg_dump (alice, bob)');

# carol's records go in a second dump only
$ca->safe_psql('postgres', q{
	SET ROLE carol;
	SELECT idem_finish('mine', 'k', (SELECT token FROM idem_begin('mine', 'k', '\x01'::bytea)),
	                   '{"owner": "carol"}');
	SELECT idem_finish('mine', 'carol-only', (SELECT token FROM idem_begin('mine', 'carol-only', '\x01'::bytea)),
	                   '{"owner": "carol"}');});
my $dump2 = $ca->basedir . '/abc.dump';
$ca->command_ok([ 'pg_dump', '-Fc', '-f', $dump2, '-d', $ca->connstr('postgres') ], 'A: pg_dump (alice, bob, carol)');
check_amcheck($ca, 'postgres', 'A');
$ca->stop;

# ---- cluster B ----
my $cb = PostgreSQL::Test::Cluster->new('roles_b');
$cb->init;
$cb->start;
my $max = (sort { $b <=> $a } values %oid_a)[0];
my %holder;    # OID -> throw-away role now holding it
for my $i (1 .. 200)
{
	my $o = $cb->safe_psql('postgres', "CREATE ROLE x$i; SELECT oid FROM pg_roles WHERE rolname = 'x$i'");
	$holder{$o} = "x$i";
	last if $o >= $max;
}
ok(defined $holder{ $oid_a{alice} }, "B: a throw-away role holds alice's old OID ($oid_a{alice})")
  or diag(explain \%holder);
my $thief = $holder{ $oid_a{alice} } // 'x1';
my $carol_thief = $holder{ $oid_a{carol} } // 'x1';
$cb->safe_psql('postgres', 'CREATE ROLE bob LOGIN; CREATE ROLE alice LOGIN;');
my %oid_b = map { $_ => $cb->safe_psql('postgres', "SELECT oid FROM pg_roles WHERE rolname = '$_'") }
  qw(alice bob);
isnt($oid_b{alice}, $oid_a{alice}, "B: alice has another OID ($oid_b{alice})");
isnt($oid_b{bob}, $oid_a{bob}, "B: bob has another OID ($oid_b{bob})");

$cb->safe_psql('postgres', 'CREATE DATABASE r1; CREATE DATABASE r2;');
my ($ret, $out, $err);
$cb->command_ok([ 'pg_restore', '--exit-on-error', '-d', $cb->connstr('r1'), $dump1 ],
	'B: pg_restore of the alice/bob dump');

sub as_role
{
	my ($node, $db, $role, $op, $key) = @_;
	return $node->safe_psql($db, qq{
		BEGIN; SET ROLE $role;
		SELECT status || '|' || coalesce(response::text, '') FROM idem_begin('$op', '$key', '\\x01'::bytea);
		ROLLBACK;});
}
is(as_role($cb, 'r1', 'alice', 'mine', 'k'), 'replay|{"owner": "alice"}', "B: alice replays alice's response");
is(as_role($cb, 'r1', 'bob', 'mine', 'k'), 'replay|{"owner": "bob"}', 'B: bob replays his own');
is(as_role($cb, 'r1', $thief, 'mine', 'k'), 'new|',
	"B: $thief, holding alice's old OID, does not see alice's record");
for my $r (qw(alice bob))
{
	check_load($cb, 'r1', 'pay', "B, $r", role => $r);
}
is( $cb->safe_psql('r1', q{
		SELECT count(*) FROM (SELECT role_id FROM idem_record UNION ALL SELECT role_id FROM idem_result) r
		 WHERE role_id::regrole::text NOT IN ('alice', 'bob')}),
	'0', 'B: every restored record belongs to alice or bob');
check_amcheck($cb, 'r1', 'B');

# carol does not exist in B: the restore of her records fails loudly
my ($rout, $rerr) = ('', '');
my $rok = IPC::Run::run([ 'pg_restore', '-d', $cb->connstr('r2'), $dump2 ], '>', \$rout, '2>', \$rerr);
ok(!$rok, 'B: pg_restore of a dump with records of a missing role exits non-zero');
like($rerr, qr/idem_result/, 'B: and reports an error for the idem_result data (completed records)') or diag($rerr);
like($rerr, qr/carol/, 'B: naming the missing role');
is( $cb->safe_psql('r2', q{
		SELECT count(*) FROM (SELECT * FROM idem_record UNION ALL SELECT * FROM idem_result) r
		 WHERE response->>'owner' = 'carol' OR key = 'carol-only'}),
	'0', "B: no role got carol's records");
for my $r ('alice', 'bob', $carol_thief, $thief)
{
	is(as_role($cb, 'r2', $r, 'mine', 'carol-only'), 'new|', "B: $r does not see carol's record");
}

$cb->stop;
done_testing();
