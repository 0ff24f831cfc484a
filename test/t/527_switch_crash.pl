
# Copyright (c) 2024, idempotency authors
#
# test/run: serial
#
# A crash (immediate shutdown) at each step of an online durability switch
# (CALL idem_set_durability_online): after recovery the mode reported is
# the mode the storage holds, and every completed key replays wherever the
# mode promised it before the crash.
#
# 1,000 completed keys; then one of four switches -- none -> completed,
# completed -> none, completed -> all, all -> completed -- and a crash:
#   flip    while it waits for the ACCESS EXCLUSIVE locks of the step that
#           changes a table's persistence (another session holds a lock
#           on idem_result), i.e. before the flip;
#   commit  during the flip: its commit is written and flushed, and waits
#           for a synchronous standby that does not exist
#           (synchronous_standby_names set once the switch waits for the
#           flip's locks);
#   drain   while it moves records into the table that keeps them (a row
#           trigger there sleeps 5 ms a row), once some have moved: the
#           last drain of none -> completed, after its flip; the drains
#           before the flip of the other two that move records;
#   done    once the CALL has returned, i.e. after the flip and the drain.
# Each step is reached by the timing of real steps (a lock held, a slow
# trigger), not by hooks.  After the restart:
#   1. idem_durability() is true of the storage;
#   2. if the mode said 'completed' or 'all' before the crash, a retry of
#      every key replays; else every key replays or runs again;
#   3. the next CALL finishes the switch, and after another crash every
#      key replays if the target keeps completed records.

use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

use FindBin;
use lib $FindBin::RealBin;
use IdemTest qw(:DEFAULT :bench :switch);

my $nkeys = 1000;

my $node = PostgreSQL::Test::Cluster->new('switch_crash');
$node->init(allows_streaming => 1);    # wal senders: a commit can wait for a standby
$node->start;
$node->safe_psql('postgres', 'CREATE EXTENSION idempotency; CREATE TABLE probe (i int);');
create_slow_row($node);

sub sql { return $node->safe_psql('postgres', $_[0]); }

# the table a switch moves records into, where records move
my %into = (
	'none>completed' => 'idem_result',
	'completed>none' => 'idem_record',
	'all>completed'  => 'idem_result',
	'completed>all'  => undef);

my %weaker = (
	'none>completed' => 'none',
	'completed>none' => 'none',
	'all>completed'  => 'completed',
	'completed>all'  => 'completed');

my $case = 0;
for my $dir ([ 'none', 'completed' ], [ 'completed', 'none' ], [ 'completed', 'all' ], [ 'all', 'completed' ])
{
	my ($from, $to) = @$dir;
	my $into = $into{"$from>$to"};
	for my $stage ('flip', 'commit', 'drain', 'done')
	{
		next if $stage eq 'drain' && !defined $into;
		$case++;
		my $op = "c$case";
		my $name = "$from -> $to, crash at the $stage";

		# the starting point: $nkeys completed keys in mode $from
		complete_keys($node, $op, $from, $nkeys);
		sql(qq{CREATE TRIGGER slow BEFORE INSERT ON $into FOR EACH ROW EXECUTE FUNCTION slow_row();})
		  if $stage eq 'drain';

		my $blocker;
		if ($stage eq 'flip' || $stage eq 'commit')
		{
			$blocker = $node->background_psql('postgres', on_error_stop => 0);
			run_sql($blocker, 'BEGIN; LOCK idem_result IN ACCESS SHARE MODE;');
		}
		my $sw = $node->background_psql('postgres', on_error_stop => 0);
		my ($pid) = run_sql($sw, 'SELECT pg_backend_pid();');
		send_sql($sw, qq{CALL idem_set_durability_online('$to', 20);});

		if ($stage eq 'done')
		{
			my (undef, $st) = wait_sql($sw);
			is($st, '00000', "$name: the switch ends");
		}
		elsif ($stage eq 'drain')
		{
			ok($node->poll_query_until('postgres', qq{SELECT count(*) > 100 FROM $into WHERE operation = '$op'}),
				"$name: the switch reaches its drain");
		}
		else
		{
			ok($node->poll_query_until('postgres',
					qq{SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $pid}),
				"$name: the switch waits for the locks of its flip");
		}
		if ($stage eq 'commit')
		{
			# commits now wait for a standby: seen once a probe's commit waits
			$node->append_conf('postgresql.conf', "synchronous_standby_names = 'nobody'\n");
			$node->reload;
			my $probe = $node->background_psql('postgres', on_error_stop => 0);
			my ($probe_pid) = run_sql($probe, 'SELECT pg_backend_pid();');
			send_sql($probe, 'INSERT INTO probe VALUES (1);');
			ok($node->poll_query_until('postgres',
					qq{SELECT wait_event = 'SyncRep' FROM pg_stat_activity WHERE pid = $probe_pid}),
				"$name: commits wait for a synchronous standby");
			$node->safe_psql('postgres', "SELECT pg_cancel_backend($probe_pid)");
			eval { wait_sql($probe); $probe->quit; };
			run_sql($blocker, 'ROLLBACK;');
			ok($node->poll_query_until('postgres',
					qq{SELECT wait_event = 'SyncRep' FROM pg_stat_activity WHERE pid = $pid}),
				"$name: the flip has committed locally and waits for the standby");
		}
		# the mode promised before the crash: at the flip the switch holds
		# idem_record (every look at the mode waits), so it is the one the
		# switch recorded first, the weaker of the two
		my $promised = $weaker{"$from>$to"};
		if ($stage eq 'drain' || $stage eq 'done')
		{
			my $before = mode_truth($node);
			($promised) = split /\|/, $before;
			like($before, qr/\|true/, "$name: before the crash idem_durability() is true of the storage ($before)");
		}
		else
		{
			is(sql(q{SELECT coalesce((SELECT durability FROM idem_mode), 'completed')}), $promised,
				"$name: idem_mode records '$promised' meanwhile");
		}

		if ($stage eq 'commit')
		{
			$node->stop('immediate');
			$node->append_conf('postgresql.conf', "synchronous_standby_names = ''\n");
			$node->start;
		}
		else
		{
			crash_restart($node);
		}
		eval { $sw->quit; };
		eval { $blocker->quit; } if $blocker;

		my $after = mode_truth($node);
		like($after, qr/\|true/, "$name: after the crash idem_durability() is true of the storage ($after)");
		my ($replays, $news) = split /\|/, retry_all($node, $op, $nkeys);
		if ($promised ne 'none')
		{
			is("$replays|$news", "$nkeys|0", "$name: every key replays (the mode said '$promised')");
		}
		else
		{
			is($replays + $news, $nkeys,
				"$name: every key replays or, as mode 'none' allows, runs again ($replays|$news)");
		}
		sql("DROP TRIGGER IF EXISTS slow ON $into") if defined $into;

		# the next call finishes the switch
		my ($st2, $o2, $e2) = try_sql($node, 'postgres', qq{CALL idem_set_durability_online('$to');});
		is($st2, '00000', "$name: the next CALL succeeds") or diag($e2);
		like(mode_truth($node), qr/^\Q$to\E\|true/, "$name: the mode is now '$to', true of the storage");
		if ($to ne 'none')
		{
			crash_restart($node);
			is(retry_all($node, $op, $nkeys), "$nkeys|0", "$name: after the switch and another crash every key replays");
		}
	}
}

unlike(slurp_file($node->logfile), qr/terminated by signal|PANIC|TRAP:/, 'no backend crashed');
$node->stop;
done_testing();
