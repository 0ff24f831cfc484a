# idempotency: PGXS build.  `test/run check` is the way to run every suite;
# `make installcheck` runs them against an already running server.

EXTENSION = idempotency
MODULE_big = idempotency
# $(srcdir) (set by PGXS: "." in the tree, the VPATH out of it) keeps
# out-of-tree builds, as pg_buildext does them, working; OBJS is expanded
# only where it is used, after PGXS has set srcdir
OBJS = $(patsubst $(srcdir)/%.c,%.o,$(wildcard $(srcdir)/src/*.c))
# the install script of 1.0 and the update scripts, beside the control file
UPDATE_CHAIN = idempotency--1.0.sql \
	idempotency--1.0--1.1.sql \
	idempotency--1.1--1.2.sql \
	idempotency--1.2--1.3.sql \
	idempotency--1.3--1.4.sql \
	idempotency--1.4--1.5.sql \
	idempotency--1.5--1.6.sql
DATA = $(UPDATE_CHAIN)
# the install script of 1.6 is built from them (below)
DATA_built = idempotency--1.6.sql
PGFILEDESC = "idempotency - Idempotency-Key semantics inside PostgreSQL"

# No -Werror here: a newer compiler's new warning must not break a user's
# build.  test/run builds with COPT=-Werror, so CI treats warnings as errors.
PG_CPPFLAGS = -Wall -Wextra -Wno-unused-parameter \
	-Wno-sign-compare -Wno-missing-field-initializers

# pg_regress: test/regress/sql/*.sql against test/regress/expected/*.out,
# in this order (00_setup creates the extension and the roles, 99_cleanup
# drops the roles).  The results (results/, regression.diffs,
# regression.out) stay where PGXS puts them, in the build directory, where
# `make clean` and pg_buildext installcheck (which prints regression.diffs
# on failure) look for them.
REGRESS = 00_setup 10_claim 20_arguments 30_settings 40_fingerprint \
	50_lease 60_admin 70_roles 80_batch 85_durability 87_monitoring 90_upgrade \
	95_recovery 96_writes 97_names 98_forget 99_cleanup
REGRESS_OPTS = --inputdir=$(testsrc)/test/regress

# isolation tester: test/isolation/specs/*.spec against
# test/isolation/expected/*.out, in this order (00-helpers creates the
# helper functions the others use); its results go to output_iso/
ISOLATION = 00-helpers dup-committed dup-uncommitted fingerprint-mismatch \
	inspect-uncommitted lease-renew lease-takeover relcache-inval repeatable-read \
	role-namespace same-transaction sleep-vs-vacuum-full wait-cancel \
	checkpoint-takeover finish-moves-record remember writer-new-index \
	after-replay
ISOLATION_OPTS = --inputdir=$(testsrc)/test/isolation
# the source tree, for the two --inputdir above: $(srcdir) (set by PGXS:
# "./" in the tree, the VPATH or the -f Makefile's directory out of it)
# without its trailing slash; expanded only where it is used
testsrc = $(patsubst %/,%,$(srcdir))

# TAP: test/t/*.pl
TAP_TESTS = 1
PROVE_TESTS = test/t/*.pl

EXTRA_CLEAN = output_iso

PG_CONFIG ?= pg_config
# `make portable` alone needs no PostgreSQL installation (see the end)
ifneq ($(MAKECMDGOALS),portable)
PGXS := $(shell $(PG_CONFIG) --pgxs)
include $(PGXS)
endif

# every file may include any of our headers (PGXS tracks no header
# dependencies);
# after the include, where srcdir and so OBJS are known
$(OBJS): $(wildcard $(srcdir)/src/*.h)

# Out of tree, the objects (and LLVM bitcode) go to src/ under the build
# directory, which must exist first.  An absolute name, because make would
# find the source tree's src/ through VPATH.
$(OBJS) $(OBJS:.o=.bc): | $(CURDIR)/src
$(CURDIR)/src:
	mkdir -p $@

# idempotency--1.6.sql: idempotency--1.6.sql.in with its place-holder line
# replaced by the statements of UPDATE_CHAIN, each script under a "from"
# line, without its psql guard (\echo ... \quit) and without its comments,
# which describe each step as it was taken: the frame describes the schema
# as it is.  A new installation is then exactly an updated one.
idempotency--1.6.sql: $(srcdir)/idempotency--1.6.sql.in $(addprefix $(srcdir)/,$(UPDATE_CHAIN))
	awk -v chain='$(addprefix $(srcdir)/,$(UPDATE_CHAIN))' ' \
		$$0 != "@UPDATE_CHAIN@" { print; next } \
		{ \
			n = split(chain, file, " "); \
			for (i = 1; i <= n; i++) { \
				name = file[i]; sub(/.*\//, "", name); \
				print "-- ---------------- from " name " ----------------"; \
				incomment = 0; blank = 1; \
				while ((getline line < file[i]) > 0) { \
					if (incomment) { if (line ~ /\*\//) incomment = 0; continue; } \
					if (line ~ /^\/\*/) { if (line !~ /\*\//) incomment = 1; continue; } \
					if (line ~ /^--/ || line ~ /^\\echo /) continue; \
					if (line ~ /^[ \t]*$$/) { if (!blank) print ""; blank = 1; continue; } \
					print line; blank = 0; \
				} \
				close(file[i]); \
				if (!blank) print ""; \
			} \
		}' $(srcdir)/idempotency--1.6.sql.in > $@.tmp && mv $@.tmp $@

# The portable edition (portable/README.md): its install files, generated
# from portable/src/ by a shell script, with no pg_config and no headers.
# They are committed; this is the one way to change them.
portable:
	sh $(or $(srcdir),.)/portable/generate.sh
.PHONY: portable
