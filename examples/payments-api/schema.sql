-- Database objects of the payments example.  Run once per database:
--   psql -v ON_ERROR_STOP=1 -f schema.sql
-- (CREATE EXTENSION needs a superuser or the database owner with CREATE
-- rights: the extension is not trusted.)

CREATE EXTENSION IF NOT EXISTS idempotency;

-- The simulated payment provider's ledger: one row per charge it made.
-- provider_key is the Idempotency-Key the API passed on.  It is NOT unique
-- on purpose: a real provider would deduplicate on it, which would hide a
-- double charge made by the API; this one records every call, so the
-- example's test can count charges per key.
CREATE TABLE IF NOT EXISTS charges (
	id				bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
	provider_key	text NOT NULL,
	customer		text NOT NULL,
	amount			bigint NOT NULL CHECK (amount > 0),
	currency		text NOT NULL CHECK (currency ~ '^[A-Z]{3}$'),
	created_at		timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS charges_provider_key ON charges (provider_key);
