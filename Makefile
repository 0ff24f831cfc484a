# idempotency: PGXS build.  `test/run check` is the way to run every suite;
# `make installcheck` runs them against an already running server.

EXTENSION = idempotency
MODULE_big = idempotency
# $(srcdir) keeps out-of-tree (VPATH) builds, as pg_buildext does them, working
OBJS = $(patsubst $(srcdir)/%.c,%.o,$(wildcard $(srcdir)/src/*.c))
DATA = $(wildcard sql/idempotency--*.sql)
PGFILEDESC = "idempotency - Idempotency-Key semantics inside PostgreSQL"

# No -Werror here: a newer compiler's new warning must not break a user's
# build.  test/run builds with COPT=-Werror, so CI treats warnings as errors.
PG_CPPFLAGS = -Wall -Wextra -Wno-unused-parameter \
	-Wno-sign-compare -Wno-missing-field-initializers

# pg_regress: sql/*.sql against expected/*.out (the install script is not a test)
REGRESS = $(filter-out idempotency--%,$(basename $(notdir $(wildcard sql/*.sql))))

# isolation tester: test/specs/*.spec against test/expected/*.out
ISOLATION = $(basename $(notdir $(wildcard test/specs/*.spec)))
ISOLATION_OPTS = --inputdir=test

# TAP: test/t/*.pl
TAP_TESTS = 1
PROVE_TESTS = test/t/*.pl

EXTRA_CLEAN = test/results test/output_iso output_iso

PG_CONFIG ?= pg_config
PGXS := $(shell $(PG_CONFIG) --pgxs)
include $(PGXS)
