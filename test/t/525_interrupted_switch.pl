
# Copyright (c) 2024, idempotency authors
#
# test/run: serial
#
# An online durability switch cut short never promises more than its
# storage holds, and the next call finishes it.
#
# 2,000 keys are completed; then CALL idem_set_durability_online switches
# none -> completed, or completed -> none, and is cut short at one of its
# two stages:
#   drain   while it moves records between the tables (a row trigger on
#           the table they move into sleeps 5 ms a row, so the drain lasts
#           10 s), once some have moved;
#   flip    while it waits for its ACCESS EXCLUSIVE lock to change a
#           table's persistence (another session holds a lock on it);
# by one of three means: pg_terminate_backend, pg_cancel_backend, and its
# own statement_timeout.  Then, for each of the 12 cases:
#   1. idem_durability() is true of the storage: 'completed' only when
#      idem_result is logged and no completed record is left in the
#      unlogged idem_record;
#   2. after a crash (immediate shutdown), a retry of every key replays if
#      the mode said 'completed' before the crash (a retry that gets 'new'
#      is allowed only where the mode said 'none', and finishes the key
#      again);
#   3. the next CALL idem_set_durability_online finishes the switch: the
#      mode is the target, the tables are the target's; and for
#      'completed', after another crash, every key replays.

use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

use FindBin;
use lib $FindBin::RealBin;
use IdemTest qw(:DEFAULT try_sql :switch);

my $nkeys = 2000;

my $node = PostgreSQL::Test::Cluster->new('interrupted_switch');
$node->init;
$node->start;
$node->safe_psql('postgres', 'CREATE EXTENSION idempotency');
create_slow_row($node);

sub sql { return $node->safe_psql('postgres', $_[0]); }

my $case = 0;
for my $dir ([ 'none', 'completed' ], [ 'completed', 'none' ])
{
	my ($from, $to) = @$dir;
	for my $stage ('drain', 'flip')
	{
		for my $means ('terminate', 'cancel', 'statement_timeout')
		{
			$case++;
			my $op = "c$case";
			my $name = "$from -> $to, cut short at the $stage by $means";

			# the starting point: $nkeys completed keys in mode $from
			complete_keys($node, $op, $from, $nkeys);
			my $into = $to eq 'completed' ? 'idem_result' : 'idem_record';
			sql(qq{CREATE TRIGGER slow BEFORE INSERT ON $into FOR EACH ROW EXECUTE FUNCTION slow_row();})
			  if $stage eq 'drain';

			my $blocker;
			if ($stage eq 'flip')
			{
				# holds the table whose persistence changes first
				$blocker = $node->background_psql('postgres', on_error_stop => 0);
				run_sql($blocker, 'BEGIN; LOCK idem_result IN ACCESS SHARE MODE;');
			}
			my $sw = $node->background_psql('postgres', on_error_stop => 0);
			my ($pid) = run_sql($sw, 'SELECT pg_backend_pid();');
			run_sql($sw, q{SET statement_timeout = '3s';}) if $means eq 'statement_timeout';
			send_sql($sw, qq{CALL idem_set_durability_online('$to', 20);});

			my $reached = $stage eq 'flip' ?
			  qq{SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $pid} :
			  qq{SELECT count(*) > 200 FROM $into WHERE operation = '$op'};
			ok($node->poll_query_until('postgres', $reached), "$name: the switch reaches its $stage");
			if ($means eq 'terminate')
			{
				sql("SELECT pg_terminate_backend($pid)");
			}
			elsif ($means eq 'cancel')
			{
				sql("SELECT pg_cancel_backend($pid)");
			}
			my ($out, $st);
			eval { (undef, $st) = wait_sql($sw); 1 } or $st = 'gone';
			like($st, $means eq 'terminate' ? qr/^(gone|57P01|08\w\w\w)$/ : qr/^57014$/,
				"$name: the CALL was cut short ($st)");
			eval { $sw->quit; };
			if ($blocker)
			{
				run_sql($blocker, 'ROLLBACK;');
				$blocker->quit;
			}

			my $truth = mode_truth($node);
			my ($promised) = split /\|/, $truth;
			like($truth, qr/\|true/, "$name: idem_durability() is true of the storage ($truth)");

			sql("DROP TRIGGER IF EXISTS slow ON $into");
			crash_restart($node);
			my ($replays, $news) = split /\|/, retry_all($node, $op, $nkeys);
			if ($promised eq 'completed')
			{
				is("$replays|$news", "$nkeys|0", "$name: after a crash every key replays (mode said 'completed')");
			}
			else
			{
				is($replays + $news, $nkeys, "$name: after a crash every key replays or, as mode 'none' allows, runs again ($replays|$news)");
			}

			# the next call finishes the switch
			my ($st2, $o2, $e2) = try_sql($node, 'postgres', qq{CALL idem_set_durability_online('$to');});
			is($st2, '00000', "$name: the next CALL succeeds") or diag($e2);
			like(mode_truth($node), qr/^\Q$to\E\|true/, "$name: the mode is now '$to', true of the storage");
			if ($to eq 'completed')
			{
				crash_restart($node);
				is(retry_all($node, $op, $nkeys), "$nkeys|0", "$name: after the switch and a crash every key replays");
			}
			else
			{
				is(sql(q{SELECT count(*) FROM idem_result}), '0', "$name: idem_result is empty in mode 'none'");
			}
		}
	}
}

# ---- one switch at a time ----
{
	sql(q{SELECT idem_set_durability('none');});
	sql(q{CREATE TRIGGER slow BEFORE INSERT ON idem_result FOR EACH ROW EXECUTE FUNCTION slow_row();});
	my $sw = $node->background_psql('postgres', on_error_stop => 0);
	my ($pid) = run_sql($sw, 'SELECT pg_backend_pid();');
	send_sql($sw, q{CALL idem_set_durability_online('completed', 20);});
	ok($node->poll_query_until('postgres', q{SELECT count(*) > 100 FROM idem_result}),
		'a second switch: the first is draining');
	my ($st, undef, $err) = try_sql($node, 'postgres', q{SET lock_timeout = '200ms'; SELECT idem_set_durability('none');});
	is($st, '55P03', 'a second switch waits for the one running (here: its lock_timeout)') or diag($err);
	sql("SELECT pg_cancel_backend($pid)");
	wait_sql($sw);
	$sw->quit;
	sql(q{DROP TRIGGER slow ON idem_result});
}

$node->stop;
done_testing();
