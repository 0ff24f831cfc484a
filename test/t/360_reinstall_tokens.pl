# Copyright (c) 2024, idempotency authors
#
# DROP EXTENSION idempotency; CREATE EXTENSION idempotency: the records are
# gone, but fencing tokens must keep increasing -- every token handed out
# after the reinstall is greater than every token handed out before it,
# so a worker that claimed before the reinstall (token T) cannot finish
# the claim of the key's new owner (IK412).
#
# In the default durability mode of a new installation, 'completed', the
# completed records are in idem_result: the checks read both tables.
use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

use FindBin;
use lib $FindBin::RealBin;
use IdemTest;

my $node = PostgreSQL::Test::Cluster->new('reinstall');
$node->init;
$node->start;
setup_load($node);

# the first claim of all: a worker that will outlive the reinstall
my $worker = $node->background_psql('postgres', on_error_stop => 0);
my ($t_worker, $state, $err) = run_sql($worker,
	q{SELECT token FROM idem_begin('op', 'x', '\x01'::bytea, lease => '1 hour');});
like($t_worker, qr/^\d+$/, "the worker claimed x with token $t_worker");

# keys claimed and noted: completed, pending, aborted
my @keys = map { "k$_" } 1 .. 50;
my %before;
for my $k (@keys)
{
	$before{$k} = $node->safe_psql('postgres',
		qq{SELECT token FROM idem_begin('op', '$k', '\\x01'::bytea, lease => '1 hour')});
}
$node->safe_psql('postgres', qq{SELECT idem_finish('op', 'k$_', $before{"k$_"}, '{"done": true}')})
  for 1 .. 20;
$node->safe_psql('postgres', qq{SELECT idem_abort('op', 'k$_', $before{"k$_"})}) for 21 .. 30;

my $load = start_load($node, op => 'ld', keys => 1500, clients => 4, seconds => 4);
my ($bout, $berr) = stop_load($load);
unlike($berr, qr/ERROR|WARNING|aborted/, 'the load before the reinstall met no error') or diag($berr);
check_load($node, 'postgres', 'ld', 'before the reinstall');
check_amcheck($node, 'postgres', 'before the reinstall');

my $max_before = $node->safe_psql('postgres', qq{
	SELECT greatest((SELECT max(token) FROM $IDEM_RECORDS r), (SELECT max(token) FROM effect))});
for my $t (values %before, $t_worker)
{
	$max_before = $t if $t > $max_before;
}
note("greatest token before the reinstall: $max_before");

$node->safe_psql('postgres', 'DROP EXTENSION idempotency; CREATE EXTENSION idempotency;');
is($node->safe_psql('postgres', "SELECT count(*) FROM $IDEM_RECORDS r"), '0', 'the reinstall dropped the records');

# the new owner of x claims first, as the worker did before
my $t_owner = $node->safe_psql('postgres',
	q{SELECT status || '|' || token FROM idem_begin('op', 'x', '\x01'::bytea, lease => '1 hour')});
like($t_owner, qr/^new\|\d+$/, "after the reinstall x is claimed anew: $t_owner");
($t_owner) = $t_owner =~ /(\d+)$/;
cmp_ok($t_owner, '>', $max_before, 'its token is greater than every token before the reinstall');

my %after;
for my $k (@keys)
{
	my $r = $node->safe_psql('postgres',
		qq{SELECT status || '|' || token FROM idem_begin('op', '$k', '\\x01'::bytea)});
	($after{$k}) = $r =~ /^new\|(\d+)$/;
	$after{$k} //= -1;
}
is(scalar(grep { $after{$_} <= $max_before } @keys), 0,
	'every key claimed again: every new token is greater than every token before the reinstall');

# the old worker, in the same session as before, cannot finish the new claim
my $out;
($out, $state, $err) = run_sql($worker,
	qq{SELECT idem_finish('op', 'x', $t_worker, '{"by": "old worker"}');});
is($state, 'IK412', 'the pre-reinstall worker\'s finish of x: IK412') or diag($err);
($out, $state, $err) = run_sql($worker, qq{SELECT idem_abort('op', 'x', $t_worker);});
is("$state|$out", '00000|f', 'its abort changes nothing (false)') or diag($err);
$node->safe_psql('postgres', qq{SELECT idem_finish('op', 'x', $t_owner, '{"by": "new owner"}')});
is($node->safe_psql('postgres', q{SELECT response::text FROM idem_begin('op', 'x', '\x01'::bytea)}),
	'{"by": "new owner"}', 'x replays the new owner\'s response');
$worker->quit;

# and the load carries on, on the reinstalled extension
$node->safe_psql('postgres', 'TRUNCATE effect');
$load = start_load($node, op => 'ld2', keys => 1500, clients => 4, seconds => 4);
($bout, $berr) = stop_load($load);
unlike($berr, qr/ERROR|WARNING|aborted/, 'the load after the reinstall met no error') or diag($berr);
check_load($node, 'postgres', 'ld2', 'after the reinstall');
cmp_ok($node->safe_psql('postgres', 'SELECT min(token) FROM effect'), '>', $max_before,
	'the load\'s tokens too are greater than every token before the reinstall');
check_amcheck($node, 'postgres', 'after the reinstall');

$node->stop;
done_testing();
