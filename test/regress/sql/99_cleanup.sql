--
-- 99_cleanup: drop the test roles so that the suite can run again.
--
\set VERBOSITY default

-- The roles own the functions and the schema of 70_roles.  Their records in
-- idem_record do not depend on them (a dropped role's records expire and
-- are purged like any other).
DROP OWNED BY regress_idem_a, regress_idem_b, regress_idem_nobody;
DROP ROLE regress_idem_a;
DROP ROLE regress_idem_b;
DROP ROLE regress_idem_nobody;
SELECT count(*) AS test_roles_left FROM pg_roles WHERE rolname LIKE 'regress_idem_%';
