
# Copyright (c) 2024, idempotency authors
#
# A role's distributed records through ALTER ROLE ... RENAME and DROP ROLE
# (docs/scaling-out.md, "Roles"), on a real Citus cluster: role_id holds
# the role's name there, so
#
#  - after ALTER ROLE bob RENAME TO carol (on the coordinator; Citus
#    propagates it), carol's finished key replays through every node, and
#    her pending claim is still hers;
#  - a role created later as bob does not get bob's records: its claim of
#    the same key is new;
#  - DROP ROLE carol is refused (2BP01) while she has records, and changes
#    nothing; DROP OWNED BY carol deletes them, and the role can go;
#  - on one server (a database without Citus), DROP OWNED BY deletes the
#    role's records too.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::RealBin/../../t";
use lib $FindBin::RealBin;
use CitusCluster;
use IdemTest qw(:DEFAULT try_sql);
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my @nodes = citus_cluster('r');
my ($coord, $w1, $w2) = @nodes;

$coord->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	SELECT idem_distribute();
	CREATE ROLE bob LOGIN;
});

# $sql as role $role through node $n
sub as_role
{
	my ($n, $role, $sql) = @_;
	return try_sql($n, 'postgres', "SET ROLE $role; $sql");
}

my ($st, $out) = as_role($w1, 'bob', q{SELECT token FROM idem_begin('charge', 'r-1', NULL)});
($st) = as_role($w1, 'bob', qq{SELECT idem_finish('charge', 'r-1', $out, '{"by": "bob"}')});
is($st, '00000', 'bob finished r-1');
($st, $out) = as_role($w2, 'bob', q{SELECT token FROM idem_begin('charge', 'r-2', NULL, lease => '1 hour')});
is($st, '00000', 'bob claimed r-2');
my $tok = $out;

$coord->safe_psql('postgres', q{ALTER ROLE bob RENAME TO carol});
for my $n (@nodes)
{
	($st, $out) = as_role($n, 'carol', q{SELECT status || ' ' || response FROM idem_begin('charge', 'r-1', NULL)});
	is($out, 'replay {"by": "bob"}', 'carol replays her key renamed through ' . $n->name);
	($st) = as_role($n, 'carol', q{SELECT idem_begin('charge', 'r-2', NULL, in_flight => 'raise')});
	is($st, 'IK409', 'her pending claim is still hers, through ' . $n->name);
}

$coord->safe_psql('postgres', q{CREATE ROLE bob LOGIN});
for my $n (@nodes)
{
	($st, $out) = as_role($n, 'bob', q{SELECT state FROM idem_inspect('charge', 'r-1')});
	is($out, '', 'a new role named bob has no record of r-1, through ' . $n->name);
}
($st, $out) = as_role($w2, 'bob', q{SELECT status FROM idem_begin('charge', 'r-1', NULL)});
is($out, 'new', "the new bob's claim of r-1 is new: he never replays the old bob's response");

($st) = try_sql($coord, 'postgres', q{DROP ROLE carol});
is($st, '2BP01', 'a role with distributed records cannot be dropped');
($st, $out) = as_role($w1, 'carol', q{SELECT status FROM idem_begin('charge', 'r-1', NULL)});
is($out, 'replay', 'and keeps them');
$coord->safe_psql('postgres', q{DROP OWNED BY carol});
is($coord->safe_psql('postgres', q{SELECT count(*) FROM idem_record WHERE role_id = 'carol'}), '0',
	"DROP OWNED BY deletes the role's records");
($st) = try_sql($coord, 'postgres', q{DROP ROLE carol});
is($st, '00000', 'then the role can be dropped');
is($coord->safe_psql('postgres', q{SELECT count(*) FROM idem_record WHERE role_id = 'bob'}), '1',
	"the new bob's record stays");

# records on one server (a database without Citus: role_id is the OID):
# DROP OWNED BY deletes the role's records there too
$coord->safe_psql('postgres', q{CREATE DATABASE plain; CREATE ROLE dave LOGIN});
$coord->safe_psql('plain', q{CREATE EXTENSION idempotency});
($st) = try_sql($coord, 'plain', q{SET ROLE dave; SELECT idem_begin('charge', 'd-1', NULL)});
is($st, '00000', 'dave claimed d-1 on one server');
$coord->safe_psql('plain', q{DROP OWNED BY dave});
is($coord->safe_psql('plain', q{SELECT count(*) FROM idem_record WHERE role_id = 'dave'::regrole}), '0',
	"DROP OWNED BY deletes the role's records on one server");

$_->stop for @nodes;
done_testing();
