# shellcheck shell=bash
# test/lib.sh: helpers for test/run (sourced, not executed).
#
# Everything here is plain functions; test/run owns the control flow.
# Conventions:
#   IDEM_TMP     temp root of this run (owned by postgres), removed at exit
#   IDEM_SRC     copy of the source tree inside IDEM_TMP; tests run from here
#   PG_BINDIR    the binaries of PostgreSQL PG_MAJOR
# Functions that can fail return non-zero and print why; they never exit,
# so the caller decides whether a failure is fatal.

# PostgreSQL major version under test: 15 on the host; test/run sets 17 or 18
# inside its chroots (test/chroot.sh)
: "${PG_MAJOR:=15}"
: "${PG_BINDIR:=/usr/lib/postgresql/$PG_MAJOR/bin}"
PG_CONFIG="$PG_BINDIR/pg_config"
# a private copy of an installation (/X/usr/lib/postgresql/N/bin) has its
# share directory beside it, as PostgreSQL itself finds it
PG_SHAREDIR="${PG_BINDIR%/lib/postgresql/*}/share/postgresql/$PG_MAJOR"

# ---------------------------------------------------------------- messages

info() { printf '==> %s\n' "$*"; }
warn() { printf '==> WARNING: %s\n' "$*" >&2; }
err()  { printf '==> ERROR: %s\n' "$*" >&2; }

# show_file FILE [MAX_LINES]: print a file framed, capped so one huge diff
# cannot drown a CI log.
show_file() {
	local file=$1 max=${2:-400} n
	[[ -s $file ]] || return 0
	n=$(wc -l <"$file")
	printf -- '----- %s (%s lines) -----\n' "${file#"${IDEM_TMP:-}/"}" "$n"
	head -n "$max" "$file"
	(( n <= max )) || printf -- '----- ... %s more lines cut -----\n' $(( n - max ))
	printf -- '----- end of %s -----\n' "${file##*/}"
}

# show_tail FILE [LINES]
show_tail() {
	local file=$1 lines=${2:-60}
	[[ -s $file ]] || return 0
	printf -- '----- last %s lines of %s -----\n' "$lines" "${file#"${IDEM_TMP:-}/"}"
	tail -n "$lines" "$file"
	printf -- '----- end of %s -----\n' "${file##*/}"
}

# ----------------------------------------------------------- who runs what

is_root() { [[ $EUID -eq 0 ]]; }

# as_pg CMD...: run CMD as the postgres OS user (PostgreSQL refuses to run as
# root).  When we are not root we already are the user that will run the
# tests, so run directly.  The command starts in $RUN_DIR (default: the temp
# root), because runuser keeps the cwd and the caller's cwd may be a
# directory postgres cannot enter (a clone under /root, say).
# The environment is inherited (runuser only resets HOME/SHELL/USER/LOGNAME).
as_pg() {
	local dir=${RUN_DIR:-${IDEM_TMP:-/}}
	if is_root; then
		(cd "$dir" && exec runuser -u postgres -- "$@")
	else
		(cd "$dir" && exec "$@")
	fi
}

# as_pg_in DIR CMD...
as_pg_in() {
	local dir=$1
	shift
	RUN_DIR=$dir as_pg "$@"
}

# run_bg CMD...: run CMD and return its exit status, but in the background
# with `wait`: bash defers traps until a foreground command ends, while
# `wait` is interrupted at once, so Ctrl-C / a CI cancel reach our EXIT trap
# (which ends our children and stops our servers) without waiting for a
# suite that may take many minutes.  stdin is /dev/null: nothing in a test
# run may wait for a keyboard.
run_bg() {
	local rc=0
	"$@" </dev/null &
	wait "$!" || rc=$?
	return "$rc"
}

# run_logged LOG CMD...: run CMD showing its output live (CI wants progress)
# and keeping a copy in LOG for counting.  Returns CMD's exit status
# (pipefail).
run_logged() {
	local log=$1
	shift
	run_bg _tee_to "$log" "$@"
}
_tee_to() {
	local log=$1
	shift
	"$@" 2>&1 | tee "$log"
}

# descendants PID: every descendant process of PID, from /proc (procps may
# not be installed on a fresh machine).  Excludes the subshell running this.
descendants() {
	local root=$1 self=$BASHPID f line pid ppid
	local -a fields queue
	local -A kids=()
	for f in /proc/[0-9]*/stat; do
		{ read -r line <"$f"; } 2>/dev/null || continue
		pid=${line%% *}
		# "pid (comm) state ppid ...": comm may hold spaces, so split
		# after its closing parenthesis
		read -ra fields <<<"${line##*) }"
		ppid=${fields[1]}
		[[ $pid != "$self" ]] || continue
		kids[$ppid]+=" $pid"
	done
	queue=("$root")
	while (( ${#queue[@]} > 0 )); do
		pid=${queue[0]}
		queue=("${queue[@]:1}")
		for f in ${kids[$pid]:-}; do
			echo "$f"
			queue+=("$f")
		done
	done
}

# end_children: TERM (then KILL) every process this script started that is
# still running, by pid.  Servers started with pg_ctl are not among them
# (they daemonize); stop_servers_under handles those.
end_children() {
	local -a pids alive
	local p
	# one snapshot: once a parent dies its children are re-parented to
	# init and would no longer be found by walking from $$
	mapfile -t pids < <(descendants "$$")
	(( ${#pids[@]} > 0 )) || return 0
	kill -TERM "${pids[@]}" 2>/dev/null || true
	for _ in 1 2 3 4 5 6; do
		alive=()
		for p in "${pids[@]}"; do
			kill -0 "$p" 2>/dev/null && alive+=("$p")
		done
		(( ${#alive[@]} > 0 )) || return 0
		sleep 1
	done
	kill -KILL "${alive[@]}" 2>/dev/null || true
}

# ------------------------------------------------------------- packages

# The python suite's modules and their Debian packages (the same names in
# bookworm, trixie and sid); test/chroot.sh installs them in the chroots.
PYTHON_MODULES="psycopg:python3-psycopg psycopg_pool:python3-psycopg-pool pytest:python3-pytest
	pydantic:python3-pydantic fastapi:python3-fastapi uvicorn:python3-uvicorn httpx:python3-httpx
	mypy:python3-mypy pip:python3-pip setuptools:python3-setuptools
	flake8:python3-flake8"

pkg_installed() {
	dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null | grep -qx installed
}

# missing_packages: print (one per line) the Debian packages needed for
# building and testing that are not there.  Detection looks at the thing we
# need (a file, a command, a perl module) rather than trusting dpkg alone.
missing_packages() {
	# server + pgcrypto (pgcrypto ships inside postgresql-15 on Debian)
	if [[ ! -x $PG_BINDIR/postgres || ! -f $PG_SHAREDIR/extension/pgcrypto.control ]]; then
		echo postgresql-$PG_MAJOR
	fi
	# headers, PGXS, pg_regress, pg_isolation_regress, TAP perl modules
	if ! pkg_installed postgresql-server-dev-$PG_MAJOR ||
		[[ ! -x $PG_CONFIG || ! -f $PG_BINDIR/../lib/pgxs/src/makefiles/pgxs.mk ]]; then
		echo postgresql-server-dev-$PG_MAJOR
	fi
	# libpq headers for C clients (demo, bench)
	[[ -f /usr/include/postgresql/libpq-fe.h ]] || echo libpq-dev
	command -v make >/dev/null 2>&1 || echo make
	command -v gcc >/dev/null 2>&1 || echo gcc
	# prove and Test::More live in "perl" (perl-base has neither)
	if ! command -v prove >/dev/null 2>&1 || ! perl -MTest::More -e1 >/dev/null 2>&1; then
		echo perl
	fi
	perl -MIPC::Run -e1 >/dev/null 2>&1 || echo libipc-run-perl
	# the connection-pooler TAP test starts its own pgbouncer
	command -v pgbouncer >/dev/null 2>&1 || [[ -x /usr/sbin/pgbouncer ]] || echo pgbouncer
	# the pg_repack TAP test (330) needs the server extension and its client
	if [[ ! -f $PG_SHAREDIR/extension/pg_repack.control || ! -x $PG_BINDIR/pg_repack ]]; then
		echo postgresql-$PG_MAJOR-repack
	fi
	# the python and examples suites speak German to the server too
	# (lc_messages = 'de_DE.UTF-8'), which needs the OS locale
	# installed is enough: sid's locales-all may name its locales otherwise
	{ locale -a 2>/dev/null | grep -qiE '^de_DE\.utf-?8$' || dpkg -s locales-all >/dev/null 2>&1; } || echo locales-all
	# the python suite: Debian's python3 with these modules ("module:package")
	local mod
	for mod in $PYTHON_MODULES; do
		/usr/bin/python3 -c "import ${mod%%:*}" >/dev/null 2>&1 || echo "${mod#*:}"
	done
	# the monitoring TAP test (540) runs Debian's Prometheus exporter and
	# scrapes it with curl (bookworm ships the exporter 0.11, trixie and sid
	# 0.17: both read monitoring/queries.yaml)
	[[ -x /usr/bin/prometheus-postgres-exporter ]] || echo prometheus-postgres-exporter
	command -v curl >/dev/null 2>&1 || echo curl
	# the alerting rules' TAP test (541) checks monitoring/alerts.yaml with
	# Prometheus' promtool, which Debian ships in the prometheus package
	[[ -x /usr/bin/promtool ]] || echo prometheus
	# the examples suite: the Node example and the node/ package (Debian's
	# nodejs and npm; a node from elsewhere, such as NodeSource's, does too)
	command -v node >/dev/null 2>&1 || echo nodejs
	command -v npm >/dev/null 2>&1 || echo npm
	# the portable suite builds pg_tle (test/pgtle/install, which installs
	# them too where it runs alone, as in the chroots): flex for its copy
	# of the configuration file scanner, the Kerberos headers that
	# PostgreSQL's libpq-be.h includes
	command -v flex >/dev/null 2>&1 || echo flex
	pkg_installed libkrb5-dev || echo libkrb5-dev
	# commands a mode needs besides: "command:package" pairs
	local need
	for need in ${EXTRA_COMMANDS:-}; do
		command -v "${need%%:*}" >/dev/null 2>&1 || [[ -x /usr/sbin/${need%%:*} ]] || echo "${need#*:}"
	done
	return 0
}

# ensure_packages: install what is missing (root: apt-get, once), else fail.
ensure_packages() {
	local -a missing
	mapfile -t missing < <(missing_packages)
	if (( ${#missing[@]} == 0 )); then
		info "packages: all present"
		return 0
	fi
	if ! is_root; then
		err "missing packages: ${missing[*]} (not root, so not installing; run as root or: apt-get install ${missing[*]})"
		return 1
	fi
	info "installing missing packages: ${missing[*]}"
	export DEBIAN_FRONTEND=noninteractive
	apt-get -o DPkg::Lock::Timeout=600 update -q || { err "apt-get update failed"; return 1; }
	apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends "${missing[@]}" ||
		{ err "apt-get install ${missing[*]} failed"; return 1; }
	# a package can be "installed" yet lack what we need (e.g. a deleted file)
	mapfile -t missing < <(missing_packages)
	if (( ${#missing[@]} > 0 )); then
		err "still missing after apt-get install: ${missing[*]}"
		return 1
	fi
	return 0
}

# pgxs_dir: .../lib/pgxs (holds src/test/regress/pg_regress, src/test/perl)
pgxs_dir() {
	local mk
	mk=$("$PG_CONFIG" --pgxs) || return 1
	# $mk is .../lib/pgxs/src/makefiles/pgxs.mk
	(cd "$(dirname "$mk")/../.." && pwd)
}

# ---------------------------------------------------------------- temp tree

# make_temp_tree REPO: create IDEM_TMP with a copy of REPO in IDEM_SRC, all
# owned by postgres.  The working tree is copied (not `git ls-files`) so
# tests that are written but not yet committed are run too; .git and build
# products are left behind (the build runs `make clean` anyway).
make_temp_tree() {
	local repo=$1 base=${IDEM_TMPDIR:-/tmp}
	IDEM_TMP=$(mktemp -d "$base/idempotency-test.XXXXXX") ||
		{ err "mktemp -d in $base failed"; return 1; }
	IDEM_SRC=$IDEM_TMP/src
	mkdir "$IDEM_SRC" "$IDEM_TMP/logs"
	tar -C "$repo" -cf - \
		--exclude=./.git --exclude=node_modules \
		--exclude=./tmp_check --exclude=./results --exclude=./output_iso \
		--exclude='*.o' --exclude='*.so' --exclude='*.bc' \
		. | tar -C "$IDEM_SRC" --no-same-owner -xf - ||
		{ err "copying $repo to $IDEM_SRC failed"; return 1; }
	if is_root; then
		chown -R postgres: "$IDEM_TMP"
		# mktemp made it 0700, fine for the owner; but every parent must
		# be traversable by postgres
		if ! as_pg test -w "$IDEM_TMP"; then
			err "user postgres cannot use $IDEM_TMP (is $base traversable by postgres? set IDEM_TMPDIR)"
			return 1
		fi
	fi
	export IDEM_TMP IDEM_SRC
}

# ---------------------------------------------------------------- server

# port_listening PORT: is something listening on TCP PORT (v4 or v6)?
port_listening() {
	local hex
	hex=$(printf '%04X' "$1")
	# /proc/net/tcp*: "sl local_address rem_address st ..."; st 0A = LISTEN
	awk -v p="$hex" 'NR > 1 { split($2, a, ":"); if (toupper(a[2]) == p && $4 == "0A") found = 1 }
		END { exit !found }' /proc/net/tcp /proc/net/tcp6 2>/dev/null
}

# pick_port: a port in 54000..54999 that nothing listens on.  Our server only
# listens on a private Unix socket, so the port merely names the socket file;
# we still avoid busy TCP ports so that a client that falls back to TCP, or a
# bench script starting its own TCP server on PGPORT+N, cannot hit a stranger.
pick_port() {
	local p
	for _ in $(seq 1 100); do
		p=$(( 54000 + RANDOM % 1000 ))
		port_listening "$p" || { echo "$p"; return 0; }
	done
	err "no free port found in 54000..54999"
	return 1
}

# start_server: initdb + start a throwaway cluster in IDEM_TMP.
# Sets and exports PGHOST PGPORT PGUSER; sets IDEM_PGDATA, IDEM_SERVER_LOG.
start_server() {
	IDEM_PGDATA=$IDEM_TMP/data
	IDEM_SERVER_LOG=$IDEM_TMP/logs/server.log
	local sock=$IDEM_TMP/sock port
	port=$(pick_port) || return 1
	if (( ${#sock} + 20 > 107 )); then
		err "socket path $sock is too long for a Unix socket; set IDEM_TMPDIR to a shorter directory"
		return 1
	fi
	as_pg mkdir -p "$sock"

	# UTF8 + C.UTF-8 (always present on Debian 12): results must not depend
	# on the locale of whoever runs the script.
	if ! as_pg "$PG_BINDIR/initdb" -D "$IDEM_PGDATA" -U postgres -A trust \
		-E UTF8 --locale=C.UTF-8 --no-sync >"$IDEM_TMP/logs/initdb.log" 2>&1; then
		err "initdb failed:"
		cat "$IDEM_TMP/logs/initdb.log" >&2
		return 1
	fi

	# Defaults otherwise (tests rely on e.g. max_locks_per_transaction = 64).
	as_pg tee -a "$IDEM_PGDATA/postgresql.conf" >/dev/null <<-EOF

		# ---- added by test/run ----
		port = $port
		listen_addresses = ''
		unix_socket_directories = '$sock'
		max_prepared_transactions = 0
	EOF
	# IDEM_SERVER_WRAPPER: a script that execs postgres under a tool
	# (valgrind for `test/run memcheck`); startup is slower then.
	local -a pgctl_opts=(-w -t 60)
	[[ -z ${IDEM_SERVER_WRAPPER:-} ]] || pgctl_opts=(-w -t 600 -p "$IDEM_SERVER_WRAPPER")
	info "starting server: port $port, socket dir $sock, log $IDEM_SERVER_LOG"
	if ! as_pg "$PG_BINDIR/pg_ctl" -D "$IDEM_PGDATA" -l "$IDEM_SERVER_LOG" "${pgctl_opts[@]}" start >/dev/null; then
		err "server failed to start; log: $IDEM_SERVER_LOG (its tail is printed at the end)"
		return 1
	fi
	export PGHOST=$sock PGPORT=$port PGUSER=postgres
	export IDEM_SERVER_LOG
	if ! as_pg "$PG_BINDIR/pg_isready" -q -t 30; then
		err "server started but pg_isready fails; log: $IDEM_SERVER_LOG"
		return 1
	fi
}

# stop_servers_under DIR: stop every postmaster whose data directory lies
# under DIR: our server, TAP test nodes left behind by a killed test, a
# bench script's private server.  Nothing outside our temp root is touched.
stop_servers_under() {
	local root=$1 pidfile datadir pid
	[[ -n $root && -d $root ]] || return 0
	while IFS= read -r -d '' pidfile; do
		datadir=$(dirname "$pidfile")
		as_pg "$PG_BINDIR/pg_ctl" -D "$datadir" -m fast -w -t 30 stop >/dev/null 2>&1 && continue
		# pg_ctl could not stop it: kill the postmaster by pid, but only
		# if that pid really is a postmaster running in this data dir.
		pid=$(head -n 1 "$pidfile" 2>/dev/null) || continue
		[[ $pid =~ ^[0-9]+$ ]] || continue
		if [[ $(readlink "/proc/$pid/cwd" 2>/dev/null) == "$datadir" ]]; then
			kill -KILL "$pid" 2>/dev/null || true
		fi
	done < <(find "$root" -name postmaster.pid -print0 2>/dev/null)
}

# ------------------------------------------------------------- counting

# count_pg_regress LOG: "PASSED FAILED" from pg_regress/pg_isolation_regress
# output.  PG15 prints one line per test file:
#   test foo                          ... ok           12 ms
#        foo                          ... FAILED       12 ms   (parallel group)
# PG16 and later print TAP:
#   ok 1         - foo                                  12 ms
#   not ok 2     + foo                                  12 ms   (+: parallel group)
# "failed (ignored)" ("# (ignored)") counts as passed, as pg_regress itself does.
count_pg_regress() {
	awk '/ \.\.\. ok( |$)/ { p++ }
		/ \.\.\. failed \(ignored\)/ { p++ }
		/ \.\.\. FAILED/ { f++ }
		/^ok [0-9]+ +[-+] / { p++ }
		/^not ok [0-9]+ +[-+] / { if ($0 ~ /# \(ignored\)/) p++; else f++ }
		END { print p + 0, f + 0 }' "$1"
}
