
# Copyright (c) 2026, idempotency authors
#
# The state of a takeover => 'session' claim is the same in every view and
# function, and never a confident wrong one on a hot standby.
#
# A primary in durability mode 'all' (the claims are logged, so a streaming
# hot standby has them too), with three pending claims of one operation,
# each with a 1 h lease: 'alive', a 'session' claim whose session stays
# connected; 'gone', a 'session' claim whose session has ended; 'leased',
# an ordinary lease claim.
#
# 1. On the primary, every view says what idem_begin does: idem_inspect,
#    idem_stats and idem_monitor call 'gone' lapsed and the other two
#    pending; a duplicate of 'alive' in raise mode gets IK409.
# 2. On the standby, which cannot see the primary's sessions: idem_inspect
#    calls both 'session' claims 'unknown' (before, it called the live one
#    'lapsed'), 'leased' pending; idem_stats and idem_monitor count two
#    unknown and one pending.
# 3. Back on the primary, a duplicate of 'gone' gets 'new' (a takeover),
#    and the views count three pending claims.

use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

use FindBin;
use lib $FindBin::RealBin;
use IdemTest qw(:DEFAULT :bench);

my $primary = PostgreSQL::Test::Cluster->new('primary');
$primary->init(allows_streaming => 1);
$primary->start;
$primary->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	SELECT idem_set_durability('all');});
$primary->backup('b');
my $standby = PostgreSQL::Test::Cluster->new('standby');
$standby->init_from_backup($primary, 'b', has_streaming => 1);
$standby->start;

my $session_claim = q{SELECT status FROM idem_begin('st', '%s', NULL,
	lease => '1 h', takeover => 'session');};

# 'alive': its session stays connected to the end
my $alive = $primary->background_psql('postgres', on_error_stop => 0);
my ($out, $st) = run_sql($alive, sprintf($session_claim, 'alive'));
is("$st|$out", '00000|new', "'alive': a session claim");

# 'gone': its session ends
my $gone = $primary->background_psql('postgres', on_error_stop => 0);
($out, $st) = run_sql($gone, sprintf($session_claim, 'gone') . q{ SELECT pg_backend_pid();});
my ($gone_pid) = $out =~ /(\d+)$/;
is("$st|" . ($out =~ /^new/ ? 'new' : $out), '00000|new', "'gone': a session claim");
$gone->quit;
ok($primary->poll_query_until('postgres',
	"SELECT count(*) = 0 FROM pg_stat_activity WHERE pid = $gone_pid"),
	"'gone': its session has ended");

$primary->safe_psql('postgres', q{SELECT idem_begin('st', 'leased', NULL, lease => '1 h')});

# "key:state" of the three keys, as idem_inspect says
sub inspect_states
{
	my ($node) = @_;
	return $node->safe_psql('postgres', q{
		SELECT string_agg(k || ':' || (SELECT state FROM idem_inspect('st', k)), ' ' ORDER BY k)
		  FROM unnest(ARRAY['alive', 'gone', 'leased']) k});
}
# "pending,lapsed,unknown" of the operation, as idem_stats counts them
sub stats_counts
{
	my ($node) = @_;
	return $node->safe_psql('postgres', q{
		SELECT pending || ',' || lapsed || ',' || unknown FROM idem_stats WHERE operation = 'st'});
}
# "state:records ..." of the operation, as idem_monitor counts them
sub monitor_counts
{
	my ($node) = @_;
	return $node->safe_psql('postgres', q{
		SELECT string_agg(state || ':' || records, ' ' ORDER BY state)
		  FROM idem_monitor WHERE operation = 'st'});
}

# ---- 1. the primary ----
is(inspect_states($primary), 'alive:pending gone:lapsed leased:pending',
	'primary: idem_inspect: the ended session\'s claim is lapsed, the others pending');
is(stats_counts($primary), '2,1,0', 'primary: idem_stats counts 2 pending, 1 lapsed, as idem_inspect');
is(monitor_counts($primary), 'lapsed:1 pending:2', 'primary: idem_monitor counts 2 pending, 1 lapsed, as idem_inspect');
{
	my ($st, undef, $err) = try_sql($primary, 'postgres',
		q{SELECT idem_begin('st', 'alive', NULL, in_flight => 'raise')});
	is($st, 'IK409', 'primary: a duplicate of the live session\'s claim gets IK409') or diag($err);
}

# ---- 2. the standby ----
$primary->wait_for_catchup($standby, 'replay');
is(inspect_states($standby), 'alive:unknown gone:unknown leased:pending',
	'standby: idem_inspect calls both session claims unknown, the lease claim pending');
is(stats_counts($standby), '1,0,2', 'standby: idem_stats counts 1 pending, 2 unknown');
is(monitor_counts($standby), 'pending:1 unknown:2', 'standby: idem_monitor counts 1 pending, 2 unknown');

# ---- 3. a duplicate of the ended session's claim takes it over ----
($st, $out) = try_sql($primary, 'postgres',
	q{SELECT status FROM idem_begin('st', 'gone', NULL, in_flight => 'raise')});
is("$st|$out", '00000|new', "primary: a duplicate of 'gone' gets new");
is(inspect_states($primary), 'alive:pending gone:pending leased:pending', 'primary: then all three are pending');
is(stats_counts($primary), '3,0,0', 'primary: idem_stats counts 3 pending');
is(monitor_counts($primary), 'pending:3', 'primary: idem_monitor counts 3 pending');

$alive->quit;
$standby->stop;
$primary->stop;
done_testing();
