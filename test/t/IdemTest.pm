
# Copyright (c) 2024, idempotency authors
#
# IdemTest: helpers shared by the TAP tests in test/t -- a psql session
# driven statement by statement.
#
# A session is what $node->background_psql($db, on_error_stop => 0)
# returns (a PostgreSQL::Test::BackgroundPsql: {run}, {stdin}, {stdout},
# {stderr}).  Exported:
#
#   send_sql($s, $sql)   start $sql in session $s without waiting for it
#   sql_done($s)         has the statement started by send_sql finished?
#   wait_sql($s)         wait for it: (output, sqlstate, stderr); dies if
#                        psql exits or after timeout_default
#   run_sql($s, $sql)    send_sql then wait_sql
#
# Each statement is followed by "\echo __done__ :SQLSTATE" and
# "\warn __done__", so its end, its SQLSTATE (00000 on success) and all of
# its stderr are known without ON_ERROR_STOP.
#
# Use from a test file (prove_installcheck does not put test/t on @INC):
#
#   use FindBin;
#   use lib $FindBin::RealBin;
#   use IdemTest;
#
# This file is no test: prove runs only test/t/*.pl.

package IdemTest;

use strict;
use warnings;

use Exporter 'import';
use IPC::Run;
use PostgreSQL::Test::Utils ();

our @EXPORT = qw(send_sql sql_done wait_sql run_sql);

# Start $sql in session $s without waiting for it to finish.
sub send_sql
{
	my ($s, $sql) = @_;
	$s->{stdout} = '';
	$s->{stderr} = '';
	$s->{stdin} .= "$sql\n\\echo __done__ :SQLSTATE\n\\warn __done__\n";
	$s->{run}->pump_nb;
	return;
}

# Has the statement started by send_sql finished?
sub sql_done
{
	my ($s) = @_;
	$s->{run}->pump_nb;
	return $s->{stdout} =~ /__done__/;
}

# Wait for the statement started by send_sql: (output, sqlstate, stderr)
sub wait_sql
{
	my ($s) = @_;
	my $timer = IPC::Run::timer($PostgreSQL::Test::Utils::timeout_default);
	$timer->start;
	until ($s->{stdout} =~ /__done__ \w+\n/ && $s->{stderr} =~ /__done__\n/)
	{
		die "timed out waiting for psql: $s->{stdout} $s->{stderr}"
		  if $timer->is_expired;
		die "psql exited: $s->{stdout} $s->{stderr}"
		  unless $s->{run}->pumpable;
		$s->{run}->pump;
	}
	my ($out, $state) = $s->{stdout} =~ /^(.*?)\n?__done__ (\w+)\n/s;
	(my $err = $s->{stderr}) =~ s/__done__\n//;
	return ($out, $state, $err);
}

# Run $sql in session $s and wait for it: (output, sqlstate, stderr)
sub run_sql
{
	my ($s, $sql) = @_;
	send_sql($s, $sql);
	return wait_sql($s);
}

1;
