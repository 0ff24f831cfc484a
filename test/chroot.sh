# shellcheck shell=bash
# test/chroot.sh: the Debian chroots in which test/run tests the PostgreSQL
# versions the host does not have (sourced by test/run, not executed).
#
#   17: Debian trixie (its postgresql-17)
#   18: Debian sid    (its postgresql-18)
#
# A chroot is made by mmdebstrap (--variant=minbase) on first use, from the
# Debian archive the host's apt uses, under $IDEM_CHROOT_DIR (default
# /var/cache/idempotency-test, never inside the repository), and reused
# afterwards: chroot-17/, chroot-18/, about 1.5 GB each, a minute to make.
# A chroot is made again when the package list below changes (it is kept
# in the chroot's /.idem-packages) or when IDEM_CHROOT_REFRESH=1.
#
# While a run uses a chroot it holds chroot-N.lock (a second run waits) and
# mounts proc on its /proc and a tmpfs on its /dev/shm (PostgreSQL's
# dynamic shared memory); chroot_release unmounts them, on every exit path
# (test/run's EXIT trap calls it).  Nothing of the host is bind-mounted.
#
# Functions return non-zero and print why on failure; they never exit.

IDEM_CHROOT_DIR=${IDEM_CHROOT_DIR:-/var/cache/idempotency-test}
declare -a CHROOT_MOUNTS=()	# mount points to unmount, in mount order
CHROOT_LOCK_FD=""

# chroot_dist VERSION: the Debian suite that ships postgresql-VERSION
chroot_dist() {
	case $1 in
	17) echo trixie ;;
	18) echo sid ;;
	*) return 1 ;;
	esac
}

# chroot_packages VERSION: what the suites need inside (test/lib.sh
# missing_packages is the list for the host), the Debian packaging tools
# for test/package/run, and pg_tle's build dependencies
# (test/pgtle/install), so that a run finds them in the chroot made in the
# background (chroot_prepare_bg).  Not Citus's: test/citus/install installs
# them where Citus builds (in the background too), and in sid one of them
# is at times uninstallable, where Citus does not build anyway.
chroot_packages() {
	local v=$1 mod python=""
	# the python suite's packages (test/lib.sh PYTHON_MODULES)
	for mod in $PYTHON_MODULES; do
		python+=" ${mod#*:}"
	done
	echo "postgresql-$v postgresql-server-dev-$v postgresql-$v-repack" \
		"make gcc libc6-dev libpq-dev perl libipc-run-perl pgbouncer nodejs npm" \
		"locales-all prometheus-postgres-exporter curl prometheus" \
		"flex libkrb5-dev" \
		"build-essential debhelper dpkg-dev fakeroot postgresql-server-dev-all$python"
}

# chroot_mirror: the Debian archive the host's apt uses (deb822 or one-line
# sources), deb.debian.org if none is found; IDEM_DEBIAN_MIRROR overrides.
chroot_mirror() {
	local uri=${IDEM_DEBIAN_MIRROR:-}
	if [[ -z $uri ]]; then
		uri=$(awk '
			/^URIs:/ { u = $2 }
			/^Suites:/ && u != "" && $0 !~ /-security/ { print u; exit }
			/^$/ { u = "" }' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n 1)
	fi
	if [[ -z $uri ]]; then
		uri=$(awk '$1 == "deb" && $0 !~ /security/ {
				for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) { print $i; exit } }' \
			/etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null | grep -m1 debian)
	fi
	echo "${uri:-http://deb.debian.org/debian}"
}

chroot_path() { echo "$IDEM_CHROOT_DIR/chroot-$1"; }

# chroot_ready VERSION: the chroot exists, is complete and has today's list
chroot_ready() {
	local c
	c=$(chroot_path "$1")
	[[ -f $c/.idem-packages && -x $c/usr/lib/postgresql/$1/bin/pg_config ]] &&
		[[ $(cat "$c/.idem-packages") == "$(chroot_packages "$1")" ]]
}

# chroot_unmount_all DIR: unmount whatever is mounted at or under DIR
# (deepest first).  Used before removing a chroot and on stale mounts a
# killed run left behind.
chroot_unmount_all() {
	local dir=$1 m
	local -a mps=()
	mapfile -t mps < <(awk -v d="$dir" '$2 == d || index($2, d "/") == 1 { print $2 }' /proc/self/mounts | sort -r)
	for m in "${mps[@]}"; do
		umount "$m" 2>/dev/null || umount -l "$m" || { err "cannot unmount $m"; return 1; }
	done
}

# chroot_create VERSION: make the chroot with mmdebstrap (under the lock).
chroot_create() {
	local v=$1 c dist mirror tmp log
	c=$(chroot_path "$v")
	dist=$(chroot_dist "$v") || { err "no Debian suite known for PostgreSQL $v"; return 1; }
	mirror=$(chroot_mirror)
	tmp=$c.new
	log=$IDEM_CHROOT_DIR/chroot-$v.create.log
	chroot_unmount_all "$tmp" || return 1
	rm -rf --one-file-system "$tmp"
	info "pg$v: creating the $dist chroot $c with mmdebstrap from $mirror (about a minute; log $log)"
	local t0=$SECONDS
	# sid's Release file in a snapshot archive may be past its Valid-Until
	# shellcheck disable=SC2046  # the package list is a list of words
	if ! run_bg mmdebstrap --variant=minbase --mode=root \
		--aptopt='Acquire::Check-Valid-Until "false"' \
		--include="$(chroot_packages "$v" | tr -s ' ' ',')" \
		"$dist" "$tmp" "$mirror" >"$log" 2>&1; then
		err "mmdebstrap failed; last lines of $log:"
		tail -n 30 "$log" >&2
		chroot_unmount_all "$tmp"
		rm -rf --one-file-system "$tmp"
		return 1
	fi
	chroot_packages "$v" >"$tmp/.idem-packages"
	chroot_unmount_all "$c" || return 1
	rm -rf --one-file-system "$c"
	mv "$tmp" "$c"
	info "pg$v: chroot ready in $(( SECONDS - t0 )) s ($(du -sh "$c" | cut -f1))"
}

# chroot_prepare_bg VERSION...: make the chroots of VERSION... that are
# missing or out of date, one after the other, in a background job, while
# the host's version runs its suites (mmdebstrap mostly waits on the network
# and the disk).  Each is made under its lock, so chroot_acquire waits for
# the one being made and finds it ready; one the job failed to make,
# chroot_acquire tries again and reports.  The job's output goes to
# $IDEM_CHROOT_DIR/prepare.log, shown by chroot_prepare_log; end_children
# ends it with the run.
CHROOT_PREPARE_LOG=""
chroot_prepare_bg() {
	local v
	local -a todo=()
	for v in "$@"; do
		chroot_ready "$v" || todo+=("$v")
	done
	(( ${#todo[@]} > 0 )) || return 0
	mkdir -p "$IDEM_CHROOT_DIR"
	CHROOT_PREPARE_LOG=$IDEM_CHROOT_DIR/prepare.log
	info "making the chroot(s) for PostgreSQL ${todo[*]} in the background (log $CHROOT_PREPARE_LOG)"
	# appended to: chroot_prepare_log empties it while the job writes
	: >"$CHROOT_PREPARE_LOG"
	(
		for v in "${todo[@]}"; do
			exec {CHROOT_LOCK_FD}>"$IDEM_CHROOT_DIR/chroot-$v.lock"
			flock "$CHROOT_LOCK_FD"
			chroot_ready "$v" || chroot_create "$v"
			exec {CHROOT_LOCK_FD}>&-
		done
	) >>"$CHROOT_PREPARE_LOG" 2>&1 </dev/null &
}

# chroot_prepare_log: what the background job printed (once it is done
# with the chroot this run now holds).
chroot_prepare_log() {
	[[ -n $CHROOT_PREPARE_LOG && -s $CHROOT_PREPARE_LOG ]] || return 0
	sed 's/^/  (background) /' "$CHROOT_PREPARE_LOG"
	: >"$CHROOT_PREPARE_LOG"
}

# chroot_acquire VERSION: lock the chroot (waiting for another run), make
# it if needed, mount /proc and /dev/shm.  Sets CHROOT_ROOT.
chroot_acquire() {
	local v=$1 c
	c=$(chroot_path "$v")
	mkdir -p "$IDEM_CHROOT_DIR"
	exec {CHROOT_LOCK_FD}>"$IDEM_CHROOT_DIR/chroot-$v.lock"
	if ! flock -n "$CHROOT_LOCK_FD"; then
		info "pg$v: waiting for another run to release $c"
		flock "$CHROOT_LOCK_FD"
	fi
	chroot_prepare_log
	if [[ ${IDEM_CHROOT_REFRESH:-0} == 1 ]] || ! chroot_ready "$v"; then
		chroot_create "$v" || return 1
	fi
	# what a run that was killed left behind: processes, mounts, temp
	# files (we hold the lock: no other run is using them)
	chroot_reap "$c"
	chroot_unmount_all "$c" || return 1
	find "$c/tmp" "$c/var/tmp" -mindepth 1 -maxdepth 1 -exec rm -rf --one-file-system {} + 2>/dev/null || true
	mount -t proc proc "$c/proc" || { err "cannot mount proc on $c/proc"; return 1; }
	CHROOT_MOUNTS+=("$c/proc")
	mkdir -p "$c/dev/shm"
	mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs "$c/dev/shm" ||
		{ err "cannot mount a tmpfs on $c/dev/shm"; return 1; }
	CHROOT_MOUNTS+=("$c/dev/shm")
	# name resolution for apt inside (test/package/run on a changed list)
	cp -L /etc/resolv.conf "$c/etc/resolv.conf" 2>/dev/null || true
	# shellcheck disable=SC2034  # read by test/run
	CHROOT_ROOT=$c
}

# chroot_reap DIR: end every process whose root is the chroot DIR (servers
# a killed run left behind); we hold its lock, so they are ours.
chroot_reap() {
	local dir=$1 p
	local -a pids=()
	for p in /proc/[0-9]*; do
		[[ $(readlink "$p/root" 2>/dev/null) == "$dir" ]] && pids+=("${p#/proc/}")
	done
	(( ${#pids[@]} > 0 )) || return 0
	warn "ending ${#pids[@]} process(es) left in $dir"
	kill -TERM "${pids[@]}" 2>/dev/null
	sleep 3
	kill -KILL "${pids[@]}" 2>/dev/null
	return 0
}

# chroot_release: unmount what chroot_acquire mounted, release the lock.
chroot_release() {
	local i m
	(( ${#CHROOT_MOUNTS[@]} == 0 )) || chroot_reap "${CHROOT_MOUNTS[0]%/proc}"
	for (( i = ${#CHROOT_MOUNTS[@]} - 1; i >= 0; i-- )); do
		m=${CHROOT_MOUNTS[i]}
		# a process still inside (it should not be) keeps the mount busy
		umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null ||
			err "could not unmount $m"
	done
	CHROOT_MOUNTS=()
	if [[ -n $CHROOT_LOCK_FD ]]; then
		exec {CHROOT_LOCK_FD}>&-
		CHROOT_LOCK_FD=""
	fi
	return 0
}
